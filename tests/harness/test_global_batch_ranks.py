"""Two ranks run the digits recipe's experiment, not a larger batch: each rank takes half of the global
batch of 256, the epoch keeps its 5 optimizer steps, and the start line names the arm's K-FAC strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.util import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_two_ranks_keep_the_recipes_global_batch(tmp_path: Path) -> None:
    done = run_cli(
        "train",
        "+recipe=digits",
        "train.epochs=1",
        "train.limit_eval_batches=1",
        "train.tensorboard=false",
        "train.progress=none",
        "train.device=cpu",
        "kfac.grad_worker_fraction=mem_opt",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=0",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start = next(line for line in done.stdout.splitlines() if "| world 2 on cpu |" in line)
    assert "SGD + K-FAC (MEM-OPT) | 5 steps/epoch, global batch 256 (128 per rank x 2: " in start
    assert "recipe:" not in start  # the recipe's batch: nothing to point out
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (s["world_size"], s["global_batch"], s["recipe_global_batch"]) == (2, 256, 256)
    assert s["config"]["train"]["batch_size"] == 128 and s["global_batch_note"] is None
    assert s["steps"] == 5 and s["samples"] == 5 * 256
