"""Typed configuration: schemas (:mod:`.schema`), where the YAML lives, and their registration with Hydra.

``configs/`` (config groups) and ``recipes/`` (one flat file per benchmark) sit at the top of the source tree;
a wheel carries them as ``kfac_bench/_configs`` and ``kfac_bench/_recipes`` (copied by ``setup.py``'s build
step), so ``+recipe=NAME`` works from a non-editable install too; likewise ``launch/`` (the torchrun and
SLURM scripts) as ``kfac_bench/_launch``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "builder_name",
    "config_dir",
    "flat_config",
    "hydra_quote",
    "launch_dir",
    "model_name",
    "recipes_dir",
]

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


def launch_dir() -> Path:
    """The directory holding the launch scripts (``slurm.sbatch``, ``torchrun_multinode.sh``, ...)."""
    return _locate("launch")


def builder_name(section: Mapping[str, Any] | None) -> str:
    """A config section's builder as a short name: ``kfac_bench.data.cifar.build_cifar10`` -> ``cifar10``
    (``?`` when it names none)."""
    target = str((section or {}).get("_target_") or "?")
    return target.rsplit(".", 1)[-1].removeprefix("build_")


def model_name(model: Mapping[str, Any] | None) -> str:
    """A model as users name it, from its config section: ``arch`` where the builder takes one
    (``resnet152``), the depth of a CIFAR ResNet (``resnet32``), ``bert_<preset>`` for BERT
    (``bert_large``), else the builder's name (``maskrcnn``, ``small_cnn``). The planner's profiles and the
    comparison's titles use this one name."""
    model = model or {}
    builder = builder_name(model)
    if model.get("arch"):
        return str(model["arch"])
    if builder == "cifar_resnet" and model.get("depth"):
        return f"resnet{model['depth']}"
    if builder in ("bert", "bert_qa"):
        return builder.replace("bert", f"bert_{model.get('preset', 'large')}", 1)
    return builder


def flat_config(config: Mapping[str, Any], skip: Sequence[str] = ()) -> dict[str, Any]:
    """A nested plain config as ``{"a.b.c": value}``, leaving out the keys that match an ``fnmatch``
    pattern of ``skip`` (``train.seed``, ``launcher.*``). An empty section has no keys."""
    return {
        key: value
        for key, value in _flatten(config, "")
        if not any(fnmatch.fnmatchcase(key, pattern) for pattern in skip)
    }


def _flatten(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def hydra_quote(value: str) -> str:
    """``value`` as a single-quoted value of Hydra's override grammar that Hydra and OmegaConf read back
    as exactly ``value``: spaces, ``,``, ``=``, brackets, quotes, non-ASCII and ``${`` included (unquoted,
    a path such as ``runs/x y,z`` is a lexer error or a sweep)."""
    # OmegaConf: an interpolation opener is escaped with a backslash, and backslashes before it doubled.
    value = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    # Hydra: a backslash is literal, except in a run before a quote or the closing quote: doubled there.
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"
