"""Writers of tiny datasets in the benchmarks' real on-disk formats, for tests and smoke recipes.

The files are what the real loaders read (``cifar-10-batches-py`` pickles; an ImageFolder tree of
JPEG files), so a smoke run exercises the whole input pipeline. The images are learnable: each
class has its own colour (hue ``c / num_classes``) under pixel noise, which random crops and flips
preserve, so a few epochs of a small network get well above chance.
"""

from __future__ import annotations

import colorsys
import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from kfac_bench.data.cifar import CIFAR10_DIRNAME, META_FILE, TEST_FILES, TRAIN_FILES

__all__ = ["CIFAR10_LABEL_NAMES", "class_colour", "write_tiny_cifar10", "write_tiny_imagenet"]

CIFAR10_LABEL_NAMES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


# The pure-Python pickler: unlike the C one, its per-type dispatch table can be extended.
_PurePickler: Any = pickle._Pickler


class _Py2StylePickler(_PurePickler):
    """Pickler that writes ``bytes`` and ``str`` as Python 2 ``str`` opcodes, as in the release.

    The CIFAR-10 files were written by Python 2, so every string in them (dict keys, numpy's dtype
    arguments and raw array data) is a py2 ``str``, which Python 3 readers decode with
    ``encoding="bytes"`` (the CIFAR page's recipe) or ``"latin1"`` (torchvision). Python 3 would
    write bytes as calls to ``_codecs.encode`` and str as unicode; writing the py2 opcodes instead
    makes the fixture exercise the same decoding paths as the real files.
    """

    dispatch: ClassVar[dict[type, Any]] = dict(_PurePickler.dispatch)

    def _save_py2_str(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    def _save_latin1_str(self, obj: str) -> None:
        self._save_py2_str(obj.encode("latin1"))

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_latin1_str


def _dump_py2(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    _Py2StylePickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue())


def class_colour(label: int, num_classes: int) -> np.ndarray:
    """RGB colour (float ``(3,)`` in [0, 255]) of ``label``: evenly spaced hues, saturated."""
    r, g, b = colorsys.hsv_to_rgb(label / num_classes, 0.85, 0.9)
    return np.array([r, g, b]) * 255.0


def _images(
    labels: np.ndarray, num_classes: int, h: int, w: int, rng: np.random.Generator
) -> np.ndarray:
    """uint8 ``(n, h, w, 3)``: each image its class colour plus N(0, 40^2) noise per pixel."""
    base = np.stack([class_colour(int(c), num_classes) for c in labels])[:, None, None, :]
    noisy = base + rng.normal(0.0, 40.0, size=(len(labels), h, w, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def write_tiny_cifar10(
    root: str | os.PathLike[str], n_train: int = 250, n_test: int = 50, seed: int = 0
) -> Path:
    """Write a small CIFAR-10 in the python-pickle release format under ``root``.

    Creates ``<root>/cifar-10-batches-py/`` with ``data_batch_1..5`` (``n_train`` images split as
    evenly as possible), ``test_batch`` (``n_test``) and ``batches.meta``. Each batch is a dict
    with the release's keys: ``b'data'`` uint8 ``(n, 3072)`` (R, G, B planes, row-major),
    ``b'labels'`` (list of int), ``b'batch_label'`` and ``b'filenames'``; the meta file has
    ``b'label_names'``, ``b'num_cases_per_batch'`` and ``b'num_vis'``. Labels cycle through the 10
    classes.

    Returns:
        ``root`` (the directory to pass as ``dataset.root``).
    """
    rng = np.random.default_rng(seed)
    directory = Path(root) / CIFAR10_DIRNAME
    directory.mkdir(parents=True, exist_ok=True)
    train_sizes = [len(a) for a in np.array_split(np.arange(n_train), len(TRAIN_FILES))]
    splits = [
        (name, size, f"training batch {i + 1} of {len(TRAIN_FILES)}")
        for i, (name, size) in enumerate(zip(TRAIN_FILES, train_sizes, strict=True))
    ]
    splits.append((TEST_FILES[0], n_test, "testing batch 1 of 1"))
    for name, size, batch_label in splits:
        labels = (np.arange(size) + int(rng.integers(10))) % 10
        pixels = _images(labels, 10, 32, 32, rng)  # (n, 32, 32, 3)
        data = pixels.transpose(0, 3, 1, 2).reshape(size, 3072)  # channel planes, as the release
        batch = {
            b"batch_label": batch_label.encode(),
            b"labels": [int(c) for c in labels],
            b"data": np.ascontiguousarray(data),
            b"filenames": [
                f"{CIFAR10_LABEL_NAMES[c]}_s_{i:06d}.png".encode() for i, c in enumerate(labels)
            ],
        }
        _dump_py2(batch, directory / name)
    meta = {
        b"num_cases_per_batch": max([*train_sizes, n_test]),
        b"label_names": [n.encode() for n in CIFAR10_LABEL_NAMES],
        b"num_vis": 3072,
    }
    _dump_py2(meta, directory / META_FILE)
    return Path(root)


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
    sizes of ImageNet.

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
                pixels = _images(np.array([c]), classes, h, w, rng)[0]
                if split == "train":
                    name = f"{wnid}_{k}.JPEG"
                else:
                    val_index += 1
                    name = f"ILSVRC2012_val_{val_index:08d}.JPEG"
                Image.fromarray(pixels).save(folder / name, format="JPEG", quality=90)
    return Path(root)
