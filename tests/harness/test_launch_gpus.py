"""SLURM and torchrun jobs are GPU jobs unless the CPU is asked for: every documented ``sbatch`` requests GPUs
(and the script does by default), the scripts take the ranks per node from SLURM's own GPU variables, and a
job of several ranks that finds no CUDA device with ``train.device=auto`` stops in one line before any rank
trains. Fake ``srun``/``scontrol``/``sbatch`` on PATH (tests/harness/fault_util.py, test_bert_chain.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kfac_bench.config.compose import compose_run
from kfac_bench.errors import ConfigError, UserError
from kfac_bench.launcher.agent import world_size_of
from kfac_bench.launcher.preflight import check_run
from tests.harness.fault_util import one_error_line, sbatch, slurm_env
from tests.harness.test_bert_chain import _chain, _options
from tests.harness.util import REPO, TINY, cli_env, run_cli
from tests.limits import hang_limit

#: TINY without its explicit ``train.device=cpu``: what a user who forgot to ask for GPUs runs.
AUTO = [o for o in TINY if not o.startswith("train.device=")]
RECORD_SRUN = 'printf "%s\\n" "$@" > "$SRUN_ARGS"\n'
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
REFUSAL = "with train.device=auto but this machine has no usable CUDA device"


def _documented_sbatch_lines() -> list[tuple[str, str]]:
    files = [REPO / "README.md", REPO / "recipes" / "README.md", *(REPO / "recipes").glob("*.yaml")]
    files += [p for p in (REPO / "launch").iterdir() if p.is_file()]
    found = []
    for path in files:
        for line in path.read_text().splitlines():
            if re.search(r"\bsbatch (--|launch/)", line) and "slurm.sbatch" in line:
                found.append((path.name, line.strip()))
    return found


def test_every_documented_sbatch_requests_gpus() -> None:
    lines = _documented_sbatch_lines()
    assert (
        len(lines) >= 10
    )  # README, recipes/README.md, the recipes' headers, the script's own header
    missing = [f"{name}: {line}" for name, line in lines if "--gpus-per-node=" not in line]
    assert not missing, "\n".join(missing)
    header = (REPO / "launch" / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --gpus-per-node=\d+$", header, re.MULTILINE)  # and by default


def test_the_readme_names_only_variables_the_multinode_script_reads() -> None:
    script = (REPO / "launch" / "torchrun_multinode.sh").read_text()
    body = "\n".join(line for line in script.splitlines() if not line.startswith("#"))
    for doc in (REPO / "README.md", REPO / "recipes" / "README.md"):
        for line in doc.read_text().splitlines():
            if "torchrun_multinode.sh +" in line:
                for name in re.findall(r"\b([A-Z_]+)=", line):
                    assert name in body, f"{doc.name} sets {name}, which the script never reads"


def test_the_bert_chain_requests_gpus_for_every_job(tmp_path: Path) -> None:
    result, calls = _chain(tmp_path, "kfac", "kfac", GPUS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    options = [_options(c)[0] for c in calls]
    assert [o["gpus-per-node"] for o in options] == ["4", "4", "1"]
    # and CPUs for every rank and its 4 DataLoader workers
    assert [o["cpus-per-task"] for o in options] == ["20", "20", "5"]
    (tmp_path / "default").mkdir()
    result, calls = _chain(tmp_path / "default", "lamb", "lamb")
    assert [_options(c)[0]["gpus-per-node"] for c in calls] == ["8", "8", "1"]
    assert [_options(c)[0]["cpus-per-task"] for c in calls] == ["40", "40", "5"]


@pytest.mark.parametrize(
    ("gpu_env", "ranks"),
    [
        ({"SLURM_GPUS_ON_NODE": "3"}, "3"),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, "4"),
        ({"SLURM_GPUS_PER_NODE": "2"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, "3"),
        ({"GPUS_PER_NODE": "5", "SLURM_GPUS_ON_NODE": "3"}, "5"),  # an explicit count wins
    ],
    ids=["on_node", "per_node_typed", "per_node", "visible_devices", "explicit"],
)
def test_ranks_per_node_follow_slurm_s_gpus(
    tmp_path: Path, gpu_env: dict[str, str], ranks: str
) -> None:
    e = slurm_env(tmp_path, srun=RECORD_SRUN)
    e.pop("GPUS_PER_NODE")
    e.update(gpu_env, SRUN_ARGS=str(tmp_path / "srun.args"))
    proc = sbatch(tmp_path, e, "+recipe=digits")
    _, err = proc.communicate(timeout=hang_limit(60))
    assert proc.returncode == 0, err
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert f"--nproc-per-node={ranks}" in args


def test_no_gpus_from_slurm_is_one_line(tmp_path: Path) -> None:
    e = slurm_env(tmp_path, srun=RECORD_SRUN)
    e.pop("GPUS_PER_NODE")
    e.update(SLURM_GPUS_PER_NODE="0", SRUN_ARGS=str(tmp_path / "srun.args"))
    proc = sbatch(tmp_path, e, "+recipe=digits")
    _, err = proc.communicate(timeout=hang_limit(60))
    assert proc.returncode == 2 and not (tmp_path / "srun.args").exists()
    assert "no GPU count: submit with --gpus-per-node=N" in one_error_line(err)


@pytest.mark.slow
@NO_CUDA
def test_a_slurm_job_with_ranks_but_no_gpu_refuses_before_training(tmp_path: Path) -> None:
    # The `--export=ALL,GPUS_PER_NODE=2` form without a GPU request: 2 ranks, no CUDA, train.device=auto.
    e = slurm_env(tmp_path)
    proc = sbatch(tmp_path, e, *AUTO)
    _, err = proc.communicate(timeout=hang_limit(120))
    assert proc.returncode == 2, err[-3000:]
    line = one_error_line(err)
    assert f"a job of 2 ranks {REFUSAL}" in line and "train.device=cpu" in line
    assert not (tmp_path / "runs" / "slurm-4242" / "summary.json").exists()
    assert not (tmp_path / "scontrol.log").exists()


@pytest.mark.slow
@NO_CUDA
def test_launcher_torchrun_on_the_cpu_needs_train_device_cpu(tmp_path: Path) -> None:
    result = run_cli(
        "train",
        *AUTO,
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert f"a job of 2 ranks {REFUSAL}" in one_error_line(result.stderr)
    assert not (tmp_path / "run").exists()  # refused before Hydra or torchrun started anything


@pytest.mark.slow
@NO_CUDA
def test_the_multinode_script_without_a_gpu_count_on_a_cpu_node_is_one_line(tmp_path: Path) -> None:
    env = cli_env()
    env.pop("GPUS_PER_NODE", None)
    env.update(NNODES="1", MASTER_ADDR="127.0.0.1", RUN_ID="mn", PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun_multinode.sh"), *TINY],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    assert result.returncode == 2
    assert "--nproc-per-node=gpu (one rank per GPU) but this machine has no usable CUDA device" in (
        one_error_line(result.stderr)
    )


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        (
            {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
            True,
        ),  # a rank of plain torchrun
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, True),  # srun with one task per GPU
        ({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}, False),
        ({}, False),
    ],
    ids=["torchrun_rank", "srun_tasks", "world_1", "single"],
)
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_a_rank_of_a_multi_rank_job_refuses_the_cpu_unless_asked(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], refused: bool, device: str
) -> None:
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_run([*AUTO, f"train.device={device}"])
    if refused and device == "auto":
        with pytest.raises(ConfigError, match=REFUSAL):
            check_run(cfg)
    else:
        check_run(cfg)


def test_world_size_of_torchrun_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    tail = ["-m", "kfac_bench.cli", "train", "--nproc-per-node=9"]  # after -m: not torchrun's
    assert world_size_of(["--nnodes=2", "--nproc-per-node=4", *tail]) == 8
    assert world_size_of(["--nnodes", "1:3", "--nproc-per-node", "2", *tail]) == 6
    assert world_size_of(["--standalone", *tail]) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--nproc-per-node=gpu"):
        world_size_of(["--nnodes=2", "--nproc-per-node=gpu", *tail])
