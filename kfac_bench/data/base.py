"""The data contract: what every dataset builder (a config's ``dataset._target_``) returns.

A builder reads one benchmark's real on-disk format (or writes a tiny set in that format first, for smoke
runs) and returns both splits at once as a :class:`DataSplits`; the training loop never asks a builder for
anything else. Sampling, sharding and batching are the loader's job (:mod:`kfac_bench.data.loader`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

__all__ = ["DataSplits"]


@dataclass(frozen=True)
class DataSplits:
    """The training and evaluation sets of a benchmark.

    Attributes:
        train: map-style training dataset (``len`` and integer indexing).
        val: map-style evaluation dataset; every example is evaluated exactly once per evaluation.
        collate_fn: batch collation for both loaders, or None for PyTorch's default (stacking).
    """

    train: Dataset[Any]
    val: Dataset[Any]
    collate_fn: Callable[[list[Any]], Any] | None = None
