"""A minimal stateful part for the checkpoint tests: what a run's model, optimizer or preconditioner is to
:class:`~kfac_bench.checkpoint.manager.CheckpointManager` (``state_dict`` / ``load_state_dict``); and a
folder of checkpoints saved through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kfac_bench.checkpoint.manager import CheckpointManager


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]


def saved(folder: Path, steps: list[int], keep: int = 2) -> CheckpointManager:
    """A manager of ``folder`` that saved a checkpoint at each of ``steps`` (the counter at step x 10)."""
    counter = Counter()
    manager = CheckpointManager(folder, {"counter": counter}, keep=keep)
    for step in steps:
        counter.value = step * 10
        manager.save(step)
    return manager
