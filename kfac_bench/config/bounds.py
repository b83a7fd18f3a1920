"""Value bounds of schema fields, declared on the field itself, and the check of a composed config.

A schema field says its range where it is declared (:mod:`kfac_bench.config.schema`)::

    lr: float = bounded(0.1, gt=0)

:func:`check_bounds` walks a composed run config next to the schemas (the groups' dataclasses, and for
``model``/``dataset``/``task`` the schema whose ``_target_`` matches) and raises one
:class:`~kfac_bench.errors.ConfigError` naming the key, its value and the allowed range. ``None`` is always
accepted for an optional field (it means "not set"); types are OmegaConf's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kfac_bench.errors import ConfigError

__all__ = ["Bounds", "bounded", "bounds_of", "check_bounds", "check_run_values", "check_value"]

_KEY = "kfac_bench.bounds"


@dataclass(frozen=True)
class Bounds:
    """An interval: ``gt``/``ge`` below, ``lt``/``le`` above (None: open)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return not (
            (self.gt is not None and value <= self.gt)
            or (self.ge is not None and value < self.ge)
            or (self.lt is not None and value >= self.lt)
            or (self.le is not None and value > self.le)
        )

    def describe(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1)`` ..."""
        low = (
            ("(", self.gt)
            if self.gt is not None
            else ("[", self.ge)
            if self.ge is not None
            else None
        )
        high = (
            (")", self.lt)
            if self.lt is not None
            else ("]", self.le)
            if self.le is not None
            else None
        )
        if low and high:
            return f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
        if low:
            return f"{'>' if low[0] == '(' else '>='} {_num(low[1])}"
        if high:
            return f"{'<' if high[0] == ')' else '<='} {_num(high[1])}"
        return "any number"


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounded(
    default: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with ``default`` whose values must lie in the given interval."""
    return field(default=default, metadata={_KEY: Bounds(gt=gt, ge=ge, lt=lt, le=le)})


def bounds_of(schema: type) -> Iterator[tuple[str, Bounds]]:
    """(field name, bounds) of every bounded field of the dataclass ``schema``."""
    for f in dataclasses.fields(schema):
        if _KEY in f.metadata:
            yield f.name, f.metadata[_KEY]


def check_value(key: str, value: Any, bounds: Bounds) -> None:
    """Raise a one-line :class:`ConfigError` if ``value`` (of config key ``key``) is out of ``bounds``."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and math.isinf(value):
        raise ConfigError(
            f"invalid value {key}={value}: must be a finite number {bounds.describe()}"
        )
    if not bounds.contains(value):
        raise ConfigError(f"invalid value {key}={value}: must be {bounds.describe()}")


def _section_schemas(
    cfg: Any, by_target: dict[str, type], groups: Mapping[str, Any]
) -> Iterator[tuple[str, type]]:
    for name in cfg:
        section = cfg.get(name)
        if name in groups:
            yield name, groups[name]
        elif hasattr(section, "get") and section.get("_target_") in by_target:
            yield name, by_target[section.get("_target_")]


def check_bounds(cfg: Any, groups: Mapping[str, Any], builders: list[type]) -> None:
    """Check every bounded field of a composed run config.

    Args:
        cfg: the composed config (``DictConfig`` or nested dicts).
        groups: top-level key -> its schema (``optimizer`` -> ``OptimizerConfig`` ...).
        builders: schemas of ``_target_`` builders; a section whose ``_target_`` matches one is checked
            against it.

    Raises:
        ConfigError: the first value out of range, as one line.
    """
    by_target = {}
    for schema in builders:
        target = next((f.default for f in dataclasses.fields(schema) if f.name == "_target_"), None)
        if isinstance(target, str):
            by_target[target] = schema
    for name, schema in _section_schemas(cfg, by_target, groups):
        section = cfg.get(name)
        for key, bounds in bounds_of(schema):
            if key in section:
                check_value(f"{name}.{key}", section.get(key), bounds)


def validate_run(cfg: Any) -> None:
    """Check every bounded field of a composed run config against :mod:`kfac_bench.config.schema` and the
    family schemas (:mod:`kfac_bench.config.families`).

    Raises:
        ConfigError: the first value out of range, as one line.
    """
    import typing

    from kfac_bench.config import schema
    from kfac_bench.config.families import SCHEMAS as FAMILY_SCHEMAS

    hints = typing.get_type_hints(schema.RunConfig)
    groups = {name: t for name, t in hints.items() if dataclasses.is_dataclass(t)}
    builders = [cls for _, _, cls in [*schema.SCHEMAS, *FAMILY_SCHEMAS]]
    check_bounds(cfg, groups, builders)
    check_run_values(cfg)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else None


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_run_values(cfg: Any) -> None:
    """The values a bound cannot express: ``name`` names one folder (the run directory's, under
    ``runs/``), every target is a finite number (a NaN target would count as met at once), and schedule
    milestones are finite and not negative.

    Raises:
        ConfigError: the first bad value, as one line.
    """
    name = _get(cfg, "name")
    if name is not None:
        text = str(name)
        if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
            raise ConfigError(
                f"invalid value name={text!r}: a run's name becomes part of its directory name; use "
                "letters, digits, '-', '_' or '.' (no '/' and not '..')"
            )
    targets = _get(_get(cfg, "train"), "targets")
    for metric, value in (targets or {}).items():
        if not _finite_number(value):
            raise ConfigError(
                f"invalid value train.targets.{metric}={value}: a target must be a finite number"
            )
    milestones = list(_get(_get(cfg, "lr_schedule"), "milestones") or ())
    for value in milestones:
        if not _finite_number(value) or value < 0:
            raise ConfigError(
                f"invalid value lr_schedule.milestones={milestones}: milestones must be finite "
                "numbers >= 0 (in lr_schedule.unit)"
            )
