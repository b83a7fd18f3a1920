"""Resuming on another number of ranks continues the same run: a 2-rank K-FAC run preempted mid-epoch and
resumed on 1 or on 4 ranks takes the uninterrupted run's steps, samples and epochs and sees exactly its
examples (none repeated or skipped); ``mlperf.log`` logs every epoch once and marks the new world; a world
size that cannot keep the global batch is refused in one line before any rank starts."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.checkpoint.elastic import WORLD_FILE
from kfac_bench.checkpoint.manager import CHECKPOINT_DIR
from tests.harness.fault_util import one_error_line, records, run, summary
from tests.harness.util import TINY
from tests.metrics.mlperf_checker import check, events

pytestmark = pytest.mark.distributed

# Global batch 128 = 32 per micro-batch x 2 ranks x 2 accumulation steps; 3 steps per epoch, 2 epochs,
# K-FAC on. Relative paths: a copy of the folder is the same run (the recorded config names them).
RUN = [
    *TINY,
    "train.accumulation_steps=2",
    "train.benchmark_name=resnet",  # a benchmark the MLPerf compliance checker has rules for
    "model._target_=tests.harness.seen_model.build_seen_fault_once",
    "+model.seen=seen",
    "+model.marker=fault",
    "+model.action=TERM",
    "+model.rank=0",
    "hydra.run.dir=run",
]
TORCHRUN = ["launcher=torchrun", "launcher.max_restarts=0", "launcher.monitor_interval=0.2"]


def _ranks(n: int) -> list[str]:
    return [*TORCHRUN, f"launcher.nproc_per_node={n}"]


def _seen(cwd: Path) -> Counter[str]:
    """Every training example the run's processes saw (digests), with multiplicity."""
    return Counter(line for f in (cwd / "seen").glob("*.txt") for line in f.read_text().split())


def _outcome(cwd: Path) -> dict[str, Any]:
    s = summary(cwd / "run")
    log = events(cwd / "run" / "mlperf.log")
    return {
        "world_size": s["world_size"],
        "kfac_enabled": s["kfac_enabled"],
        "status": s["status"],
        "steps": s["steps"],
        "samples": s["samples"],
        "evals": [(r["step"], r["epoch"], r["samples"]) for r in records(cwd / "run")],
        "epochs": [
            (e["key"], e["metadata"]["epoch_num"], e["metadata"]["samples_count"])
            for e in log
            if e["key"] in ("epoch_start", "epoch_stop")
        ],
        "seen": _seen(cwd),
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("uninterrupted")
    done = run("train", *RUN, "+model.at=1000000", *_ranks(2), cwd=cwd, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return _outcome(cwd)


def test_the_uninterrupted_run_is_two_kfac_ranks_of_launcher_torchrun(
    uninterrupted: dict[str, Any],
) -> None:
    # 3 steps an epoch, 2 epochs; each step 2 micro-batches of 32 on each of the 2 ranks (DDP's no_sync on
    # the first), evaluated at the end of each epoch.
    assert uninterrupted["world_size"] == 2 and uninterrupted["kfac_enabled"]
    assert uninterrupted["steps"] == 6 and uninterrupted["samples"] == 6 * 2 * 32 * 2
    assert uninterrupted["status"] in ("success", "target_not_reached")
    assert [e[0] for e in uninterrupted["evals"]] == [3, 6]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run that rank 0's SIGTERM (in its 4th forward: step 2 of 3 in epoch 1) preempted."""
    cwd = tmp_path_factory.mktemp("preempted")
    done = run("train", *RUN, "+model.at=4", *_ranks(2), cwd=cwd, timeout=180)
    assert done.returncode == 75, done.stderr[-3000:]
    assert summary(cwd / "run")["steps"] == 2
    assert json.loads((cwd / "run" / WORLD_FILE).read_text())["global_batch"] == 128
    return cwd


def _copy(preempted: Path, tmp_path: Path) -> Path:
    cwd = tmp_path / "job"
    shutil.copytree(preempted, cwd)
    return cwd


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_run_resumed_on_another_world_size_is_the_uninterrupted_run(
    preempted: Path, uninterrupted: dict[str, Any], tmp_path: Path, ranks: int
) -> None:
    cwd = _copy(preempted, tmp_path)
    launch = _ranks(ranks) if ranks > 1 else []
    done = run("train", *RUN, "+model.at=4", *launch, cwd=cwd, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # No global batch stated: the start line says the batch is the 2-rank start's, not the one-rank 64.
    assert (
        "global batch 128 (recipe: 64), learning rate unchanged | resumed at step 2" in done.stdout
    )
    assert f"{128 // (32 * ranks)} accumulation steps keep its global batch" in done.stdout
    got = _outcome(cwd)
    assert summary(cwd / "run")["world_size"] == ranks
    for key in ("status", "steps", "samples", "evals", "epochs"):
        assert got[key] == uninterrupted[key], key
    assert got["steps"] == 6 and got["samples"] == 6 * 128
    # The same examples, as often: the interrupted epoch continued at the example where it stopped.
    assert got["seen"] == uninterrupted["seen"] and sum(got["seen"].values()) == 6 * 128
    log = events(cwd / "run" / "mlperf.log")
    resume = [e for e in log if e["key"] == "kfac_bench_resume"]
    assert [e["value"] for e in resume] == [
        {
            "step": 2,
            "world_size": ranks,
            "platform": f"{ranks}xcpu",
            "gradient_accumulation_steps": 128 // (32 * ranks),
        }
    ]
    header = {e["key"]: e["value"] for e in log[: log.index(resume[0])]}
    assert header["global_batch_size"] == 128 and header["submission_platform"] == "2xcpu"
    if ranks == 1:
        passed, report = check(cwd / "run" / "mlperf.log")
        assert passed, report[-3000:]


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_before_any_rank_starts(
    preempted: Path, tmp_path: Path
) -> None:
    cwd = _copy(preempted, tmp_path)
    checkpoints = sorted(p.name for p in (cwd / "run" / CHECKPOINT_DIR).iterdir())
    done = run("train", *RUN, "+model.at=4", *_ranks(3), cwd=cwd, timeout=120)
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert "global batch 128" in line and "which 3 ranks cannot keep" in line
    assert "resume on 1, 2 or 4 ranks" in line
    assert "run dir" not in done.stdout  # no rank started
    assert sorted(p.name for p in (cwd / "run" / CHECKPOINT_DIR).iterdir()) == checkpoints
    assert summary(cwd / "run")["status"] == "preempted"
