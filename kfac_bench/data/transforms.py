"""Per-benchmark image preprocessing, as in the papers' reference code (kfac-pytorch examples).

Every pipeline ends in a float32 ``(3, H, W)`` tensor normalised per channel with the constants
below; the synthetic datasets produce tensors of the same shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision import transforms as T

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "cifar10_transform",
    "imagenet_transform",
]

# The reference CIFAR script's constants. The std is the widely copied (0.2023, 0.1994, 0.2010),
# not the per-pixel std of the training set (~0.247, 0.243, 0.262); kept so runs match the paper's
# preprocessing.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Transform = Callable[..., torch.Tensor]


def cifar10_transform(train: bool, augment: bool = True) -> Transform:
    """Transform for one CIFAR-10 image given as a uint8 ``(3, 32, 32)`` tensor.

    Train with ``augment``: RandomCrop(32, padding=4, zero fill) + RandomHorizontalFlip, then
    normalisation. Otherwise normalisation only.

    Returns:
        A callable mapping uint8 ``(3, 32, 32)`` to float32 ``(3, 32, 32)``.
    """
    steps: list[torch.nn.Module] = []
    if train and augment:
        steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    steps += [T.ConvertImageDtype(torch.float32), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    return T.Compose(steps)


def imagenet_transform(
    train: bool, augment: bool = True, image_size: int = 224, resize_size: int | None = None
) -> Transform:
    """Transform for one ImageNet image given as a PIL RGB image of any size.

    Train with ``augment``: RandomResizedCrop(image_size) + RandomHorizontalFlip. Otherwise
    (validation, or training without augmentation): Resize(resize_size) of the shorter side +
    CenterCrop(image_size). Both end with ToTensor and normalisation.

    Args:
        train: training split.
        augment: random augmentation on the training split.
        image_size: side of the square output (224 in the papers; smoke runs use e.g. 64).
        resize_size: shorter side before the centre crop; default keeps the papers' 256/224 ratio
            (256 for 224, 73 for 64).

    Returns:
        A callable mapping a PIL image to float32 ``(3, image_size, image_size)``.
    """
    if resize_size is None:
        resize_size = round(image_size * 256 / 224)
    steps: list[torch.nn.Module | Callable] = []
    if train and augment:
        steps += [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps += [T.Resize(resize_size), T.CenterCrop(image_size)]
    steps += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return T.Compose(steps)
