"""Samplers and loaders: how a :class:`~kfac_bench.data.base.DataSplits` becomes this rank's batches.

Training data is sharded with :class:`ResumableSampler` (a ``DistributedSampler`` that reshuffles every epoch
and can start mid-epoch, so a resumed run sees exactly the batches an uninterrupted run would); one code path
serves one process and many, so a single-process run and a world-size-1 distributed run see the same order,
and the K-FAC and first-order arms see the same order for the same seed. Evaluation data is sharded without
padding (:class:`ShardSampler`), so every example is counted exactly once across ranks.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from kfac_bench.data.base import DataSplits

__all__ = [
    "ResumableSampler",
    "ShardSampler",
    "build_loaders",
    "ignore_stop_signals",
    "shutdown_workers",
]

#: Signals that stop a run cleanly in its main process (:mod:`kfac_bench.launcher.signals`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of every loader: a loader worker ignores the stop signals.

    ``timeout``, Ctrl-C, torchrun and many schedulers signal the whole process group, workers included.
    The main process stops after its step and checkpoints; a worker that died of the signal first would
    end the run with "DataLoader worker ... killed by signal" instead. Workers still end when the loader
    shuts them down, or by themselves when the main process is gone (PyTorch's watchdog).
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def shutdown_workers(*loaders: Any) -> None:
    """End the persistent workers of ``loaders`` now, as a loader does when it is garbage-collected.

    Call it when a run ends, however it ends: after an exception (e.g. a worker's one-line
    :class:`~kfac_bench.data.images.ImageReadError`), the traceback keeps the loaders alive until the
    interpreter exits, where ``multiprocessing`` would SIGTERM the workers (which ignore it, see
    :func:`ignore_stop_signals`) and then wait for them forever.
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # DataLoader's persistent-workers iterator
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
            loader._iterator = None


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` (shuffled, padded to equal shards) whose epoch can start at a given example
    of the epoch's global order, on any number of ranks.

    An epoch's *global order* is the permutation of ``seed + epoch`` (the same on every restart), padded by
    wrapping around as ``DistributedSampler`` pads; rank ``r`` of ``n`` takes positions ``r, r + n, ...``
    of it, so a micro-batch of ``b`` examples on every rank consumes the next ``b * n`` positions, and a run
    that has done ``k`` micro-batches per rank has consumed exactly the first ``k * b * n``.
    ``set_epoch(epoch, start=p)`` drops the first ``p`` positions: a resumed run, on the same number of ranks
    or another, continues at the example where the preempted one stopped (no example repeated or skipped).

    Note:
        Call ``set_epoch`` before every training epoch; otherwise every epoch repeats the first one's order.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = 0

    def cover(self, positions: int) -> None:
        """Make the global order at least ``positions`` long (an epoch planned on another number of ranks,
        whose padding reaches further than this number's); a multiple of the number of ranks."""
        if positions > self.total_size:
            self.total_size = math.ceil(positions / self.num_replicas) * self.num_replicas
            self.num_samples = self.total_size // self.num_replicas

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for ``epoch`` and begin at position ``start`` of its global order (the examples, over
        all ranks, that the run consumed in this epoch before it was stopped)."""
        super().set_epoch(epoch)
        if not 0 <= start <= self.total_size:
            raise ValueError(f"start {start} is not in [0, {self.total_size}]")
        self.start = start

    def global_order(self) -> list[int]:
        """This epoch's global order: dataset indices, padded by wrapping to ``total_size``."""
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        indices: list[int] = torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        if len(indices) < self.total_size:
            indices = (indices * math.ceil(self.total_size / len(indices)))[: self.total_size]
        return indices

    def __iter__(self) -> Iterator[int]:
        return iter(
            self.global_order()[self.start + self.rank : self.total_size : self.num_replicas]
        )

    def __len__(self) -> int:
        return max(0, math.ceil((self.total_size - self.start - self.rank) / self.num_replicas))


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` of ``n`` gets indices ``r, r + n, r + 2n, ...`` in order.

    Unlike ``DistributedSampler`` it never pads with repeated examples, so per-rank sums of correct
    predictions and counts, all-reduced, give the exact metric over the whole split.

    Note:
        Shards can differ by one example, hence by one batch: reduce once after the loop, never per batch
        (a per-batch collective would hang on the rank with fewer batches).
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
    """Training and evaluation loaders for rank ``rank`` of ``world_size``.

    Args:
        splits: what the dataset builder returned.
        batch_size: examples per micro-batch **per process** (the paper's per-GPU batch).
        world_size / rank: this process's place in the job (1 / 0 without torch.distributed).
        seed: shuffling seed, identical on every rank.
        num_workers: loader worker processes (0 loads in the calling process).
        pin_memory: page-locked batches (pass ``device.type == "cuda"``).
        eval_batch_size: evaluation batch size; default ``batch_size``.

    Returns:
        (train loader, eval loader, the train sampler, whose ``set_epoch`` the loop calls every epoch).
        The train loader drops the last incomplete batch, so every optimizer step sees the same batch size
        (BatchNorm layers and K-FAC's factor statistics prefer full batches).
    """
    sampler = ResumableSampler(splits.train, world_size, rank, seed)
    generator = torch.Generator().manual_seed(seed)
    common: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "collate_fn": splits.collate_fn,
        "persistent_workers": num_workers > 0,
        "worker_init_fn": ignore_stop_signals if num_workers > 0 else None,
    }
    train = DataLoader(
        splits.train,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **common,
    )
    val_sampler = ShardSampler(splits.val, world_size, rank)  # type: ignore[arg-type]
    val = DataLoader(
        splits.val, batch_size=eval_batch_size or batch_size, sampler=val_sampler, **common
    )
    return train, val, sampler
