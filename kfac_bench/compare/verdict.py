"""Which arm won, and by how much, in one line computed from the runs (``kfac-bench compare``).

Each arm is a :class:`~kfac_bench.compare.arms.Group` of runs (seeds). The line states, for an arm against
the baseline: how many seeds reached the target and the median epochs and time they took; then the time
to target and the epochs to target as ratios over the baseline's, each with its 95 % confidence interval
(:mod:`kfac_bench.compare.stats`: paired by seed, runs that missed the target censored, never dropped),
and the claim the interval supports: faster only when the whole interval is below 1, slower only when it
is above 1, otherwise no clear difference, with how many seeds per arm the observed spread needs to detect a
ratio of 0.9 with 80 % power (a design figure for the next campaign, :mod:`kfac_bench.compare.stats`). The
method is named. Beside it, MLPerf's score where both arms have at least 5 runs; arms that fall back below
the target after reaching it, and fairness flags (:mod:`kfac_bench.compare.fairness`), are named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kfac_bench.compare.arms import Group, Spread, run_measures, spread
from kfac_bench.compare.stats import (
    MLPERF_MIN_RUNS,
    POWER,
    POWER_RATIO,
    Interval,
    Obs,
    mlperf_score,
    ratio_interval,
)

__all__ = [
    "CLAIMS",
    "Stats",
    "claim_of",
    "claim_text",
    "group_stats",
    "interval_text",
    "power_text",
    "ratio_intervals",
    "step_ratio",
    "verdict",
]

#: Measures where a run that missed the target counts as +inf in the median.
_TO_TARGET = ("time_to_target_s", "epochs_to_target")
#: Each to-target measure and the run's total it is censored at when the run missed.
_CENSOR_AT = {"time_to_target_s": "wall_time_s", "epochs_to_target": "epochs"}


@dataclass
class Stats:
    """A group's per-run measures (:func:`kfac_bench.compare.arms.run_measures`) and its label."""

    label: str
    first_order: bool
    measures: list[dict[str, Any]]

    def spread(self, key: str) -> Spread:
        return spread([m[key] for m in self.measures], missing_is_inf=key in _TO_TARGET)

    @property
    def reached(self) -> int:
        return sum(m["reached"] for m in self.measures)

    @property
    def n(self) -> int:
        return len(self.measures)

    def observations(self, key: str) -> list[Obs]:
        """One :class:`Obs` per run of a to-target measure: the value where the run reached the target,
        else censored at the run's total (its training time or epochs); a run with neither is left out."""
        out = []
        for m in self.measures:
            value = m[key] if m["reached"] else m[_CENSOR_AT[key]]
            if isinstance(value, (int, float)) and math.isfinite(value):
                out.append(Obs(float(value), not m["reached"], m["seed"]))
        return out

    def mlperf(self) -> float | None:
        """MLPerf's score of the time to target (:func:`kfac_bench.compare.stats.mlperf_score`)."""
        return mlperf_score(self.observations("time_to_target_s"))

    def fell_back(self, target: float, higher: bool) -> int:
        """Runs whose target metric went back past the target after first reaching it."""
        after = [m["min_metric_after_target"] for m in self.measures]
        return sum(a is not None and (a < target if higher else a > target) for a in after)


def group_stats(group: Group) -> Stats:
    return Stats(group.label, group.first_order, [run_measures(r) for r in group.runs])


def ratio_intervals(arm: Stats, base: Stats) -> dict[str, Interval]:
    """``time`` and ``epochs``: the arm's time (epochs) to target over the baseline's, with the 95 %
    interval (:func:`kfac_bench.compare.stats.ratio_interval`)."""
    return {
        name: ratio_interval(arm.observations(key), base.observations(key))
        for name, key in (("time", "time_to_target_s"), ("epochs", "epochs_to_target"))
    }


def step_ratio(arm: Stats, base: Stats) -> Spread:
    """The arm's mean step time over the baseline's, seed by seed where both have the seed, else the
    ratio of the medians (the K-FAC overhead when the baseline is the first-order arm)."""
    base_by_seed = {
        m["seed"]: m["mean_step_time_s"] for m in base.measures if m["seed"] is not None
    }
    ratios = [
        m["mean_step_time_s"] / base_by_seed[m["seed"]]
        for m in arm.measures
        if m["mean_step_time_s"] and base_by_seed.get(m["seed"])
    ]
    if not ratios:
        a, b = arm.spread("mean_step_time_s").median, base.spread("mean_step_time_s").median
        ratios = [a / b] if a and b else []
    return spread(ratios) if ratios else Spread(None, None, None, 0, arm.n)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _end(x: float) -> str:
    return "inf" if math.isinf(x) else "0" if x == 0 else f"{x:.2f}"


def interval_text(iv: Interval) -> str:
    """``0.53 [0.50-0.56]``: the ratio and its 95 % interval (``0``/``inf``: open on that side)."""
    if iv.ratio is None or iv.low is None or iv.high is None:
        return "-"
    return f"{iv.ratio:.2f} [{_end(iv.low)}-{_end(iv.high)}]"


#: The machine-readable claims of an interval (compare.csv's ``claim`` and ``epochs_claim`` columns):
#: the whole interval below 1, above 1, or neither.
CLAIMS = {"time": ("faster", "slower", "none"), "epochs": ("fewer", "more", "none")}


def claim_of(iv: Interval | None, what: str = "time") -> str:
    """``faster``/``slower``/``none`` (``what="epochs"``: ``fewer``/``more``/``none``): what the interval
    supports, the word compare.csv gives for it (the baseline's row, ``iv`` None, is ``none``)."""
    less, more, none = CLAIMS[what]
    if iv is None or iv.claim == 0:
        return none
    return less if iv.claim < 0 else more


def power_text(iv: Interval) -> str | None:
    """``to detect a ratio of 0.9 with 80 % power: about N seeds per arm, from the observed spread: ...``,
    or None where the runs give no spread to base it on (:attr:`Interval.seeds_for_power`)."""
    if iv.spread is None:
        return None
    head = f"to detect a ratio of {POWER_RATIO:g} with {100 * POWER:.0f} % power"
    spread = f"from the observed spread: sd of log ratios {iv.spread:.3f}"
    if iv.seeds_for_power is None:
        return f"{head}: more than 1000 seeds per arm, {spread}"
    return f"{head}: about {iv.seeds_for_power} seeds per arm, {spread}"


def claim_text(iv: Interval, what: str, less: str, more: str) -> str:
    """What the interval supports: ``less`` (all below 1), ``more`` (all above 1), or no clear difference
    with the reason it stays open (runs that missed, too few seeds) and the seeds a ratio of 0.9 would
    need at the observed spread (:func:`power_text`)."""
    if iv.claim < 0:
        return less
    if iv.claim > 0:
        return more
    text = f"no clear difference {what}"
    if iv.ratio is None:
        return text + " (no run to compare)"
    power = power_text(iv)
    if power is not None:
        return text + f" ({power})"
    if iv.censored:
        return text + f" (open while runs miss the target: {iv.censored} censored)"
    if iv.low == 0.0 and math.isinf(iv.high or 0.0):
        return text + " (too few seeds for an interval)"
    return text


def _reach(s: Stats, first: bool) -> str:
    e, t = s.spread("epochs_to_target"), s.spread("time_to_target_s")
    text = f"in {s.reached}/{s.n}" + (" seeds" if first else "")
    if e.median is not None:
        unit = " epochs (median " if first else " ("
        text += f" in {e.median:g}{unit}{_secs(t.median)} s)"
    return text


def verdict(
    a: Stats,
    b: Stats,
    metric: str,
    target: float,
    higher: bool = True,
    flags: list[str] | None = None,
    blocked: str | None = None,
) -> str:
    """One line: arm ``a`` against the baseline ``b`` on reaching ``metric`` ``target``; ``flags`` (the
    fairness flags of both arms) end it. ``blocked``: why the arms' times cannot be compared (they ran in
    separate blocks of time, :mod:`kfac_bench.compare.schedule`): the clock then makes no claim."""
    an = "K-FAC" if b.first_order and not a.first_order and " + K-FAC" in a.label else a.label
    bn = b.label
    op = ">=" if higher else "<="
    head = f"{a.label} reached {metric} {op} {target:g} {_reach(a, True)}, {bn} {_reach(b, False)}"
    ivs = ratio_intervals(a, b)
    time, epochs = ivs["time"], ivs["epochs"]
    clock = (
        f"no claim on the clock: {blocked}"
        if blocked
        else claim_text(
            time, "on the clock", f"{an} faster on the clock", f"{an} slower on the clock"
        )
    )
    count = claim_text(epochs, "in epochs", f"{an} needs fewer epochs", f"{an} needs more epochs")
    line = (
        f"{head}: time to target {interval_text(time)}x {bn}'s: {clock}; "
        f"epochs to target {interval_text(epochs)}x: {count}"
    )
    methods = dict.fromkeys(iv.method for iv in (time, epochs))
    line += f" (95 % CI: {'; '.join(methods)}"
    censored = [f"{name}: {s.n - s.reached}" for name, s in ((an, a), (bn, b)) if s.reached < s.n]
    if censored:
        line += "; runs that missed the target censored at their training time, " + ", ".join(
            censored
        )
    line += ")"
    if min(a.n, b.n) >= MLPERF_MIN_RUNS:
        sa, sb = (
            _secs(x) + " s" if x is not None else "not reached" for x in (a.mlperf(), b.mlperf())
        )
        line += (
            f"; MLPerf score (mean time to target without the fastest and slowest run) {sa} vs {sb}"
        )
    for name, s in ((an, a), (bn, b)):
        fell = s.fell_back(target, higher)
        if fell:
            line += (
                f"; {name} fell back below the target after reaching it in {fell}/{s.reached} seeds"
            )
    if flags:
        line += "; fairness: " + "; ".join(flags)
    return line
