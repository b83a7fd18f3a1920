"""build_loaders: per-epoch shuffling, resuming mid-epoch, sharding without padding, disjoint ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from kfac_bench.data.base import DataSplits
from kfac_bench.data.loader import ShardSampler, build_loaders


def indices(loader: torch.utils.data.DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch[0]]


def splits(n_train: int, n_val: int) -> DataSplits:
    return DataSplits(TensorDataset(torch.arange(n_train)), TensorDataset(torch.arange(n_val)))


def test_train_loader_shuffles_per_epoch_and_drops_the_partial_batch() -> None:
    train, _, sampler = build_loaders(splits(23, 5), batch_size=5, world_size=1, rank=0, seed=7)
    sampler.set_epoch(0)
    epoch0 = indices(train)
    assert len(epoch0) == 20 and len(set(epoch0)) == 20  # 4 full batches, no repeats
    assert epoch0 != sorted(epoch0)
    assert indices(train) == epoch0  # same epoch, same order
    sampler.set_epoch(1)
    assert indices(train) != epoch0
    again, _, other = build_loaders(splits(23, 5), batch_size=5, world_size=1, rank=0, seed=7)
    other.set_epoch(1)
    assert indices(again) == indices(train)  # order is a function of (seed, epoch)


def test_resuming_mid_epoch_skips_exactly_the_consumed_examples() -> None:
    train, _, sampler = build_loaders(splits(40, 5), batch_size=4, world_size=1, rank=0, seed=1)
    sampler.set_epoch(3)
    whole = indices(train)
    sampler.set_epoch(3, start=3 * 4)  # three micro-batches were done before the preemption
    assert indices(train) == whole[12:]


def test_eval_loader_is_in_order_and_complete() -> None:
    _, val, _ = build_loaders(splits(8, 23), batch_size=5, world_size=1, rank=0, seed=0)
    assert indices(val) == list(range(23))
    _, val, _ = build_loaders(
        splits(8, 23), batch_size=5, world_size=1, rank=0, seed=0, eval_batch_size=23
    )
    assert len(list(val)) == 1


def test_shard_sampler_partitions_without_padding() -> None:
    shards = [list(ShardSampler(range(10), 3, r)) for r in range(3)]
    assert [len(ShardSampler(range(10), 3, r)) for r in range(3)] == [4, 3, 3]
    assert sorted(i for shard in shards for i in shard) == list(range(10))
    assert shards[1] == [1, 4, 7]
    with pytest.raises(ValueError):
        ShardSampler(range(10), 2, 2)


def test_ranks_get_disjoint_training_shards_and_partition_the_evaluation_set() -> None:
    data = splits(22, 11)
    per_rank = []
    for rank in range(2):
        train, val, sampler = build_loaders(data, batch_size=4, world_size=2, rank=rank, seed=3)
        sampler.set_epoch(2)
        per_rank.append((indices(train), indices(val)))
    train0, train1 = (t for t, _ in per_rank)
    # 22 examples over 2 ranks: 11 each, 2 full batches of 4 per rank; no index on both ranks.
    assert len(train0) == len(train1) == 8 and not set(train0) & set(train1)
    assert [v for _, v in per_rank] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]
