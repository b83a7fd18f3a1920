"""scikit-learn's digits (1797 8x8 grey images, 10 classes) for the bundled default job.

The data ships inside scikit-learn (``sklearn/datasets/data/digits.csv.gz``: one row per image, 64 pixel
values in 0..16 then the label), so the default job needs no download. ``root`` may point at another
directory holding a file in the same format.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from kfac_bench.data.base import DataSplits
from kfac_bench.errors import DatasetError

__all__ = ["FILE_NAME", "build_digits", "load_digits_csv"]

FILE_NAME = "digits.csv.gz"


def _bundled_file() -> Path:
    # Locate scikit-learn without importing it (the import alone takes seconds).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("sklearn", "scikit-learn installed (it bundles digits.csv.gz)")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / FILE_NAME


def load_digits_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images of shape (N, 8, 8), float32 in [0, 16], and integer labels of shape (N,) from ``path``."""
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise DatasetError(path, f"a gzipped CSV of 65 columns (64 pixels, label): {exc}") from None
    if table.ndim != 2 or table.shape[1] != 65:
        raise DatasetError(path, f"65 columns (64 pixels, label), found shape {table.shape}")
    return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)


def build_digits(
    root: str | None = None, val_fraction: float = 0.2, split_seed: int = 0
) -> DataSplits:
    """Digits split into train/val by a fixed permutation (independent of the training seed).

    Args:
        root: directory holding ``digits.csv.gz``; None reads the copy bundled with scikit-learn.
        val_fraction: share of the images held out for evaluation.
        split_seed: seed of the train/val permutation.

    Returns:
        Datasets of (image (1, 8, 8) float32 standardised with the training mean/std, label int64).
    """
    if root is None:
        path = _bundled_file()
    else:
        path = Path(root).expanduser() / FILE_NAME
        if not path.is_file():
            raise DatasetError(
                path,
                f"a file '{FILE_NAME}' in the directory {root}",
                "Copy it from scikit-learn (sklearn/datasets/data/digits.csv.gz) or leave dataset.root unset",
            )
    images, labels = load_digits_csv(path)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_val = round(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    x = torch.from_numpy(images).unsqueeze(1)
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    y = torch.from_numpy(labels)
    return DataSplits(
        TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])
    )
