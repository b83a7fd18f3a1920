"""A model builder that injects one fault mid-run: a rank that dies (torchrun restarts from a checkpoint), a
preemption signal sent to the process itself, or a side channel's store that breaks."""

from __future__ import annotations

import builtins
import errno
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from kfac_bench.models.small_cnn import SmallCNN
from kfac_bench.train.warmup import warming_up


def break_store(store: Path, code: int) -> None:
    """From now on this process cannot write under ``store`` (a tracker's store): opening a file there for
    writing fails with ``OSError(code)``, as on a full (ENOSPC) or read-only (EROFS) filesystem; reading and
    every other path are untouched."""
    real_open = builtins.open
    root = str(Path(store).resolve())

    def failing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        writing = any(c in mode for c in "wax+")
        if writing and isinstance(file, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(file))
            if path == root or path.startswith(root + os.sep):
                raise OSError(code, os.strerror(code), path)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = failing_open  # io.open: what pathlib's writes call


class FaultOnce(SmallCNN):
    """SmallCNN that, at its ``at``-th training forward on rank ``rank``, does ``action`` once per marker:
    ``exit`` (``os._exit(1)``), ``kill`` (SIGKILL to itself), a signal name (``USR1``, ``USR2``, ``TERM``)
    sent to itself, as a cluster would send it, after which it trains on; ``hold``: wait (at most
    :data:`HOLD_S` s) until the process has received a preemption signal from outside, so that the signal
    finds the run mid-training however fast it trains; ``store-ENOSPC`` / ``store-EROFS``
    (:func:`break_store` of ``store``), optionally followed by a signal (``store-EROFS+TERM``); or
    ``kill_in_save``: SIGKILL to itself in the first checkpoint save after that forward (while the other
    ranks save too)."""

    def __init__(
        self, marker: str, at: int, action: str, rank: int = 0, store: str = "", **kwargs: int
    ) -> None:
        super().__init__(**kwargs)
        self.marker, self.at, self.action, self.rank = Path(marker), at, action, rank
        self.store = store
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if warming_up():  # the untimed warm-up step is not a step of the run
            return super().forward(x)
        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.calls += 1
            if self.calls == self.at and not self.marker.exists() and self.action != "kill_in_save":
                self.marker.write_text(self.action)
                action = self.action
                if action.startswith("store-"):
                    broken, _, action = action.partition("+")
                    break_store(Path(self.store), getattr(errno, broken.removeprefix("store-")))
                if action == "exit":
                    os._exit(1)
                if action == "hold":
                    _hold_until_signalled()
                    return super().forward(x)
                if action:
                    sig = signal.SIGKILL if action == "kill" else getattr(signal, f"SIG{action}")
                    os.kill(os.getpid(), sig)
        return super().forward(x)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        due = self.action == "kill_in_save" and self.calls >= self.at
        if due and int(os.environ.get("RANK", "0")) == self.rank and not self.marker.exists():
            self.marker.write_text(self.action)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)


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
    store: str = "",
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
        store,
        channels=channels,
        hidden=hidden,
        num_classes=num_classes,
        image_size=image_size,
    )
