"""A plain ``torchrun -m kfac_bench.cli train`` without ``hydra.run.dir``: every rank composes its own
generated name (another time stamp and random suffix), so the ranks take rank 0's directory and rank 1 leaves
no directory of its own, not even one holding only ``.hydra/``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.util import TINY, cli_env
from tests.limits import hang_limit


@pytest.mark.distributed
def test_plain_torchrun_writes_one_run_directory(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "kfac_bench.cli",
            "train",
            *TINY,
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=hang_limit(180),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # rank 0's Hydra record
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "runs"
    ]  # nothing in the working directory
