"""The sinks write what existing tools read: TensorBoard event files, JSON lines (MLPerf's log:
tests/metrics/test_mlperf.py)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kfac_bench.metrics.sinks import JsonlSink, TensorBoardSink, read_jsonl
from kfac_bench.metrics.timekeeping import TargetTracker
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg


def test_tensorboard_scalars_of_a_run_read_back(tmp_path: Path) -> None:
    assert train(tiny_cfg("train.tensorboard=true", "train.log_every_steps=2"), tmp_path) == 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/top1"} <= tags
    assert {
        "kfac/factor_s_per_step",
        "kfac/decomposition_s_per_step",
        "kfac/precondition_s_per_step",
    } <= tags
    assert [e.step for e in acc.Scalars("eval/top1")] == [6, 12]
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12]


def test_jsonl_appends_and_tensorboard_sink(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "e.jsonl")
    sink.write({"step": 1})
    sink.write({"step": 2})
    assert [r["step"] for r in read_jsonl(tmp_path / "e.jsonl")] == [1, 2]
    tb = TensorBoardSink(tmp_path / "tb")
    tb.scalars({"a": 1.0}, 3)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Scalars("a")[0].value == 1.0


def test_target_tracker_needs_every_target_and_respects_direction() -> None:
    t = TargetTracker({"bbox": 0.377, "segm": 0.342}, primary="bbox")
    assert not t.update({"metrics": {"bbox": 0.4, "segm": 0.3}, "step": 1})
    assert t.update({"metrics": {"bbox": 0.38, "segm": 0.35}, "step": 2}) and t.reached["step"] == 2
    assert not t.update({"metrics": {"bbox": 0.5, "segm": 0.5}, "step": 3})  # only the first time
    assert t.best == 0.5 and t.reached["step"] == 2
    low = TargetTracker({"loss": 1.0}, primary="loss", higher_is_better=False)
    assert not low.update({"metrics": {"loss": 1.5}}) and low.update({"metrics": {"loss": 0.9}})
    assert not TargetTracker({}, primary="top1").update({"metrics": {"top1": 1.0}})
