"""Checkpoints are replaced atomically and restore every random generator."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kfac_bench.train import checkpoint


class Unpicklable:
    def __reduce__(self) -> tuple:
        raise RuntimeError("disk full")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = checkpoint.checkpoint_path(tmp_path)
    checkpoint.save_atomic({"step": 1}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic({"step": 2, "bad": Unpicklable()}, path)
    saved = checkpoint.load(path)
    assert saved == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_load_without_checkpoint_is_none(tmp_path: Path) -> None:
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path)) is None


def test_rng_state_round_trip() -> None:
    state = checkpoint.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    checkpoint.set_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])
