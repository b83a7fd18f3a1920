"""ImageNet-1k in the class-folder layout (``<root>/{train,val}/<wnid>/*.JPEG``), or synthetic; and a writer
of tiny trees of real JPEG files in the same layout for tests and smoke runs.

Reading is torchvision's ``ImageFolder``: class index = position of the folder name in the sorted
list of class folders. Because that index is computed per split, this module checks that ``train/``
and ``val/`` hold the same class folders (otherwise validation labels would silently shift), and
reports a missing or malformed tree (e.g. the flat validation release, 50,000 JPEGs directly in
``val/``) as a :class:`~kfac_bench.errors.DatasetError` naming the path and the expected layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from kfac_bench.data.base import DataSplits
from kfac_bench.data.images import load_rgb, write_jpeg
from kfac_bench.data.synthetic import SyntheticImages, class_colour_images
from kfac_bench.data.transforms import imagenet_transform
from kfac_bench.errors import DatasetError

__all__ = [
    "build_imagenet",
    "build_tiny_imagenet",
    "imagenet_classes",
    "imagenet_split",
    "write_tiny_imagenet",
]

EXPECTED_LAYOUT = (
    "<root>/train/<wnid>/*.JPEG and <root>/val/<wnid>/*.JPEG: one folder per class, "
    "the same class folders in both splits"
)
HOW_TO_GET = (
    "Extract ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar (image-net.org) and sort "
    "val/ into class folders (e.g. with the common valprep.sh), or set dataset.synthetic=true "
    "to run on random data"
)

_SPLIT_SIZES = {True: 1_281_167, False: 50_000}


def _split_dir(root: Path, train: bool) -> Path:
    return root / ("train" if train else "val")


def imagenet_classes(split_dir: str | os.PathLike[str]) -> list[str]:
    """Sorted class-folder names of one split; raises DatasetError if there are none.

    Args:
        split_dir: ``<root>/train`` or ``<root>/val``.
    """
    path = Path(split_dir)
    if not path.is_dir():
        raise DatasetError(path, EXPECTED_LAYOUT, HOW_TO_GET)
    classes = sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        loose = sum(1 for e in os.scandir(path) if e.name.lower().endswith(IMG_EXTENSIONS))
        found = (
            f"{loose} image files directly in it and no class folders"
            if loose
            else "no class folders"
        )
        raise DatasetError(path, f"{EXPECTED_LAYOUT}; found {found}", HOW_TO_GET)
    return classes


def _check_same_classes(root: Path, train: bool, classes: list[str]) -> None:
    other = _split_dir(root, not train)
    if not other.is_dir():
        return  # the other split is optional (e.g. a train-only throughput tree)
    other_classes = imagenet_classes(other)
    if other_classes != classes:
        only_here = sorted(set(classes) - set(other_classes))[:3]
        only_there = sorted(set(other_classes) - set(classes))[:3]
        raise DatasetError(
            root,
            f"{EXPECTED_LAYOUT}; train/ and val/ differ ({len(classes)} vs {len(other_classes)} "
            f"classes, e.g. only in {_split_dir(root, train).name}/: {only_here}, "
            f"only in {other.name}/: {only_there})",
        )


def imagenet_split(
    root: str | os.PathLike[str] | None,
    train: bool = True,
    augment: bool = True,
    synthetic: bool = False,
    image_size: int = 224,
    resize_size: int | None = None,
    synthetic_length: int | None = None,
    num_classes: int | None = 1000,
    seed: int = 0,
) -> Dataset[tuple[torch.Tensor, int]]:
    """One split of ImageNet.

    Items are ``(image, label)``: float32 ``(3, image_size, image_size)`` normalised with the
    ImageNet mean/std, and the class index (sorted wnid order). Train with ``augment``:
    RandomResizedCrop + horizontal flip; validation (or ``augment=False``): Resize(``resize_size``)
    + CenterCrop.

    Args:
        root: directory holding ``train/`` and ``val/`` (ignored when ``synthetic``).
        train: ``train/`` split, else ``val/``.
        augment: random augmentation on the train split.
        synthetic: random tensors of the same shape instead of files.
        image_size: output side (224 in the papers; smoke runs use e.g. 64).
        resize_size: shorter side before the centre crop; default ``round(image_size * 256 / 224)``.
        synthetic_length: synthetic split size; default the real one (1,281,167 / 50,000).
        num_classes: label range of the synthetic data; for real data, the number of class folders
            expected (checked, so a model/dataset mismatch fails at start-up), ``None`` to skip.
        seed: seed of the synthetic data.

    Returns:
        A ``torchvision.datasets.ImageFolder`` (with ``.classes``, ``.targets``) or a
        :class:`~kfac_bench.data.synthetic.SyntheticImages`.

    Raises:
        DatasetError: missing root/split, no class folders, an empty class folder, train/ and
            val/ with different class folders, or not ``num_classes`` class folders.
    """
    if synthetic:
        length = synthetic_length or _SPLIT_SIZES[train]
        shape = (3, image_size, image_size)
        n_labels = 1000 if num_classes is None else num_classes
        return SyntheticImages(length, shape, n_labels, seed=seed + (0 if train else 1))
    if root is None or str(root) == "":
        raise DatasetError("<unset dataset.root>", EXPECTED_LAYOUT, HOW_TO_GET)
    root_path = Path(root).expanduser()
    if not root_path.is_dir():
        raise DatasetError(root_path, EXPECTED_LAYOUT, HOW_TO_GET)
    split = _split_dir(root_path, train)
    classes = imagenet_classes(split)
    _check_same_classes(root_path, train, classes)
    if num_classes is not None and len(classes) != num_classes:
        raise DatasetError(
            split,
            f"{EXPECTED_LAYOUT}; dataset.num_classes={num_classes} but found {len(classes)} class "
            "folders (set dataset.num_classes and model.num_classes to the folder count)",
        )
    transform = imagenet_transform(train, augment, image_size, resize_size)
    try:
        # load_rgb: a truncated or corrupt JPEG is one line naming the file (kfac_bench.data.images).
        return ImageFolder(str(split), transform=transform, loader=load_rgb)
    except FileNotFoundError as exc:  # a class folder without any image file
        raise DatasetError(split, f"{EXPECTED_LAYOUT}; {exc}", HOW_TO_GET) from exc


def build_imagenet(
    root: str | None = "data/imagenet",
    augment: bool = True,
    synthetic: bool = False,
    image_size: int = 224,
    resize_size: int | None = None,
    synthetic_length: int | None = None,
    num_classes: int = 1000,
    seed: int = 0,
) -> DataSplits:
    """Dataset builder (``dataset=imagenet``): ``train/`` and ``val/`` of ``root``, or random tensors of the
    same shapes with ``synthetic`` (see :func:`imagenet_split` for the arguments)."""
    args = (augment, synthetic, image_size, resize_size, synthetic_length, num_classes, seed)
    return DataSplits(imagenet_split(root, True, *args), imagenet_split(root, False, *args))


def build_tiny_imagenet(
    root: str = "data/imagenet_tiny",
    classes: int = 4,
    per_class: int = 8,
    image_size: int = 64,
    seed: int = 0,
) -> DataSplits:
    """Dataset builder (``dataset=imagenet_tiny``) of the smoke recipes: a tiny class-folder tree of real
    JPEG files, written to ``root`` by :func:`write_tiny_imagenet` (``classes`` folders) unless
    ``<root>/train`` exists, then read like the real data at ``image_size`` (RandomResizedCrop + flip for
    train, Resize + CenterCrop for val). Items: float32 ``(3, image_size, image_size)``, label in
    ``[0, classes)``."""
    if not (Path(root) / "train").is_dir():
        write_tiny_imagenet(root, classes=classes, per_class=per_class, seed=seed)
    return build_imagenet(root, image_size=image_size, num_classes=classes)


def write_tiny_imagenet(
    root: str | os.PathLike[str],
    classes: int = 4,
    per_class: int = 8,
    size: int = 72,
    val_per_class: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a small ImageNet-style tree of real JPEG files under ``root``.

    Layout: ``<root>/train/<wnid>/<wnid>_<k>.JPEG`` (``per_class`` each) and
    ``<root>/val/<wnid>/ILSVRC2012_val_<k>.JPEG`` (``val_per_class`` each, default
    ``max(2, per_class // 4)``), with wnids ``n00000000, n00000001, ...``. Images are RGB, the
    shorter side about ``size`` pixels and a random aspect ratio in [3/4, 4/3], like the varied
    sizes of ImageNet; their pixels are learnable (:func:`kfac_bench.data.synthetic.class_colour_images`).

    Returns:
        ``root`` (the directory to pass as ``dataset.root``).
    """
    rng = np.random.default_rng(seed)
    val_n = max(2, per_class // 4) if val_per_class is None else val_per_class
    wnids = [f"n{c:08d}" for c in range(classes)]
    val_index = 0
    for split, n in (("train", per_class), ("val", val_n)):
        for c, wnid in enumerate(wnids):
            folder = Path(root) / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                aspect = float(rng.uniform(0.75, 4 / 3))
                h, w = (size, round(size * aspect)) if aspect >= 1 else (round(size / aspect), size)
                pixels = class_colour_images(np.array([c]), classes, h, w, rng)[0]
                if split == "train":
                    name = f"{wnid}_{k}.JPEG"
                else:
                    val_index += 1
                    name = f"ILSVRC2012_val_{val_index:08d}.JPEG"
                write_jpeg(folder / name, pixels, quality=90)
    return Path(root)
