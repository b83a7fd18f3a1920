"""Made-up images: random datasets of a benchmark's real shapes, and learnable class-colour pixels.

:class:`SyntheticImages` is for throughput runs without data on disk: a sample has exactly what the real
pipeline returns after preprocessing, a float32 ``(C, H, W)`` tensor (standard-normal values, i.e. already
"normalised") and an int label in ``[0, num_classes)``. Everything is a deterministic function of ``seed``, so
two runs (or two ranks) see the same data for the same indices.

:func:`class_colour_images` gives the pixels of the tiny real-format sets that tests and smoke recipes write
(:func:`kfac_bench.data.cifar.write_tiny_cifar10`, :func:`kfac_bench.data.imagenet.write_tiny_imagenet`):
each class has its own colour under pixel noise, which random crops and flips preserve, so a few epochs of a
small network get well above chance.
"""

from __future__ import annotations

import colorsys

import numpy as np
import torch
from torch.utils.data import Dataset

from kfac_bench.errors import ConfigError

__all__ = ["SyntheticImages", "build_synthetic_images", "class_colour", "class_colour_images"]


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """``length`` samples ``(image, label)``; ``image`` float32 of ``shape``, ``label`` an int.

    Labels are drawn independently for every index. Images come from a pool of ``pool_size`` random
    tensors (sample ``i`` uses pool entry ``i % pool_size``): generating a fresh 3x224x224 tensor
    per sample would cost more CPU time than a fast GPU spends on it, and the content does not
    matter for throughput. The data is not learnable; it measures speed, not accuracy.

    Args:
        length: number of samples (e.g. 50,000 for CIFAR-10 train, 1,281,167 for ImageNet train).
        shape: ``(C, H, W)`` of one image.
        num_classes: labels are uniform in ``[0, num_classes)``.
        seed: seed of the generator for images and labels.
        pool_size: distinct images held in memory (at most ``length``).
    """

    def __init__(
        self,
        length: int,
        shape: tuple[int, ...],
        num_classes: int,
        seed: int = 0,
        pool_size: int = 64,
    ) -> None:
        if length < 1 or num_classes < 1 or pool_size < 1:
            raise ConfigError(
                f"synthetic dataset needs length, num_classes and pool_size >= 1 "
                f"(got {length}, {num_classes}, {pool_size})"
            )
        gen = torch.Generator().manual_seed(seed)
        self.length = length
        self.shape = tuple(shape)
        self.num_classes = num_classes
        self.targets = torch.randint(num_classes, (length,), generator=gen)
        self.images = torch.randn((min(pool_size, length), *self.shape), generator=gen)
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        index %= self.length
        # A copy, so a consumer that edits a sample in place cannot change the pool.
        return self.images[index % len(self.images)].clone(), int(self.targets[index])


def build_synthetic_images(
    length: int,
    image_size: int | tuple[int, int],
    num_classes: int,
    channels: int = 3,
    seed: int = 0,
    pool_size: int = 64,
) -> SyntheticImages:
    """A :class:`SyntheticImages` of square or ``(H, W)`` images."""
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    return SyntheticImages(length, (channels, h, w), num_classes, seed=seed, pool_size=pool_size)


def class_colour(label: int, num_classes: int) -> np.ndarray:
    """RGB colour (float ``(3,)`` in [0, 255]) of ``label``: evenly spaced hues, saturated."""
    r, g, b = colorsys.hsv_to_rgb(label / num_classes, 0.85, 0.9)
    return np.array([r, g, b]) * 255.0


def class_colour_images(
    labels: np.ndarray, num_classes: int, h: int, w: int, rng: np.random.Generator
) -> np.ndarray:
    """uint8 ``(n, h, w, 3)``: image ``i`` is the colour of ``labels[i]`` plus N(0, 40^2) noise per pixel."""
    base = np.stack([class_colour(int(c), num_classes) for c in labels])[:, None, None, :]
    noisy = base + rng.normal(0.0, 40.0, size=(len(labels), h, w, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)
