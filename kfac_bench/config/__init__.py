"""Typed configuration: schemas (:mod:`.schema`), where the YAML lives, and their registration with Hydra.

``configs/`` (config groups) and ``recipes/`` (one flat file per benchmark) sit at the top of the source tree;
a wheel carries them as ``kfac_bench/_configs`` and ``kfac_bench/_recipes`` (copied by ``setup.py``'s build
step), so ``+recipe=NAME`` works from a non-editable install too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir", "recipes_dir"]

_PACKAGE = Path(__file__).resolve().parent.parent


def _locate(name: str) -> Path:
    packaged = _PACKAGE / f"_{name}"
    if packaged.is_dir():
        return packaged
    # Source checkout (plain or editable install): the folder next to the package.
    return _PACKAGE.parent / name


def config_dir() -> Path:
    """The directory holding the primary config ``train.yaml`` and the config groups."""
    return _locate("configs")


def recipes_dir() -> Path:
    """The directory holding the recipe files (``NAME.yaml``) and their README."""
    return _locate("recipes")
