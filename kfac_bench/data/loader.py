"""DataLoader construction for the image benchmarks, single-process or under torch.distributed.

One code path for both cases: training always draws its order from a ``DistributedSampler`` (with
one replica when torch.distributed is not initialised), so a 1-process run and a world-size-1
distributed run see the same order for the same seed, and K-FAC and SGD arms see the same order.

Note:
    The caller must call :func:`set_epoch` (or ``loader.sampler.set_epoch(epoch)``) at the start of
    every training epoch; otherwise every epoch repeats the first epoch's order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ShardSampler", "build_loader", "set_epoch"]


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` of ``n`` gets indices ``r, r + n, r + 2n, ...`` in order.

    Unlike ``DistributedSampler`` it never pads with repeated samples, so per-rank sums of correct
    predictions and counts, all-reduced, give the exact metric over the whole split.

    Note:
        Shards can differ by one sample, hence by one batch: reduce once after the loop, never
        per batch (a per-batch collective would hang on the rank with fewer batches).
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.length = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return max(0, math.ceil((self.length - self.rank) / self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """No-op (the order does not depend on the epoch); present so callers need no type check."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def build_loader(
    dataset: Dataset[Any],
    batch_size: int,
    train: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool | None = None,
    seed: int = 0,
) -> DataLoader[Any]:
    """Wrap ``dataset`` in a DataLoader for this process.

    Args:
        dataset: a map-style dataset with ``len``.
        batch_size: samples per batch **per process** (the paper's per-GPU batch).
        train: shuffle with a ``DistributedSampler`` (seeded by ``seed`` and the epoch), else
            iterate this rank's strided shard in order (:class:`ShardSampler`, no padding).
        num_workers: worker processes (0 loads in the calling process).
        pin_memory: page-locked batches (pass ``device.type == "cuda"``).
        drop_last: drop the last incomplete batch; default ``train`` (BatchNorm layers and K-FAC's
            factor statistics prefer full batches). Under torch.distributed the training sampler
            also drops the tail that does not divide evenly across ranks.
        seed: shuffling seed, identical on every rank; worker RNGs (augmentation) are seeded from
            ``seed`` and the rank. With ``num_workers=0`` augmentation draws from the global torch
            RNG instead (seed it with ``torch.manual_seed``).

    Returns:
        The DataLoader; its ``sampler`` has ``set_epoch``.

    Note:
        Call :func:`set_epoch` before each training epoch (see the module docstring).
    """
    world_size, rank = _world()
    drop = train if drop_last is None else drop_last
    sampler: Sampler[int]
    if train:
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop
        )
    else:
        sampler = ShardSampler(dataset, world_size, rank)  # type: ignore[arg-type]
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed * 1000 + rank),
    )


def set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Reseed the loader's shuffle for ``epoch`` (call at the start of every training epoch)."""
    set_fn = getattr(loader.sampler, "set_epoch", None)
    if set_fn is not None:
        set_fn(epoch)
