"""Data loading for the one training loop: what a dataset builder returns and how it becomes loaders.

Training data is sharded with :class:`ResumableSampler` (a ``DistributedSampler`` that reshuffles every epoch
and can start mid-epoch, so a resumed run sees exactly the batches an uninterrupted run would). Evaluation
data is sharded without padding, so every example is counted exactly once across ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from kfac_bench.errors import UserError

__all__ = [
    "DataSplits",
    "ResumableSampler",
    "ShardSampler",
    "as_splits",
    "build",
    "build_loaders",
    "build_splits",
]


@dataclass
class DataSplits:
    """What every dataset builder (``dataset._target_``) returns.

    Attributes:
        train: map-style training dataset.
        val: map-style evaluation dataset.
        collate_fn: batch collation for both loaders, or None for PyTorch's default.
    """

    train: Dataset[Any]
    val: Dataset[Any]
    collate_fn: Callable[[list[Any]], Any] | None = None


def as_splits(built: Any) -> DataSplits:
    """Accept a :class:`DataSplits`, any object with ``train``/``val`` attributes, or a
    (train, val[, collate]) tuple, so dataset builders need not import the harness."""
    if isinstance(built, DataSplits):
        return built
    if hasattr(built, "train") and hasattr(built, "val"):
        return DataSplits(built.train, built.val, getattr(built, "collate_fn", None))
    if isinstance(built, tuple) and len(built) in (2, 3):
        return DataSplits(*built)
    raise TypeError(f"a dataset builder returned {type(built).__name__}; expected DataSplits")


def build_splits(dataset_cfg: Any) -> DataSplits:
    """Instantiate a ``dataset`` config. Its builder either returns both splits (see :func:`as_splits`) or
    takes ``train: bool`` and returns one split; it is then called twice (train=True, then False)."""
    from hydra.utils import get_method

    builder = get_method(dataset_cfg._target_)
    if "train" in inspect.signature(builder).parameters:
        train = build(dataset_cfg, train=True)
        val = build(dataset_cfg, train=False)
        return DataSplits(train, val, getattr(train, "collate_fn", None))
    return as_splits(build(dataset_cfg))


def build(cfg: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (containers as plain Python), re-raising a builder's
    :class:`~kfac_bench.errors.UserError` as itself so the CLI reports it in one line."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(cfg, _convert_="all", **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, UserError):
            raise exc.__cause__ from None
        raise


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can start at a given batch.

    ``set_epoch(epoch, skip=k)`` reshuffles with ``seed + epoch`` (the same order on every restart) and
    drops the first ``k`` indices of this rank's shard: those are the examples a preempted run already used.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world, ...`` in order: every example on exactly one rank, no padding."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, length, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_loaders(
    splits: DataSplits,
    batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    eval_batch_size: int | None = None,
) -> tuple[DataLoader[Any], DataLoader[Any], ResumableSampler]:
    """Training and evaluation loaders for this rank.

    Returns:
        (train loader, eval loader, the train sampler, whose ``set_epoch`` the loop calls every epoch).
        The train loader drops the last incomplete batch so every optimizer step sees the same batch size.
    """
    sampler = ResumableSampler(splits.train, world_size, rank, seed)
    generator = torch.Generator().manual_seed(seed)
    common: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "collate_fn": splits.collate_fn,
        "persistent_workers": num_workers > 0,
    }
    train = DataLoader(
        splits.train,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **common,
    )
    val_sampler = ShardSampler(len(splits.val), world_size, rank)  # type: ignore[arg-type]
    val = DataLoader(
        splits.val, batch_size=eval_batch_size or batch_size, sampler=val_sampler, **common
    )
    return train, val, sampler
