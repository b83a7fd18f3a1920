"""CIFAR-10 from the standard python-pickle release (``cifar-10-batches-py``), or synthetic; and a writer
of tiny sets in the same format for tests and smoke runs.

The reader is our own rather than ``torchvision.datasets.CIFAR10(download=False)``: torchvision
checks the md5 of every batch file against the official release, so it rejects any other file in
the same format (the tiny generated datasets of the tests and smoke recipes), and on a bad tree it
raises a generic error. This reader checks the *format* instead (keys, dtypes, shapes, label
range) and reports problems as :class:`~kfac_bench.errors.DatasetError` naming the file and the
expected layout. It reads the official files the same way (``pickle`` with ``encoding="bytes"``,
as the CIFAR page recommends), through an unpickler that only admits the numpy array
constructors the release uses.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from kfac_bench import safe_files
from kfac_bench.data.base import DataSplits
from kfac_bench.data.synthetic import SyntheticImages, class_colour_images
from kfac_bench.data.transforms import cifar10_transform
from kfac_bench.errors import DatasetError

__all__ = [
    "CIFAR10_DIRNAME",
    "CIFAR10_LABEL_NAMES",
    "CIFAR10Pickle",
    "build_cifar10",
    "build_tiny_cifar10",
    "cifar10_split",
    "read_cifar10_split",
    "write_tiny_cifar10",
]

CIFAR10_DIRNAME = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"

EXPECTED_LAYOUT = (
    f"<root>/{CIFAR10_DIRNAME}/ holding {', '.join(TRAIN_FILES)}, {TEST_FILES[0]} and {META_FILE} "
    "(the python-pickle release of CIFAR-10)"
)
HOW_TO_GET = (
    "Get it from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it with "
    "`tar xzf cifar-10-python.tar.gz -C <root>`, or set dataset.synthetic=true to run on "
    "random data"
)

# Globals a CIFAR-10 pickle may reference: numpy's array reconstruction (numpy < 2 and >= 2
# spellings) and the codec helper Python 3 uses for bytes under pickle protocol 2. Anything else is
# refused, so a stray pickle in the data directory cannot run code.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


def _load_dict(path: Path) -> dict[str, Any]:
    """Unpickle one release file into a dict with ``str`` keys (the files hold byte-string keys)."""
    try:
        with path.open("rb") as f:
            obj = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means "not a CIFAR batch"
        raise DatasetError(
            path, f"a python pickle of a dict ({exc.__class__.__name__}: {exc})"
        ) from exc
    if not isinstance(obj, dict):
        raise DatasetError(path, f"a pickled dict, found {type(obj).__name__}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _resolve_dir(root: str | os.PathLike[str]) -> Path:
    root_path = Path(root).expanduser()
    if not root_path.is_dir():
        raise DatasetError(root_path, EXPECTED_LAYOUT, HOW_TO_GET)
    batches = root_path / CIFAR10_DIRNAME
    if batches.is_dir():
        return batches
    if (root_path / META_FILE).is_file():  # root already points at cifar-10-batches-py itself
        return root_path
    raise DatasetError(batches, EXPECTED_LAYOUT, HOW_TO_GET)


def _read_batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_dict(path)
    expected = (
        f"a batch dict with b'data' uint8 (n, 3072) and b'labels' (n ints in [0, {num_classes}))"
    )
    data, labels = batch.get("data"), batch.get("labels")
    if not isinstance(data, np.ndarray) or labels is None:
        raise DatasetError(path, f"{expected}; found keys {sorted(batch)}")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DatasetError(path, f"{expected}; found data {data.dtype} {tuple(data.shape)}")
    labels_arr = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(labels_arr) != len(data):
        raise DatasetError(path, f"{expected}; found {len(data)} images, {len(labels_arr)} labels")
    if len(labels_arr) and (labels_arr.min() < 0 or labels_arr.max() >= num_classes):
        raise DatasetError(path, f"{expected}; found labels outside [0, {num_classes})")
    # The release stores each image as its R, G, B planes of 32x32 pixels, row-major.
    return data.reshape(-1, 3, 32, 32), labels_arr


def read_cifar10_split(
    root: str | os.PathLike[str], train: bool
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read one split of the release.

    Args:
        root: the directory holding ``cifar-10-batches-py/`` (or that directory itself).
        train: ``data_batch_1..5`` if true, else ``test_batch``.

    Returns:
        ``(images, labels, class_names)``: uint8 ``(N, 3, 32, 32)`` in file order (batch 1 first),
        int64 ``(N,)``, and the ``label_names`` of ``batches.meta``.

    Raises:
        DatasetError: a directory or file is missing, or a file is not in the release's format.
    """
    directory = _resolve_dir(root)
    names = TRAIN_FILES if train else TEST_FILES
    missing = [n for n in (META_FILE, *names) if not (directory / n).is_file()]
    if missing:
        raise DatasetError(
            directory, f"{EXPECTED_LAYOUT}; missing {', '.join(missing)}", HOW_TO_GET
        )
    meta = _load_dict(directory / META_FILE)
    label_names = meta.get("label_names")
    if not isinstance(label_names, list) or not label_names:
        raise DatasetError(
            directory / META_FILE, "a dict with b'label_names', a list of class names"
        )
    classes = [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in label_names]
    parts = [_read_batch(directory / n, len(classes)) for n in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if len(images) == 0:
        raise DatasetError(
            directory, f"{EXPECTED_LAYOUT}; the {'train' if train else 'test'} split is empty"
        )
    return images, labels, classes


class CIFAR10Pickle(Dataset[tuple[torch.Tensor, int]]):
    """One split of CIFAR-10 held in memory; item ``i`` is ``(transform(image_i), label_i)``.

    Attributes:
        data: uint8 ``(N, 3, 32, 32)`` images in file order.
        targets: ``N`` int labels.
        classes: class names from ``batches.meta``.
        transform: applied to the uint8 ``(3, 32, 32)`` tensor; ``None`` returns it unchanged.
    """

    def __init__(
        self, root: str | os.PathLike[str], train: bool = True, transform: Any = None
    ) -> None:
        images, labels, self.classes = read_cifar10_split(root, train)
        self.data = torch.from_numpy(np.ascontiguousarray(images))
        self.targets = labels.tolist()
        self.transform = transform
        self.train = train

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def cifar10_split(
    root: str | os.PathLike[str] | None,
    train: bool = True,
    augment: bool = True,
    synthetic: bool = False,
    synthetic_length: int | None = None,
    seed: int = 0,
) -> Dataset[tuple[torch.Tensor, int]]:
    """One split of CIFAR-10.

    Items are ``(image, label)``: float32 ``(3, 32, 32)`` normalised with the CIFAR-10 mean/std and
    an int in ``[0, 10)``. The train split with ``augment`` applies RandomCrop(32, padding=4) and
    RandomHorizontalFlip first.

    Args:
        root: directory holding ``cifar-10-batches-py/`` (ignored when ``synthetic``).
        train: train split (50,000 images in the release) or test split (10,000).
        augment: random crop + flip on the train split.
        synthetic: random tensors of the same shape and label range instead of files.
        synthetic_length: samples of the synthetic split; default is the real split's size.
        seed: seed of the synthetic data (the real data ignores it).

    Raises:
        DatasetError: ``root`` is missing or not in the release's layout/format.
    """
    if synthetic:
        length = synthetic_length or (50_000 if train else 10_000)
        return SyntheticImages(length, (3, 32, 32), 10, seed=seed + (0 if train else 1))
    if root is None or str(root) == "":
        raise DatasetError("<unset dataset.root>", EXPECTED_LAYOUT, HOW_TO_GET)
    return CIFAR10Pickle(root, train=train, transform=cifar10_transform(train, augment))


def build_cifar10(
    root: str | None = "data/cifar10",
    augment: bool = True,
    synthetic: bool = False,
    synthetic_length: int | None = None,
    seed: int = 0,
) -> DataSplits:
    """Dataset builder (``dataset=cifar10``): the 50,000 training and 10,000 test images of ``root``, or
    random tensors of the same shapes with ``synthetic`` (see :func:`cifar10_split` for the arguments)."""
    train = cifar10_split(root, True, augment, synthetic, synthetic_length, seed)
    return DataSplits(train, cifar10_split(root, False, augment, synthetic, synthetic_length, seed))


def build_tiny_cifar10(
    root: str = "data/cifar10_tiny", n_train: int = 200, n_test: int = 50, seed: int = 0
) -> DataSplits:
    """Dataset builder (``dataset=cifar10_tiny``) of the smoke recipes: a tiny CIFAR-10 in the release
    format, written to ``root`` by :func:`write_tiny_cifar10` unless it already holds ``batches.meta``,
    then read like the real release (augmentation on the train split). Items: float32 ``(3, 32, 32)``,
    label in ``[0, 10)``."""
    if not (Path(root) / CIFAR10_DIRNAME / META_FILE).is_file():
        write_tiny_cifar10(root, n_train=n_train, n_test=n_test, seed=seed)
    return build_cifar10(root)


# ---------------------------------------------------------------------------------------------------------
# Writer of tiny sets in the release format (tests and smoke recipes)

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
    safe_files.write_atomic(path, buf.getvalue())


def write_tiny_cifar10(
    root: str | os.PathLike[str], n_train: int = 250, n_test: int = 50, seed: int = 0
) -> Path:
    """Write a small CIFAR-10 in the python-pickle release format under ``root``.

    Creates ``<root>/cifar-10-batches-py/`` with ``data_batch_1..5`` (``n_train`` images split as
    evenly as possible), ``test_batch`` (``n_test``) and ``batches.meta``. Each batch is a dict
    with the release's keys: ``b'data'`` uint8 ``(n, 3072)`` (R, G, B planes, row-major),
    ``b'labels'`` (list of int), ``b'batch_label'`` and ``b'filenames'``; the meta file has
    ``b'label_names'``, ``b'num_cases_per_batch'`` and ``b'num_vis'``. Labels cycle through the 10
    classes; images are learnable (:func:`kfac_bench.data.synthetic.class_colour_images`).

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
        pixels = class_colour_images(labels, 10, 32, 32, rng)  # (n, 32, 32, 3)
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
