"""Fairness flags of a comparison: is each arm run at the hyperparameters tuned for it?

A comparison of K-FAC with a first-order optimizer is fair only when both arms run at their own tuned
values; a baseline at K-FAC's learning rate (or the reverse) makes the verdict meaningless, and silently
so. Each run's config carries a ``tuning`` record (``kfac_bench/config/schema.py`` ``TuningConfig``: the
arm the values were tuned for, their source, and the tuned values as nested config keys), written by the
recipes and by ``kfac-bench tune``. A run is flagged when:

- its record was tuned for another arm: a first-order run whose values were tuned for K-FAC ("baseline
  not tuned: LR 0.8 taken from the K-FAC recipe digits"), a K-FAC run at values tuned for a first-order
  optimizer, or a first-order run tuned for another optimizer;
- its config differs from the tuned values in ``optimizer.*`` or ``lr_schedule.*`` (and ``kfac.*`` for a
  K-FAC run; a first-order run ignores K-FAC-only values its recipe inherits): only keys the record holds
  are checked;
- it has no tuning record (``tuning.source`` unset).

A run without a flag had a record present and matched (:data:`MATCHED`, what the table's fairness row
says then). Beside the tuning, an arm is flagged where its design differs from the baseline's
(:func:`design_flags`): another dataset or model (their config sections, the data's location aside), or
another budget (``train.epochs``, ``train.max_steps``, ``train.limit_train_batches``); runs with different
targets are refused before this (``kfac_bench.compare.report.check_same_target``).

:func:`fairness_flags` returns the flags of a group of runs, one line each, naming the run's role.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kfac_bench.config import flat_config
from kfac_bench.metrics.summary import first_order

__all__ = [
    "DESIGN",
    "KFAC_ARM",
    "MATCHED",
    "SAME_DESIGN",
    "design_flags",
    "fairness_flags",
    "run_flags",
    "tuned_arm",
]

#: ``tuning.arm`` of values tuned for a K-FAC arm (a first-order arm names its optimizer).
KFAC_ARM = "kfac"
#: Config sections whose tuned values a run must keep (``kfac`` only for K-FAC runs).
_TUNED = ("optimizer", "lr_schedule")
#: What the fairness row says of a run without a flag: what was checked, and that it held (an arm's row
#: adds :data:`SAME_DESIGN`).
MATCHED = "tuning record present and matched"
SAME_DESIGN = "same dataset, model and budget as the baseline"
#: What an arm must share with the baseline: a name and the config keys (flattened) that make it. The
#: data's location is not the data.
DESIGN: dict[str, tuple[str, ...]] = {
    "dataset": ("dataset",),
    "model": ("model",),
    "budget": ("train.epochs", "train.max_steps", "train.limit_train_batches"),
}
_NOT_DESIGN = ("dataset.root",)


def tuned_arm(summary: dict[str, Any]) -> str:
    """The ``tuning.arm`` a run's values must have been tuned for: ``kfac`` for a K-FAC run, else the
    optimizer's name (``sgd``, ``lamb``, ...)."""
    if not first_order(summary):
        return KFAC_ARM
    optimizer = (summary.get("config") or {}).get("optimizer") or {}
    name = optimizer.get("name", "?")
    return str(getattr(name, "value", name)).lower()  # a config not yet written out holds the enum


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def run_flags(summary: dict[str, Any], who: str) -> list[str]:
    """The fairness flags of one run (its ``summary.json`` or a summary rebuilt from its config), each
    starting with ``who`` (``baseline``, or the arm's label)."""
    config = summary.get("config") or {}
    tuning = config.get("tuning") or {}
    if not isinstance(tuning, dict) or not tuning.get("source"):
        return [
            f"{who} has no tuning record (tuning.source unset): its hyperparameters' origin is unknown"
        ]
    arm, tuned_for = tuned_arm(summary), str(tuning.get("arm") or "?").lower()
    lr = (config.get("optimizer") or {}).get("lr")
    recipe = config.get("name", "?")
    if tuned_for != arm:
        if tuned_for == KFAC_ARM:
            return [f"{who} not tuned: LR {_show(lr)} taken from the K-FAC recipe {recipe}"]
        if arm == KFAC_ARM:
            return [f"{who} not tuned: LR {_show(lr)} taken from the {tuned_for} recipe {recipe}"]
        return [f"{who} not tuned: its values were tuned for {tuned_for}, it runs {arm}"]
    sections = _TUNED + ((KFAC_ARM,) if arm == KFAC_ARM else ())
    values = tuning.get("values") or {}
    tuned = (
        flat_config({k: v for k, v in values.items() if k in sections})
        if isinstance(values, dict)
        else {}
    )
    have = flat_config({k: config.get(k) or {} for k in sections})
    differ = [
        f"{key} {_show(have.get(key))} (tuned {_show(value)})"
        for key, value in tuned.items()
        if not _same(have.get(key), value)
    ]
    if differ:
        return [
            f"{who} not at its tuned values: "
            + ", ".join(differ)
            + f" (tuning: {tuning['source']})"
        ]
    return []


def fairness_flags(summaries: Sequence[dict[str, Any]], who: str) -> list[str]:
    """The flags of a group of runs (one arm's seeds), each once, in order of first appearance."""
    return list(dict.fromkeys(f for s in summaries for f in run_flags(s, who)))


def _design(summary: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    config = summary.get("config") or {}
    flat = flat_config(config, _NOT_DESIGN)
    return {
        k: v for k, v in flat.items() if any(k == key or k.startswith(key + ".") for key in keys)
    }


def design_flags(
    arm: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], who: str
) -> list[str]:
    """One flag per :data:`DESIGN` part (dataset, model, budget) in which a run of ``arm`` differs from
    the baseline's first run, naming up to three keys with both values."""
    if not arm or not baseline:
        return []
    flags = []
    for part, keys in DESIGN.items():
        base = _design(baseline[0], keys)
        for summary in arm:
            own = _design(summary, keys)
            differ = [
                f"{k} {_show(own.get(k))} (baseline {_show(base.get(k))})"
                for k in sorted(set(own) | set(base))
                if not _same(own.get(k), base.get(k))
            ]
            if differ:
                more = f", and {len(differ) - 3} more" if len(differ) > 3 else ""
                flags.append(f"{who} runs another {part}: " + ", ".join(differ[:3]) + more)
                break
    return flags
