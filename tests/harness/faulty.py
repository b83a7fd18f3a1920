"""A model builder that injects one fault mid-run: a rank that dies (torchrun restarts from a checkpoint), or
a preemption signal sent to the process itself."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from kfac_bench.models.small_cnn import SmallCNN


class FaultOnce(SmallCNN):
    """SmallCNN that, at its ``at``-th training forward on rank ``rank``, does ``action`` once per marker:
    ``exit`` (``os._exit(1)``), ``kill`` (SIGKILL to itself), a signal name (``USR1``, ``USR2``,
    ``TERM``) sent to itself, as a cluster would send it, after which it trains on, or ``hold``: wait (at
    most :data:`HOLD_S` s) until the process has received a preemption signal from outside, so that the
    signal finds the run mid-training however fast it trains."""

    def __init__(self, marker: str, at: int, action: str, rank: int = 0, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.marker, self.at, self.action, self.rank = Path(marker), at, action, rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.calls += 1
            if self.calls == self.at and not self.marker.exists():
                self.marker.write_text(self.action)
                if self.action == "exit":
                    os._exit(1)
                if self.action == "hold":
                    _hold_until_signalled()
                    return super().forward(x)
                sig = (
                    signal.SIGKILL
                    if self.action == "kill"
                    else getattr(signal, f"SIG{self.action}")
                )
                os.kill(os.getpid(), sig)
        return super().forward(x)


#: The longest a ``hold`` waits for its signal.
HOLD_S = 300.0


def _hold_until_signalled() -> None:
    """Until the run's preemption handler (:class:`kfac_bench.launcher.signals.PreemptionFlag`) has recorded
    a signal."""
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        flag = getattr(signal.getsignal(signal.SIGUSR1), "__self__", None)
        if getattr(flag, "signum", None) is not None:
            return
        time.sleep(0.05)


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
