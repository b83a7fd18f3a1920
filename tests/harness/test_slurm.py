"""``launch/slurm.sbatch`` and ``launch/bert_chain.sh`` on a real single-node SLURM (munged, slurmctld and
slurmd started by :mod:`tests.harness.slurm_cluster`): ``sbatch -> srun -> agent -> ranks`` to success,
two jobs on the node at once (each on its own rendezvous port), preemption by a signal and
``scontrol requeue`` resumed to success, a crashed rank failing its job (no requeue), and the BERT chain's
``afterok`` dependencies in miniature.
Skipped, with one line, where SLURM is not installed (``make test-slurm`` installs it as root).

The node has no GPUs: each job asks for ``--gpus-per-node=0`` and sets its ranks with ``GPUS_PER_NODE``
(the script's ``--export=ALL,GPUS_PER_NODE=N`` form) and ``train.device=cpu``. Every job is submitted
before the first test (:func:`_all_submitted`), so that they run together; each test then checks its own.
All the tests are in this one file, so that one pytest-xdist worker (``--dist loadfile``) owns the cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kfac_bench.launcher.rundir import PREEMPTED_FILE
from tests.harness import slurm_cluster
from tests.harness.fault_util import env, eval_steps, fault, processes_mentioning, shim, summary
from tests.harness.util import REPO, TINY, TINY_SETTINGS, user_config_dir
from tests.limits import hang_limit

_WHY = slurm_cluster.missing()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
]

SCRIPT = REPO / "launch" / "slurm.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
DONE = ("success", "target_not_reached")


@pytest.fixture(scope="session")
def cluster() -> Iterator[None]:
    """The cluster, started for this session unless it was running (then left running)."""
    started = slurm_cluster.up()
    yield
    if started:
        slurm_cluster.down()


def job_env(ranks: int, **extra: str) -> dict[str, str]:
    """The submitting shell's environment (sbatch exports all of it to the job): the CLI's, with the
    cluster's ``SLURM_CONF`` and no variables of an enclosing SLURM job."""
    e = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    for gpus in ("CUDA_VISIBLE_DEVICES", "RDZV_PORT"):
        e.pop(gpus, None)
    e.update(slurm_cluster.env({}), PYTHON=sys.executable, GPUS_PER_NODE=str(ranks))
    e.update(extra)
    return e


#: What every test job asks for beyond the script's own directives: no GPUs, a share of this node.
CPU_JOB = ["--gpus-per-node=0", "--mem-per-cpu=1G"]


def submit(cwd: Path, e: dict[str, str], *options: str, args: tuple[str, ...] = ()) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", *CPU_JOB, *options, str(SCRIPT), *args],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=hang_limit(30),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, StartTime, EndTime, NumCPUs, ...)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id],
        env=slurm_cluster.env(),
        capture_output=True,
        text=True,
        timeout=hang_limit(30),
        check=True,
    ).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def cancel(*job_ids: str) -> None:
    """End what is left of the jobs (nothing, after a test that passed)."""
    subprocess.run(["scancel", *job_ids], env=slurm_cluster.env(), capture_output=True, check=False)


def wait_for(job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + hang_limit(timeout)
    while (info := job(job_id))["JobState"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {info['JobState']}"
        time.sleep(0.2)
    return info


def output(cwd: Path, job_id: str) -> str:
    return (cwd / f"slurm-{job_id}.out").read_text()


def _ended(info: dict[str, str], cwd: Path, job_id: str) -> None:
    log = output(cwd, job_id)[-3000:]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log


@pytest.fixture(scope="module")
def preemptible(
    cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, str]]:
    """A 2-rank job on 2 CPUs whose rank 0 holds at its 3rd step until a preemption signal reaches it, with
    an interpreter that records what srun gave its task (``step.env``)."""
    tmp_path = tmp_path_factory.mktemp("preempt")
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    steps_env = tmp_path / "step.env"  # what srun gave the task, each time the job ran
    shim(
        python,
        f'if [ -n "${{SLURM_STEP_ID:-}}" ] && [ "$SLURM_STEP_ID" != batch ]; then\n'
        f'  echo "$SLURM_STEP_ID $SLURM_CPUS_PER_TASK" >> {steps_env}; fi\n'
        f'exec {sys.executable} "$@"\n',
    )
    marker = tmp_path / "held"
    args = (*TINY, "train.epochs=4", "train.checkpoint_every_epochs=0")
    e = job_env(2, PYTHON=str(python), MAX_RESTARTS="1")
    j = submit(tmp_path, e, "--cpus-per-task=2", args=(*args, *fault(marker, 3, "hold")))
    yield tmp_path, j
    cancel(j)


def test_preemption_by_signal_is_requeued_and_resumes_to_success(
    preemptible: tuple[Path, str],
) -> None:
    """``scancel --batch --signal=USR1`` (what ``--signal=B:USR1@180`` sends) while rank 0 is mid-run: the
    ranks checkpoint, the script requeues the job (once, with torchrun restarts allowed), and the requeued
    job resumes the same run directory to the end. srun gets the job's CPUs (2) for its task."""
    tmp_path, j = preemptible
    marker, steps_env = tmp_path / "held", tmp_path / "step.env"
    run_dir = tmp_path / "runs" / f"slurm-{j}"
    deadline = time.monotonic() + hang_limit(120)
    while not marker.exists():  # rank 0 holds at its 3rd step until the signal reaches it
        assert job(j)["JobState"] in ("PENDING", "RUNNING"), output(tmp_path, j)[-3000:]
        assert time.monotonic() < deadline, "rank 0 never reached its 3rd step"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", j], env=slurm_cluster.env(), check=True)
    info = wait_for(j, ("PENDING", *ENDED))  # requeued: held back by SLURM's begin time
    assert info["JobState"] == "PENDING", output(tmp_path, j)[-3000:]
    assert summary(run_dir)["status"] == "preempted" and (run_dir / PREEMPTED_FILE).is_file()
    # SLURM holds a requeued job back for 2 minutes; the test lets it start 2 s on (not in the second of
    # the requeue, whose launch credential slurmd takes for the killed one's), once its ranks are gone.
    deadline = time.monotonic() + hang_limit(60)
    while processes_mentioning(str(run_dir)):
        assert time.monotonic() < deadline, "the preempted ranks did not end"
        time.sleep(0.1)
    subprocess.run(
        ["scontrol", "update", f"JobId={j}", "StartTime=now+2"],
        env=slurm_cluster.env(),
        check=True,
    )
    info = wait_for(j, ENDED)
    _ended(info, tmp_path, j)
    out = output(tmp_path, j)
    assert info["Restarts"] == "1" and out.count(f"requeueing job {j}") == 1
    starts = out.count("kfac-bench: run dir")
    assert starts == 2  # once per start of the job: the preempted ranks were not restarted
    s = summary(run_dir)
    assert s["status"] in DONE and s["steps"] == 24 and s["world_size"] == 2
    assert not (run_dir / PREEMPTED_FILE).exists()
    assert eval_steps(run_dir) == sorted(set(eval_steps(run_dir)))  # no step logged twice
    assert steps_env.read_text().split() == ["0", "2", "0", "2"]  # each start: step 0, 2 CPUs
    assert not processes_mentioning(str(run_dir))


@pytest.fixture(scope="module")
def pair(
    cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, str, str]]:
    """Two 2-rank jobs, one training a user's recipe from ``--config-dir`` (a space in its path)."""
    tmp_path = tmp_path_factory.mktemp("pair")
    user = user_config_dir(tmp_path)
    mine = ("--config-dir", str(user), *TINY_SETTINGS, "+recipe=mine", "kfac=none")
    a = submit(tmp_path, job_env(2), "--cpus-per-task=1", args=(*mine, "train.epochs=1"))
    b = submit(tmp_path, job_env(2), "--cpus-per-task=1", args=(*TINY, "train.epochs=1"))
    yield tmp_path, a, b
    cancel(a, b)


def test_two_two_rank_jobs_share_the_node_at_once(pair: tuple[Path, str, str]) -> None:
    """``sbatch -> srun -> agent -> 2 ranks`` to success, twice at once on one node, each job on its own
    rendezvous port."""
    tmp_path, a, b = pair
    ja, jb = wait_for(a, ENDED), wait_for(b, ENDED)
    _ended(ja, tmp_path, a)
    _ended(jb, tmp_path, b)
    # Both ran at once: each started before the other ended (SLURM's times, to the second).
    assert ja["StartTime"] < jb["EndTime"] and jb["StartTime"] < ja["EndTime"]
    assert ja["NodeList"] == jb["NodeList"] and ja["NumCPUs"] == jb["NumCPUs"] == "1"
    ports = []
    for job_id in (a, b):
        found = re.search(r"rendezvous \S+:(\d+),", output(tmp_path, job_id))
        assert found, output(tmp_path, job_id)
        ports.append(int(found.group(1)))
    assert ports == [29500 + int(a) % 10000, 29500 + int(b) % 10000]
    sa, sb = summary(tmp_path / "runs" / f"slurm-{a}"), summary(tmp_path / "runs" / f"slurm-{b}")
    assert (
        sa["world_size"] == sb["world_size"] == 2 and sa["status"] in DONE and sb["status"] in DONE
    )
    assert sa["name"] == "mine" and sa["config"]["model"]["hidden"] == 16  # the user's recipe
    assert not (tmp_path / "runs" / f"slurm-{a}" / PREEMPTED_FILE).exists()
    assert ja["Restarts"] == jb["Restarts"] == "0"  # a finished job is not requeued


@pytest.fixture(scope="module")
def crashing(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A 2-rank job whose rank 1 is killed (SIGKILL) at its 10th step."""
    tmp_path = tmp_path_factory.mktemp("crash")
    crash = fault(tmp_path / "fault", 10, "kill", rank=1)
    j = submit(tmp_path, job_env(2), "--cpus-per-task=1", args=(*TINY, "kfac=none", *crash))
    yield tmp_path, j
    cancel(j)


def test_a_crashed_rank_fails_the_job_without_a_requeue(crashing: tuple[Path, str]) -> None:
    tmp_path, j = crashing
    info = wait_for(j, ENDED)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", output(tmp_path, j)[-3000:]
    assert info["Restarts"] == "0" and "requeueing" not in output(tmp_path, j)
    run_dir = tmp_path / "runs" / f"slurm-{j}"
    assert not (run_dir / PREEMPTED_FILE).exists() and not processes_mentioning(str(run_dir))


CHAIN_SBATCH = """\
#!/usr/bin/env bash
# sbatch for launch/bert_chain.sh in miniature: its options, dependencies and run directories as given,
# a one-rank digits run in place of each BERT job (phase 2 and SQuAD start from the previous checkpoint).
args=()
for a in "$@"; do
  case "$a" in
    --gpus-per-node=*) args+=(--gpus-per-node=0 --cpus-per-task=1 --mem-per-cpu=1G {place}) ;;
    --cpus-per-task=*) ;;
    +recipe=*) args+=({tiny} kfac=none train.epochs=1) ;;
    model.init_checkpoint=*) args+=("train.init_from=${{a#model.init_checkpoint=}}") ;;
    *) args+=("$a") ;;
  esac
done
exec sbatch "${{args[@]}}"
"""


def _submit_chain(tmp_path: Path, name: str, **extra: str) -> list[str]:
    """``launch/bert_chain.sh lamb kfac`` into ``tmp_path/name`` through :data:`CHAIN_SBATCH`: its three
    job ids."""
    wrapper = tmp_path / "bin" / "sbatch"
    if not wrapper.exists():
        wrapper.parent.mkdir()
        place = (
            f"--chdir={tmp_path} --output={tmp_path}/slurm-%j.out"  # not the chain's cwd (the repo)
        )
        shim(wrapper, CHAIN_SBATCH.format(tiny=" ".join(TINY), place=place))
    e = job_env(1, SBATCH=str(wrapper), CHAIN_DIR=str(tmp_path / name), NODES="1", **extra)
    e["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{e['PATH']}"
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "bert_chain.sh"), "lamb", "kfac"],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    assert result.returncode == 0, result.stderr
    ids = re.search(r"jobs (\d+) -> (\d+) -> (\d+)", result.stdout)
    assert ids, result.stdout
    return list(ids.groups())


@pytest.fixture(scope="module")
def chains(
    cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, list[str], list[str]]]:
    """Two chains: one that runs, one whose phase 1 fails (an override no config has)."""
    tmp_path = tmp_path_factory.mktemp("chain")
    good = _submit_chain(tmp_path, "chain")
    bad = _submit_chain(tmp_path, "broken", P1_ARGS="+no_such_key=1 train.epochs=-1")
    yield tmp_path, good, bad
    cancel(*good, *bad)


@pytest.fixture(scope="module", autouse=True)
def _all_submitted(
    preemptible: tuple[Path, str],
    pair: tuple[Path, str, str],
    crashing: tuple[Path, str],
    chains: tuple[Path, list[str], list[str]],
) -> None:
    """Every job of the module in the queue before the first test looks at one."""


def test_the_bert_chain_runs_its_jobs_in_order_each_from_the_last_checkpoint(
    chains: tuple[Path, list[str], list[str]],
) -> None:
    """Each job of the chain starts once the one before it has completed (``afterok``; submitted
    together, on a node with room for all three, they would otherwise start at once), in its fixed run
    directory, from the checkpoint the one before it wrote; after a failed phase 1 nothing else runs."""
    tmp_path, jobs, broken = chains
    chain_dir = tmp_path / "chain"
    infos = [wait_for(j, ENDED, timeout=180) for j in jobs]
    for j, info in zip(jobs, infos, strict=True):
        _ended(info, tmp_path, j)
    assert (
        infos[0]["EndTime"] <= infos[1]["StartTime"]
        and infos[1]["EndTime"] <= infos[2]["StartTime"]
    )
    stages = [summary(chain_dir / stage) for stage in ("phase1", "phase2", "squad")]
    assert all(s["status"] in DONE for s in stages)
    assert stages[1]["config"]["train"]["init_from"] == f"{chain_dir}/phase1/checkpoints/last.pt"
    assert stages[2]["config"]["train"]["init_from"] == f"{chain_dir}/phase2/checkpoints/last.pt"
    failed = wait_for(broken[0], ENDED)
    assert failed["JobState"] == "FAILED" and failed["ExitCode"] == "2:0"
    # Phase 2 never starts; SQuAD waits on it.
    reasons = [(job(j)["JobState"], job(j)["Reason"]) for j in broken[1:]]
    assert reasons == [("PENDING", "DependencyNeverSatisfied"), ("PENDING", "Dependency")]
    assert not (tmp_path / "broken" / "phase2").exists()
