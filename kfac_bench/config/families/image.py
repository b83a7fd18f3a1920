"""Schemas and smoke-data builders of the image benchmarks (issue 5): ``model=cifar_resnet`` /
``resnet``, ``dataset=cifar10`` / ``cifar10_tiny`` / ``imagenet`` / ``imagenet_tiny``.

Each dataclass is ``_target_`` plus the builder's keyword arguments, so a misspelt key fails when the config
is composed. The dataset builders take ``train: bool``; the harness calls them once per split. The recipes
``recipes/resnet32_cifar10*.yaml`` and ``recipes/resnet50_imagenet*.yaml`` select them.

The ``*_tiny`` builders write a tiny set in the real on-disk format (pickled CIFAR batches; a class-folder
tree of JPEG files) to ``root`` on first use and then read it through the same reader as the full data, so
the smoke recipes exercise the real loading path without any download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCHEMAS", "build_tiny_cifar10", "build_tiny_imagenet"]


def build_tiny_cifar10(
    root: str, train: bool = True, n_train: int = 200, n_test: int = 50, seed: int = 0
) -> Any:
    """One split of a tiny CIFAR-10 in the python-pickle release format (smoke runs).

    Writes ``<root>/cifar-10-batches-py/`` (:func:`kfac_bench.data.fixtures.write_tiny_cifar10`) unless
    it already holds ``batches.meta``, then reads the split with :func:`kfac_bench.data.cifar.build_cifar10`
    (augmentation on the train split). Items: float32 ``(3, 32, 32)``, label in ``[0, 10)``.
    """
    # Imported here: this module is read whenever any config composes (also for `kfac-bench --help`).
    from kfac_bench.data.cifar import CIFAR10_DIRNAME, META_FILE, build_cifar10
    from kfac_bench.data.fixtures import write_tiny_cifar10

    if not (Path(root) / CIFAR10_DIRNAME / META_FILE).is_file():
        write_tiny_cifar10(root, n_train=n_train, n_test=n_test, seed=seed)
    return build_cifar10(root, train=train)


def build_tiny_imagenet(
    root: str,
    train: bool = True,
    classes: int = 4,
    per_class: int = 8,
    image_size: int = 64,
    seed: int = 0,
) -> Any:
    """One split of a tiny ImageNet-style tree of real JPEG files (smoke runs).

    Writes ``<root>/{train,val}/<wnid>/*.JPEG`` (:func:`kfac_bench.data.fixtures.write_tiny_imagenet`,
    ``classes`` folders) unless ``<root>/train`` exists, then reads the split with
    :func:`kfac_bench.data.imagenet.build_imagenet` at ``image_size`` (RandomResizedCrop + flip for
    train, Resize + CenterCrop for val). Items: float32 ``(3, image_size, image_size)``, label in
    ``[0, classes)``.
    """
    from kfac_bench.data.fixtures import write_tiny_imagenet
    from kfac_bench.data.imagenet import build_imagenet

    if not (Path(root) / "train").is_dir():
        write_tiny_imagenet(root, classes=classes, per_class=per_class, seed=seed)
    return build_imagenet(root, train=train, image_size=image_size, num_classes=classes)


@dataclass
class CifarResNetConfig:
    """:func:`kfac_bench.models.cifar_resnet.build_cifar_resnet`: depth ``6n + 2`` (20/32/44/56/110),
    option-A shortcuts."""

    _target_: str = "kfac_bench.models.cifar_resnet.build_cifar_resnet"
    depth: int = 32
    num_classes: int = 10


@dataclass
class TorchvisionResNetConfig:
    """:func:`kfac_bench.models.torchvision_models.build_torchvision_resnet`: untrained torchvision
    ``resnet18/34/50/101/152``."""

    _target_: str = "kfac_bench.models.torchvision_models.build_torchvision_resnet"
    arch: str = "resnet50"
    num_classes: int = 1000
    zero_init_residual: bool = False


@dataclass
class Cifar10Config:
    """:func:`kfac_bench.data.cifar.build_cifar10`: ``<root>/cifar-10-batches-py`` or, with
    ``synthetic``, random tensors of the same shapes (``synthetic_length`` samples, default the real
    split sizes)."""

    _target_: str = "kfac_bench.data.cifar.build_cifar10"
    root: str | None = "data/cifar10"
    augment: bool = True
    synthetic: bool = False
    synthetic_length: int | None = None
    seed: int = 0


@dataclass
class Cifar10TinyConfig:
    """:func:`build_tiny_cifar10`: a tiny pickled CIFAR-10 written to ``root`` on first use."""

    _target_: str = "kfac_bench.config.families.image.build_tiny_cifar10"
    root: str = "data/cifar10_tiny"
    n_train: int = 200
    n_test: int = 50
    seed: int = 0


@dataclass
class ImageNetConfig:
    """:func:`kfac_bench.data.imagenet.build_imagenet`: ``<root>/{train,val}/<wnid>/*.JPEG`` or, with
    ``synthetic``, random tensors of the same shapes. ``num_classes`` is checked against the class
    folders (the recipes tie ``model.num_classes`` to it)."""

    _target_: str = "kfac_bench.data.imagenet.build_imagenet"
    root: str | None = "data/imagenet"
    augment: bool = True
    synthetic: bool = False
    image_size: int = 224
    resize_size: int | None = None
    synthetic_length: int | None = None
    num_classes: int = 1000
    seed: int = 0


@dataclass
class ImageNetTinyConfig:
    """:func:`build_tiny_imagenet`: a tiny JPEG class-folder tree written to ``root`` on first use."""

    _target_: str = "kfac_bench.config.families.image.build_tiny_imagenet"
    root: str = "data/imagenet_tiny"
    classes: int = 4
    per_class: int = 8
    image_size: int = 64
    seed: int = 0


SCHEMAS: list[tuple[str, str, type]] = [
    ("model", "cifar_resnet", CifarResNetConfig),
    ("model", "resnet", TorchvisionResNetConfig),
    ("dataset", "cifar10", Cifar10Config),
    ("dataset", "cifar10_tiny", Cifar10TinyConfig),
    ("dataset", "imagenet", ImageNetConfig),
    ("dataset", "imagenet_tiny", ImageNetTinyConfig),
]
