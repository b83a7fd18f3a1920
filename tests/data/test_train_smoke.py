"""One-epoch CPU training through the real readers and loader: the fixtures are learnable."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kfac_bench.data.cifar import build_tiny_cifar10
from kfac_bench.data.imagenet import build_tiny_imagenet, write_tiny_imagenet
from kfac_bench.data.loader import build_loaders
from kfac_bench.models.cifar_resnet import build_cifar_resnet
from kfac_bench.models.torchvision_models import build_torchvision_resnet


def train_one_epoch(
    model: nn.Module, loader: torch.utils.data.DataLoader, lr: float
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader.sampler.set_epoch(0)  # type: ignore[attr-defined]
    model.train()
    losses = []
    for images, labels in loader:
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def accuracy(model: nn.Module, train: Iterable, test: Iterable) -> float:
    # After a dozen steps BatchNorm's running averages (momentum 0.1) still remember the random
    # init; re-estimate them over the training data first, as "precise BN" does.
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average
    with torch.no_grad():
        for images, _ in train:
            model(images)
        model.eval()
        hits = [(model(x).argmax(1) == y).float() for x, y in test]
    return torch.cat(hits).mean().item()


def test_cifar_resnet20_learns_the_tiny_cifar10_in_one_epoch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = build_tiny_cifar10(str(tmp_path), n_train=200, n_test=100, seed=0)
    train, test, _ = build_loaders(data, batch_size=20, world_size=1, rank=0, seed=0)
    model = build_cifar_resnet(20)
    losses = train_one_epoch(model, train, lr=0.02)
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0]
    assert accuracy(model, train, test) >= 0.35  # chance is 0.10


def test_torchvision_resnet18_learns_the_tiny_imagenet_in_one_epoch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    write_tiny_imagenet(tmp_path, classes=4, per_class=24, size=40, val_per_class=8)
    data = build_tiny_imagenet(str(tmp_path), classes=4, image_size=32)
    train, val, _ = build_loaders(
        data, batch_size=8, world_size=1, rank=0, seed=0, eval_batch_size=32
    )
    model = build_torchvision_resnet("resnet18", num_classes=len(data.train.classes))  # type: ignore[attr-defined]
    losses = train_one_epoch(model, train, lr=0.01)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert accuracy(model, train, val) >= 0.5  # chance is 0.25
