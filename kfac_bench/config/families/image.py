"""Schemas of the image benchmarks' builders: ``model=cifar_resnet`` / ``resnet``, ``dataset=cifar10`` /
``cifar10_tiny`` / ``imagenet`` / ``imagenet_tiny``.

Each dataclass is ``_target_`` plus the builder's keyword arguments (same names and defaults; a test keeps
them in step), so a misspelt key fails when the config is composed. The recipes
``recipes/resnet32_cifar10*.yaml`` and ``recipes/resnet50_imagenet*.yaml`` select them. The ``*_tiny``
builders write a tiny set in the real on-disk format on first use and read it through the real reader.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEMAS"]


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
    """:func:`kfac_bench.data.cifar.build_tiny_cifar10`: a tiny pickled CIFAR-10 written to ``root`` on
    first use."""

    _target_: str = "kfac_bench.data.cifar.build_tiny_cifar10"
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
    """:func:`kfac_bench.data.imagenet.build_tiny_imagenet`: a tiny JPEG class-folder tree written to
    ``root`` on first use."""

    _target_: str = "kfac_bench.data.imagenet.build_tiny_imagenet"
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
