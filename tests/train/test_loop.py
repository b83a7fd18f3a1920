"""The training loop in-process on tiny digits runs: records, accumulation, divergence, stop at target,
resume from a mid-epoch checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.metrics.sinks import read_jsonl
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg


def _saved(run_dir: Path) -> dict:
    saved = CheckpointManager(run_dir / CHECKPOINT_DIR, {}).read()
    assert saved is not None
    return saved


def _train(tmp: Path, *overrides: str) -> dict:
    assert train(tiny_cfg(*overrides), tmp) == 0
    return json.loads((tmp / "summary.json").read_text())


@pytest.mark.parametrize("kfac", ["none", "comm_opt"])
def test_run_records_time_to_accuracy(tmp_path: Path, kfac: str) -> None:
    s = _train(tmp_path, f"kfac={kfac}", "train.targets.top1=0.0", "train.mlperf_log=true")
    records = read_jsonl(tmp_path / "eval.jsonl")
    assert [r["step"] for r in records] == [6, 12] and [r["epoch"] for r in records] == [1.0, 2.0]
    for r in records:
        assert r["samples"] == r["step"] * 32 and 0 < r["train_time_s"] <= r["wall_time_s"]
        assert set(r["metrics"]) == {"loss", "top1", "top5"}
    assert s["status"] == "success" and s["kfac_enabled"] is (kfac != "none")
    assert s["epochs_to_target"] == 1.0 and s["time_to_target_s"] == records[0]["wall_time_s"]
    assert s["best_metric"] == max(r["metrics"]["top1"] for r in records)
    assert s["steps"] == 12 and s["samples_per_s"] > 0 and s["world_size"] == 1
    assert (
        s["config"]["kfac"]["enabled"] is (kfac != "none")
        and s["torch_version"] == torch.__version__
    )
    if kfac != "none":
        assert s["kfac_stage_times_s"]["factor"] > 0 and s["kfac_memory_bytes"]["total"] > 0
    mlperf = [
        json.loads(line.split(":::MLLOG ", 1)[1])
        for line in (tmp_path / "mlperf.log").read_text().splitlines()
    ]
    keys = [e["key"] for e in mlperf]
    assert keys[0] == "init_start" and "run_start" in keys and keys[-1] == "run_stop"
    # MLPerf's run stops at the first evaluation that meets the target; the second is in eval.jsonl only.
    assert keys.count("eval_accuracy") == 1 and mlperf[-1]["metadata"]["status"] == "success"
    assert _saved(tmp_path)["step"] == 12 and (tmp_path / "config.yaml").is_file()


def test_unreached_target_is_reported_as_such(tmp_path: Path) -> None:
    s = _train(tmp_path, "kfac=none", "train.targets.top1=1.01")
    assert s["status"] == "target_not_reached" and s["time_to_target_s"] is None
    assert s["epochs_to_target"] is None and s["best_metric"] is not None


def test_stop_at_target_stops_at_the_first_evaluation_that_meets_it(tmp_path: Path) -> None:
    s = _train(
        tmp_path,
        "kfac=none",
        "train.targets.top1=0.0",
        "train.stop_at_target=true",
        "train.epochs=5",
    )
    assert s["steps"] == 6 and len(read_jsonl(tmp_path / "eval.jsonl")) == 1


def test_accumulation_matches_the_large_batch(tmp_path: Path) -> None:
    big = _train(
        tmp_path / "big", "kfac=none", "train.batch_size=32", "train.limit_train_batches=6"
    )
    acc = _train(
        tmp_path / "acc",
        "kfac=none",
        "train.batch_size=16",
        "train.accumulation_steps=2",
        "train.limit_train_batches=12",
        "train.eval_batch_size=32",
    )
    assert acc["steps"] == big["steps"] == 12 and acc["samples"] == big["samples"]
    assert acc["final_metrics"]["loss"] == pytest.approx(big["final_metrics"]["loss"], rel=1e-4)


def test_nan_loss_stops_with_diverged_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    # The LR jumps by 1e20 after the first epoch: the second epoch's loss becomes non-finite.
    s = _train(
        tmp_path,
        "kfac=none",
        "lr_schedule.milestones=[1]",
        "lr_schedule.gamma=1e20",
        "train.mlperf_log=true",
    )
    assert s["status"] == "diverged"
    saved = _saved(tmp_path)
    assert saved["step"] == saved["train_state"]["step"] == 6
    assert all(torch.isfinite(v).all() for v in saved["model"].values())
    stop = (tmp_path / "mlperf.log").read_text().splitlines()[-1]
    assert '"aborted"' in stop and "diverged" in stop


def test_resume_mid_epoch_equals_uninterrupted(tmp_path: Path) -> None:
    common = ("kfac=comm_opt", "kfac.inv_update_steps=4", "train.checkpoint_every_epochs=0")
    whole = _train(tmp_path / "whole", *common)
    # Stop after 8 of 12 steps (mid-epoch), then resume the same run directory to the end.
    _train(tmp_path / "parts", *common, "train.max_steps=8")
    parts = _train(tmp_path / "parts", *common)
    assert parts["steps"] == whole["steps"] == 12
    assert [r["step"] for r in read_jsonl(tmp_path / "parts" / "eval.jsonl")] == [6, 8, 12]
    assert parts["final_metrics"] == whole["final_metrics"]
    a, b = _saved(tmp_path / "whole"), _saved(tmp_path / "parts")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert parts["train_time_s"] > 0 and not math.isnan(parts["wall_time_s"])
