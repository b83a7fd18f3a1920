"""The checkpoint manager saves and restores a run's stateful parts as a set, atomically, and every random
generator with them."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kfac_bench.checkpoint.manager import CheckpointManager, RNGState, Stateful, save_atomic
from kfac_bench.errors import ConfigError
from kfac_bench.metrics.timekeeping import StageTotals, TargetTracker
from kfac_bench.train.state import TrainState

from .stateful import Counter


class Unpicklable:
    def __reduce__(self) -> tuple:
        raise RuntimeError("disk full")


class FakePreconditioner:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def stage_times(self) -> dict[str, float]:
        return {"factor": self.seconds}


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    save_atomic({"step": 1}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        save_atomic({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_parts_are_saved_and_restored_as_a_set(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = TrainState(epoch=2, step=17, micro_in_epoch=5, samples=544)
    tracker = TargetTracker({"top1": 0.9}, "top1")
    tracker.update({"metrics": {"top1": 0.95}, "step": 17})
    parts: dict[str, Stateful | None] = {
        "model": model,
        "optimizer": optimizer,
        "scaler": None,
        "train_state": state,
        "tracker": tracker,
        "counter": Counter(3),
    }
    manager = CheckpointManager(tmp_path, parts)
    assert set(manager.parts) == {"model", "optimizer", "train_state", "tracker", "counter"}
    assert not manager.load()  # nothing saved yet
    manager.save(step=17)
    saved = manager.read()
    assert saved is not None and saved["step"] == 17 and "scaler" not in saved
    assert torch.equal(saved["model"]["weight"], model.weight.detach())

    fresh_model = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    fresh_state, fresh_tracker, counter = (
        TrainState(),
        TargetTracker({"top1": 0.9}, "top1"),
        Counter(),
    )
    restored = CheckpointManager(
        tmp_path,
        {
            "model": fresh_model,
            "optimizer": fresh_optimizer,
            "train_state": fresh_state,
            "tracker": fresh_tracker,
            "counter": counter,
        },
    )
    assert restored.load()
    assert torch.equal(fresh_model.weight, model.weight) and counter.value == 3
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(fresh_optimizer.state[fresh_model.weight]["momentum_buffer"], momentum)
    assert (fresh_state.epoch, fresh_state.step, fresh_state.micro_in_epoch) == (2, 17, 5)
    assert fresh_state.samples == 544 and fresh_tracker.reached is not None


def test_a_part_the_checkpoint_lacks_is_a_one_line_config_error(tmp_path: Path) -> None:
    CheckpointManager(tmp_path, {"counter": Counter(1)}).save(step=1)
    with pytest.raises(ConfigError, match="holds no precond state"):
        CheckpointManager(tmp_path, {"counter": Counter(), "precond": Counter()}).load()


def test_train_state_from_another_world_size_continues_at_the_same_example() -> None:
    run = {"batch_size": 8, "global_batch": 64, "reference_world_size": 2}
    saved = TrainState(epoch=3, step=40, micro_in_epoch=6, world_size=2, **run).state_dict()
    assert saved["sample_in_epoch"] == 6 * 8 * 2
    same, fewer, more = (TrainState(world_size=n, **run) for n in (2, 1, 4))
    for state in (same, fewer, more):
        state.load_state_dict(saved)
        assert state.sample_in_epoch == 96 and (state.epoch, state.step) == (3, 40)
    assert (same.micro_in_epoch, fewer.micro_in_epoch, more.micro_in_epoch) == (6, 12, 3)
    with pytest.raises(ConfigError, match="not a whole number of micro-batches"):
        TrainState(world_size=8, **run).load_state_dict(saved)
    with pytest.raises(ConfigError, match="global batch 64 as started on 2"):
        TrainState(
            world_size=2, batch_size=8, global_batch=32, reference_world_size=1
        ).load_state_dict(saved)
    legacy = {k: v for k, v in saved.items() if k not in run and k != "sample_in_epoch"}
    with pytest.raises(ConfigError, match="resume on 2 ranks"):
        TrainState(world_size=4, **run).load_state_dict(legacy)


def test_clocks_and_stage_times_accumulate_over_restarts() -> None:
    first = TrainState()
    first.train_clock.offset = 5.0
    first.throughput.add(0.5, 32)
    stages = StageTotals(FakePreconditioner(seconds=2.0))
    state, saved_stages = first.state_dict(), stages.state_dict()
    second, resumed = TrainState(), StageTotals(FakePreconditioner(seconds=1.0))
    second.load_state_dict(state)
    resumed.load_state_dict(saved_stages)
    assert second.train_clock.elapsed == 5.0 and second.throughput.samples == 32
    assert resumed.totals() == {"factor": 3.0}  # 2 s before the restart, 1 s after
    assert StageTotals(None).totals() == {}


def test_rng_state_round_trip() -> None:
    rng = RNGState()
    saved = rng.state_dict()
    first = (random.random(), np.random.rand(), torch.rand(3))
    rng.load_state_dict(saved)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


def test_rng_state_from_another_world_size_takes_rank_0s() -> None:
    here = RNGState.local()
    torch.manual_seed(123)
    rank0 = RNGState.local()
    torch.manual_seed(456)
    RNGState(rank=1, world_size=4).load_state_dict({"ranks": [rank0, here]})
    assert torch.equal(torch.get_rng_state(), rank0["torch"])
