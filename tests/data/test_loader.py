"""build_loader: per-epoch shuffling, sharding without padding, DistributedSampler under gloo."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from kfac_bench.data.loader import ShardSampler, build_loader, set_epoch


def indices(loader: torch.utils.data.DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch[0]]


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def test_train_loader_shuffles_per_epoch_and_drops_the_partial_batch() -> None:
    loader = build_loader(dataset(23), batch_size=5, train=True, seed=7)
    set_epoch(loader, 0)
    epoch0 = indices(loader)
    assert len(epoch0) == 20 and len(set(epoch0)) == 20  # 4 full batches, no repeats
    assert epoch0 != sorted(epoch0)
    assert indices(loader) == epoch0  # same epoch, same order
    set_epoch(loader, 1)
    assert indices(loader) != epoch0
    again = build_loader(dataset(23), batch_size=5, train=True, seed=7)
    set_epoch(again, 1)
    assert indices(again) == indices(loader)  # order is a function of (seed, epoch)


def test_eval_loader_is_in_order_and_complete() -> None:
    loader = build_loader(dataset(23), batch_size=5, train=False)
    assert indices(loader) == list(range(23))
    keep = build_loader(dataset(23), batch_size=5, train=True, drop_last=False)
    assert sorted(indices(keep)) == list(range(23))


def test_shard_sampler_partitions_without_padding() -> None:
    shards = [list(ShardSampler(range(10), 3, r)) for r in range(3)]
    assert [len(ShardSampler(range(10), 3, r)) for r in range(3)] == [4, 3, 3]
    assert sorted(i for shard in shards for i in shard) == list(range(10))
    assert shards[1] == [1, 4, 7]
    with pytest.raises(ValueError):
        ShardSampler(range(10), 2, 2)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        train = build_loader(dataset(22), batch_size=4, train=True, seed=3)
        set_epoch(train, 2)
        evaluation = build_loader(dataset(11), batch_size=4, train=False)
        torch.save(
            {"train": indices(train), "eval": indices(evaluation)},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc(file=sys.stderr)
        raise


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_distributed_ranks_get_disjoint_shards(tmp_path: Path) -> None:
    world_size = 2
    mp.start_processes(
        _worker,
        args=(world_size, str(tmp_path / "init"), str(tmp_path)),
        nprocs=world_size,
        start_method="spawn",
        join=True,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    train = [r["train"] for r in results]
    # 22 samples over 2 ranks: 11 each, 2 full batches of 4 per rank; no index on both ranks.
    assert [len(t) for t in train] == [8, 8]
    assert not set(train[0]) & set(train[1])
    evaluation = [r["eval"] for r in results]
    assert evaluation == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]
