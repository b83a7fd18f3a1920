"""Synthetic datasets: real shapes and label ranges, deterministic from the seed."""

from __future__ import annotations

import pytest
import torch

from kfac_bench.data.cifar import cifar10_split
from kfac_bench.data.imagenet import imagenet_split
from kfac_bench.data.synthetic import build_synthetic_images
from kfac_bench.errors import ConfigError


def test_cifar_synthetic_has_real_split_sizes_and_shapes() -> None:
    train = cifar10_split(None, synthetic=True, train=True)
    test = cifar10_split("/does/not/matter", synthetic=True, train=False)
    assert (len(train), len(test)) == (50_000, 10_000)
    image, label = train[49_999]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert isinstance(label, int) and 0 <= label < 10


def test_imagenet_synthetic_shape_length_and_classes() -> None:
    ds = imagenet_split(None, synthetic=True, train=True, image_size=64, synthetic_length=300)
    assert len(ds) == 300
    labels = torch.tensor([ds[i][1] for i in range(len(ds))])
    assert ds[0][0].shape == (3, 64, 64)
    assert labels.min() >= 0 and labels.max() < 1000
    assert len(imagenet_split(None, synthetic=True, train=False)) == 50_000


def test_same_seed_same_data_other_seed_other_data() -> None:
    a = build_synthetic_images(100, 8, 5, seed=1)
    b = build_synthetic_images(100, 8, 5, seed=1)
    c = build_synthetic_images(100, 8, 5, seed=2)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(100))
    assert not torch.equal(a[0][0], c[0][0])
    assert a.targets.tolist() != c.targets.tolist()


def test_labels_cover_the_range_and_look_standard_normal() -> None:
    ds = build_synthetic_images(2000, (16, 8), 10, seed=0, pool_size=50)
    assert ds[0][0].shape == (3, 16, 8)
    assert set(ds.targets.tolist()) == set(range(10))
    pool = torch.stack([ds[i][0] for i in range(50)])
    assert abs(pool.mean().item()) < 0.02 and abs(pool.std().item() - 1) < 0.02


def test_train_and_eval_splits_differ() -> None:
    train = cifar10_split(None, synthetic=True, train=True, synthetic_length=50)
    test = cifar10_split(None, synthetic=True, train=False, synthetic_length=50)
    assert not torch.equal(train[0][0], test[0][0])


def test_index_bounds_and_bad_arguments() -> None:
    ds = build_synthetic_images(3, 4, 2)
    assert torch.equal(ds[-1][0], ds[2][0])
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(ConfigError):
        build_synthetic_images(0, 4, 2)
