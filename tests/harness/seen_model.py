"""A model builder for the elastic-resume tests: the fault model (tests/harness/faulty.py) that also writes
a digest of every training example it sees, so a test can compare the examples of an interrupted and
resumed run with an uninterrupted one's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from kfac_bench.train.warmup import warming_up
from tests.harness.faulty import FaultOnce


class SeenFaultOnce(FaultOnce):
    """:class:`FaultOnce` that appends one line per training example (a digest of its pixels) to
    ``<seen>/<pid>.txt``."""

    def __init__(self, seen: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.seen = Path(seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not warming_up():  # the warm-up step is undone: its batch is not seen
            self.seen.mkdir(parents=True, exist_ok=True)
            rows = x.detach().cpu().reshape(len(x), -1).numpy()
            lines = "".join(hashlib.sha1(r.tobytes()).hexdigest()[:16] + "\n" for r in rows)
            with (self.seen / f"{os.getpid()}.txt").open("a") as f:
                f.write(lines)
        return super().forward(x)


def build_seen_fault_once(
    seen: str,
    marker: str,
    at: int,
    action: str,
    rank: int = 0,
    channels: int = 8,
    hidden: int = 32,
    num_classes: int = 10,
    image_size: int = 8,
) -> SeenFaultOnce:
    return SeenFaultOnce(
        seen,
        marker=marker,
        at=at,
        action=action,
        rank=rank,
        channels=channels,
        hidden=hidden,
        num_classes=num_classes,
        image_size=image_size,
    )
