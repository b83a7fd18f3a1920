"""A model builder that kills one rank once, mid-run, to exercise torchrun restarts from a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kfac_bench.models.small_cnn import SmallCNN


class CrashOnce(SmallCNN):
    """SmallCNN whose ``crash_at``-th training forward on rank 1 exits the process (once per marker)."""

    def __init__(self, marker: str, crash_at: int, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.marker = Path(marker)
        self.crash_at = crash_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK") == "1":
            self.calls += 1
            if self.calls == self.crash_at and not self.marker.exists():
                self.marker.write_text("crashed")
                os._exit(1)
        return super().forward(x)


def build_crash_once(
    marker: str,
    crash_at: int,
    channels: int = 8,
    hidden: int = 32,
    num_classes: int = 10,
    image_size: int = 8,
) -> CrashOnce:
    return CrashOnce(
        marker,
        crash_at,
        channels=channels,
        hidden=hidden,
        num_classes=num_classes,
        image_size=image_size,
    )
