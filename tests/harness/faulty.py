"""A model builder that injects one fault mid-run: a rank that dies (torchrun restarts from a checkpoint), or
a preemption signal sent to the process itself."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

from kfac_bench.models.small_cnn import SmallCNN


class FaultOnce(SmallCNN):
    """SmallCNN that, at its ``at``-th training forward on rank ``rank``, does ``action`` once per marker:
    ``exit`` (``os._exit(1)``), ``kill`` (SIGKILL to itself) or a signal name (``USR1``, ``USR2``,
    ``TERM``) sent to itself, as a cluster would send it, after which it trains on; ``kill_in_save``:
    SIGKILL to itself in the first checkpoint save after that forward (while the other ranks save too)."""

    def __init__(self, marker: str, at: int, action: str, rank: int = 0, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.marker, self.at, self.action, self.rank = Path(marker), at, action, rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.calls += 1
            if self.calls == self.at and not self.marker.exists() and self.action != "kill_in_save":
                self.marker.write_text(self.action)
                if self.action == "exit":
                    os._exit(1)
                sig = (
                    signal.SIGKILL
                    if self.action == "kill"
                    else getattr(signal, f"SIG{self.action}")
                )
                os.kill(os.getpid(), sig)
        return super().forward(x)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        due = self.action == "kill_in_save" and self.calls >= self.at
        if due and int(os.environ.get("RANK", "0")) == self.rank and not self.marker.exists():
            self.marker.write_text(self.action)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)


def build_fault_once(
    marker: str,
    at: int,
    action: str,
    rank: int = 0,
    channels: int = 8,
    hidden: int = 32,
    num_classes: int = 10,
    image_size: int = 8,
) -> FaultOnce:
    return FaultOnce(
        marker,
        at,
        action,
        rank,
        channels=channels,
        hidden=hidden,
        num_classes=num_classes,
        image_size=image_size,
    )
