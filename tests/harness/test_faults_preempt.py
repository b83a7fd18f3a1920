"""Preemption under every launcher: the run checkpoints, says so with the ``preempted`` marker and exits 75
(local, launcher=torchrun), the SLURM script requeues exactly then (also with torchrun restarts allowed), a
submitit sweep member is requeued by submitit and resumes; ranks are never orphaned, and no checkpoint or
record is lost or repeated across the resume."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.launcher.rundir import PREEMPTED_FILE
from tests.harness.fault_util import (
    eval_steps,
    fault,
    processes_mentioning,
    run,
    start,
    summary,
    wait_for_records,
)
from tests.harness.util import TINY
from tests.limits import hang_limit

pytestmark = pytest.mark.slow

LONG = [*TINY, "train.epochs=2000", "train.eval_every_steps=3", "train.checkpoint_every_epochs=0"]


def _newest_checkpoint_step(run_dir: Path) -> int:
    saved = CheckpointManager(run_dir / CHECKPOINT_DIR, {}).read()
    assert saved is not None
    return int(saved["step"])


def _assert_stopped_with_checkpoint(run_dir: Path) -> int:
    s = summary(run_dir)
    step = s["steps"]
    assert s["status"] == "preempted" and step > 0
    assert _newest_checkpoint_step(run_dir) == step
    assert (run_dir / PREEMPTED_FILE).read_text().startswith(f"step {step} ")
    return int(step)


def test_local_sigusr1_checkpoints_exits_75_and_resumes_without_repeating(tmp_path: Path) -> None:
    proc = start("train", *LONG, "hydra.run.dir=run", cwd=tmp_path)
    try:
        wait_for_records(tmp_path / "run", 2, proc)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=hang_limit(60))
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    step = _assert_stopped_with_checkpoint(tmp_path / "run")
    before = eval_steps(tmp_path / "run")

    resumed = run("train", *LONG, f"train.max_steps={step + 6}", "hydra.run.dir=run", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    assert not (tmp_path / "run" / PREEMPTED_FILE).exists()
    steps = eval_steps(tmp_path / "run")
    assert steps[: len(before)] == before and steps == sorted(set(steps)) and steps[-1] == step + 6


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_torchrun_launcher_forwards_the_signal_and_exits_75_without_restarting(
    tmp_path: Path, sig: signal.Signals
) -> None:
    run_dir = tmp_path / "run"
    proc = start(
        "train",
        *LONG,
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=1",
        "launcher.monitor_interval=0.2",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    try:
        wait_for_records(run_dir, 2, proc, timeout=150)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=hang_limit(90))
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert out.count("kfac-bench: run dir") == 1  # the ranks ran once: no restart
    _assert_stopped_with_checkpoint(run_dir)
    assert summary(run_dir)["world_size"] == 2
    assert not processes_mentioning(str(run_dir))  # no rank left behind


@pytest.mark.distributed
@pytest.mark.parametrize("death", ["kill", "exit"])
def test_a_failed_rank_under_torchrun_restarts_from_the_checkpoint_and_repeats_no_record(
    tmp_path: Path, death: str
) -> None:
    # Rank 1 dies in step 10 (SIGKILLed, or exits with status 1); rank 0 has written the evaluation of
    # step 9 but the newest checkpoint is step 6: the restarted ranks resume at 6 and must not record
    # step 9 twice.
    run_dir = tmp_path / "run"
    result = run(
        "train",
        *TINY,
        *fault(tmp_path / "fault", at=10, action=death, rank=1),
        "kfac=none",
        "train.eval_every_steps=3",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=1",
        "launcher.monitor_interval=0.2",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "fault").read_text() == death  # it died once
    assert "resumed at step 6" in result.stdout
    assert eval_steps(run_dir) == [3, 6, 9, 12]
    s = summary(run_dir)
    assert (
        s["steps"] == 12
        and s["world_size"] == 2
        and s["status"] in ("success", "target_not_reached")
    )
    assert not (run_dir / PREEMPTED_FILE).exists()
    assert not processes_mentioning(str(run_dir))


@pytest.mark.distributed
def test_a_rank_killed_without_restarts_fails_the_launcher_with_no_marker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run(
        "train",
        *TINY,
        *fault(tmp_path / "fault", at=10, action="kill", rank=1),
        "kfac=none",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.monitor_interval=0.2",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 1
    assert not (run_dir / PREEMPTED_FILE).exists() and not (run_dir / "summary.json").exists()
    assert _newest_checkpoint_step(run_dir) == 6
    assert not processes_mentioning(str(run_dir))


def test_a_submitit_sweep_member_is_requeued_by_submitit_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    # The sweep member receives submitit's preemption signal (USR2) in step 8, as SLURM would send it.
    result = run(
        "train",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        "hydra.sweep.dir=sweep",
        "hydra.sweep.subdir=job${hydra.job.num}",
        *TINY,
        "kfac=none",
        *fault(Path("fault"), at=8, action="USR2"),
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job = tmp_path / "sweep" / "job0"
    logs = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.out"))
    assert "kfac-bench: preempted" in logs and "resumed at step 8" in logs
    assert "Requeued job" in "".join(
        p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.*")
    )
    s = summary(job)
    assert s["status"] in ("success", "target_not_reached") and s["steps"] == 12
    assert eval_steps(job) == [6, 12] and not (job / PREEMPTED_FILE).exists()


def test_a_sweep_stops_at_a_signal_and_the_same_command_finishes_it(tmp_path: Path) -> None:
    # SIGTERM in the first job's step 3: that job checkpoints, no other job starts, exit 75.
    args = [
        "train",
        "-m",
        "hydra.sweep.dir=sweep",
        *TINY,
        "kfac=none",
        "train.seed=0,1,2",
        *fault(Path("fault"), at=3, action="TERM"),
    ]
    stopped = run(*args, cwd=tmp_path, timeout=240)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "2 of its 3 jobs not started" in stopped.stdout
    sweep = tmp_path / "sweep"
    (job,) = [p for p in sweep.iterdir() if p.is_dir()]
    assert summary(job)["status"] == "preempted" and (job / PREEMPTED_FILE).exists()
    # The same command finishes the sweep: the stopped job resumes, the others run.
    again = run(*args, cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 3 and all(summary(j)["status"] != "preempted" for j in jobs)
    assert "resumed at step 3" in again.stdout
