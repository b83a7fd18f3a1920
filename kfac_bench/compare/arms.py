"""Runs grouped by arm for ``kfac-bench compare``: labels, the baseline, median and spread over seeds.

An arm is what a comparison is about: the optimizer and, with K-FAC on, its KAISA strategy ("SGD",
"SGD + K-FAC (COMM-OPT)"), or the run's ``name`` when it was set on the command line (``name=...``), or
the recipe's own ``name:`` where runs of one optimizer and strategy come from recipes of several names (a
copy of a recipe is an arm of its own, never merged with the original). Runs
whose configs differ only in ``train.seed`` (and in keys that change neither their numbers nor their
timing, :data:`SAME_RUN`) are one group: several seeds of one setting. Groups of one arm that differ in
other settings (a learning-rate sweep) are labelled with the keys that differ. The baseline is the first
first-order group unless chosen; the verdict is :mod:`kfac_bench.compare.verdict`'s.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kfac_bench.compare.runs import RunRecord
from kfac_bench.config import flat_config
from kfac_bench.errors import UserError
from kfac_bench.metrics.summary import arm_label, first_order

__all__ = [
    "SAME_RUN",
    "Group",
    "Spread",
    "choose_baseline",
    "group_runs",
    "run_measures",
    "spread",
]

#: Config keys that do not make two runs different settings (``*`` matches below a section): the seed
#: (what a group spans), the run's name, and how it is displayed or resumed.
SAME_RUN: tuple[str, ...] = (
    "name",
    "train.seed",
    "train.progress",
    "train.log_every_steps",
    "train.tensorboard",
    "train.tracker",
    "train.tracker_uri",
    "train.tracker_project",
    "train.resume",
    "launcher.max_restarts",
    "launcher.monitor_interval",
    "dataset.root",
    "train.campaign",
    "tuning.*",
)


def _name_set(run: RunRecord) -> str | None:
    """The ``name=...`` given on the command line of a Hydra run (``.hydra/overrides.yaml``)."""
    path = run.path / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        overrides = yaml.safe_load(path.read_text()) or []
    except (yaml.YAMLError, RecursionError):
        return None
    if not isinstance(overrides, list):
        return None
    names = [o.split("=", 1)[1] for o in overrides if isinstance(o, str) and o.startswith("name=")]
    return names[-1] if names else None


def _setting(summary: dict[str, Any]) -> dict[str, str]:
    """The run's config as ``key -> value`` (JSON text), without the :data:`SAME_RUN` keys."""
    flat = flat_config(summary.get("config") or {}, SAME_RUN)
    return {k: json.dumps(v, sort_keys=True) for k, v in flat.items()}


@dataclass
class Group:
    """Runs of one arm and setting (several seeds), in the order given."""

    label: str
    runs: list[RunRecord]

    @property
    def first_order(self) -> bool:
        return first_order(self.runs[0].summary)

    @property
    def seeds(self) -> list[int | None]:
        return [_seed(r) for r in self.runs]


def _seed(run: RunRecord) -> int | None:
    seed = ((run.summary.get("config") or {}).get("train") or {}).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _recipe_name(run: RunRecord) -> str | None:
    name = (run.summary.get("config") or {}).get("name")
    return str(name) if name is not None else None


def _arms(runs: Sequence[RunRecord]) -> list[str]:
    """Each run's arm: the ``name=`` of its command line, else its optimizer and strategy, unless runs of
    that label carry several recipe names: then the recipe's name."""
    given = [_name_set(r) for r in runs]
    labels = [arm_label(r.summary) for r in runs]
    names: dict[str, set[str | None]] = {}
    for g, label, run in zip(given, labels, runs):
        if g is None:
            names.setdefault(label, set()).add(_recipe_name(run))
    return [
        g if g is not None else (_recipe_name(run) or label) if len(names[label]) > 1 else label
        for g, label, run in zip(given, labels, runs)
    ]


def group_runs(runs: Sequence[RunRecord]) -> list[Group]:
    """Group runs by arm and setting (order of first appearance) and label groups and runs. Runs compared
    by campaign (``RunRecord.campaign`` set) are arms of their campaign, labelled ``ARM @ CAMPAIGN``."""
    arms = _arms(runs)
    arms = [arm if r.campaign is None else f"{arm} @ {r.campaign}" for arm, r in zip(arms, runs)]
    settings = [_setting(r.summary) for r in runs]
    keys: list[tuple[str, str]] = []
    members: dict[tuple[str, str], list[int]] = {}
    for i, (arm, setting) in enumerate(zip(arms, settings)):
        key = (arm, json.dumps(setting, sort_keys=True))
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(i)
    labels = {key: key[0] for key in keys}
    for arm in {k[0] for k in keys}:
        same = [k for k in keys if k[0] == arm]
        if len(same) < 2:
            continue
        own = [settings[members[k][0]] for k in same]
        differing = sorted(
            {key for s in own for key in s if any(o.get(key) != s.get(key) for o in own)}
        )
        for k, s in zip(same, own):
            shown = ", ".join(
                f"{d}={json.loads(s[d]) if d in s else '<unset>'}" for d in differing[:3]
            )
            labels[k] = f"{arm} ({shown}{', ...' if len(differing) > 3 else ''})"
    if len(set(labels.values())) < len(labels):  # settings that print alike: the first run's path
        labels = {k: f"{labels[k]} [{runs[members[k][0]].path}]" for k in keys}
    groups = []
    for key in keys:
        group = Group(labels[key], [runs[i] for i in members[key]])
        for run in group.runs:
            run.label = group.label
        groups.append(group)
    return groups


def choose_baseline(groups: Sequence[Group], wanted: str | None = None) -> int:
    """Index of the baseline group: the one whose label (or a run's directory) is ``wanted``, else the
    first first-order group, else the first.

    Raises:
        UserError: ``wanted`` matches no group.
    """
    if wanted is not None:
        for i, g in enumerate(groups):
            if wanted == g.label or any(wanted in (str(r.path), r.path.name) for r in g.runs):
                return i
        raise UserError(
            f"--baseline '{wanted}' matches no run; give one of: "
            + ", ".join(f"'{g.label}'" for g in groups)
        )
    return next((i for i, g in enumerate(groups) if g.first_order), 0)


@dataclass
class Spread:
    """Median and range over a group's runs; ``n`` runs, ``k`` of which have a value.

    For times and epochs to target a run that missed the target counts as +inf: the median is None when
    most runs missed, and the max is None when any did.
    """

    median: float | None
    low: float | None
    high: float | None
    k: int
    n: int


def spread(values: Sequence[float | None], missing_is_inf: bool = False) -> Spread:
    given = [float(v) for v in values if v is not None]
    n = len(values)
    pool = given + [math.inf] * (n - len(given)) if missing_is_inf else given
    med = statistics.median(pool) if pool else None
    high = max(pool) if pool else None
    return Spread(
        median=med if med is not None and math.isfinite(med) else None,
        low=min(given) if given else None,
        high=high if high is not None and math.isfinite(high) else None,
        k=len(given),
        n=n,
    )


def _after_target(run: RunRecord) -> float | None:
    """The worst value of the target metric from the evaluation that first met the target on."""
    s = run.summary
    metric, target = s.get("target_metric"), s.get("target_value")
    if metric is None or target is None:
        return None
    higher = s.get("higher_is_better", True) is not False
    values = [
        r["metrics"][metric]
        for r in run.evals
        if isinstance(r["metrics"].get(metric), (int, float))
    ]
    hit = next((i for i, v in enumerate(values) if (v >= target if higher else v <= target)), None)
    if hit is None:
        return None
    rest = values[hit:]
    return min(rest) if higher else max(rest)


def _final(run: RunRecord) -> float | None:
    metric = run.summary.get("target_metric")
    final = run.summary.get("final_metrics") or {}
    if isinstance(final.get(metric), (int, float)):
        return float(final[metric])
    values = [
        r["metrics"][metric]
        for r in run.evals
        if isinstance(r["metrics"].get(metric), (int, float))
    ]
    return values[-1] if values else None


def run_measures(run: RunRecord) -> dict[str, Any]:
    """What the comparison reads of one run (None where not applicable or not known)."""
    s = run.summary
    return {
        "seed": _seed(run),
        "status": s.get("status"),
        "reached": bool(s.get("reached_target")),
        "time_to_target_s": s.get("time_to_target_s"),
        "epochs_to_target": s.get("epochs_to_target"),
        "mean_step_time_s": s.get("mean_step_time_s"),
        "kfac_time_fraction": s.get("kfac_time_fraction"),
        "final_metric": _final(run),
        "min_metric_after_target": _after_target(run),
        "best_metric": s.get("best_metric"),
        "samples_per_s": s.get("samples_per_s"),
        "wall_time_s": _total(run, "wall_time_s", "wall_time_s"),
        "epochs": _total(run, "epochs", "epoch"),
        "kfac_step_share": _kfac_step_share(s),
    }


def _total(run: RunRecord, key: str, record_key: str) -> float | None:
    """The run's total ``key`` (its summary's, else its last evaluation's): what a run that missed the
    target is censored at."""
    value = run.summary.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    last = run.evals[-1].get(record_key) if run.evals else None
    return float(last) if isinstance(last, (int, float)) else None


def _kfac_step_share(s: dict[str, Any]) -> float | None:
    """The K-FAC stages' seconds per step over the run's mean step time: the stages' share of the arm's
    own step time, the denominator the step-time ratio's overhead uses too (None without stage times)."""
    stages, steps, step = s.get("kfac_stage_times_s"), s.get("steps"), s.get("mean_step_time_s")
    if not isinstance(stages, dict) or not stages or not steps or not step:
        return None
    total = sum(float(v) for v in stages.values() if isinstance(v, (int, float)))
    return total / float(steps) / float(step)
