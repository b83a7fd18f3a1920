"""A minimal stateful part for the checkpoint tests: what a run's model, optimizer or preconditioner is to
:class:`~kfac_bench.checkpoint.manager.CheckpointManager` (``state_dict`` / ``load_state_dict``)."""

from __future__ import annotations

from typing import Any


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]
