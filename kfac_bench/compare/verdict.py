"""Which arm won, and by how much, in one line computed from the runs (``kfac-bench compare``).

Each arm is a :class:`~kfac_bench.compare.arms.Group` of runs (seeds). The line states, for an arm against
the baseline: how many seeds reached the target and the median epochs and time they took; the epoch
ratio; and the clock, judged by the time ratio (:func:`time_ratios`: the arm's time to target over the
baseline's, seed by seed on the seeds where *both* reached the target; the table's "time to target /
baseline's" row is the same ratios). A median time alone would let an arm "win" only because the other
missed in some seeds; the line says so when that is the case. A ratio within :data:`TIE` of 1 in some seed
makes the clock a tie. Arms that fall back
below the target after reaching it are named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kfac_bench.compare.arms import Group, Spread, run_measures, spread

__all__ = ["TIE", "Stats", "group_stats", "step_ratio", "time_ratio", "time_ratios", "verdict"]

#: One arm is faster on the clock only if it took less than 1/TIE of the other's time in every seed both
#: reached the target; otherwise (some seed within 10 %, or seeds disagreeing) the clock is a tie.
TIE = 1.10
#: Epoch medians within 5 % count as "as many epochs".
_SAME_EPOCHS = 1.05
#: Measures where a run that missed the target counts as +inf in the median.
_TO_TARGET = ("time_to_target_s", "epochs_to_target")


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

    def fell_back(self, target: float, higher: bool) -> int:
        """Runs whose target metric went back past the target after first reaching it."""
        after = [m["min_metric_after_target"] for m in self.measures]
        return sum(a is not None and (a < target if higher else a > target) for a in after)


def group_stats(group: Group) -> Stats:
    return Stats(group.label, group.first_order, [run_measures(r) for r in group.runs])


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


def time_ratios(arm: Stats, base: Stats) -> list[tuple[int | None, float]]:
    """(seed, the arm's time to target / the baseline's) for every seed both reached the target."""
    base_time = {m["seed"]: m["time_to_target_s"] for m in base.measures if m["time_to_target_s"]}
    return [
        (m["seed"], m["time_to_target_s"] / base_time[m["seed"]])
        for m in arm.measures
        if m["time_to_target_s"] and m["seed"] in base_time
    ]


def time_ratio(arm: Stats, base: Stats) -> Spread:
    """Median and range of :func:`time_ratios` (< 1: the arm took less time than the baseline); ``k`` is
    the number of seeds both reached, ``n`` the arm's runs."""
    ratios = [r for _, r in time_ratios(arm, base)]
    if not ratios:
        return Spread(None, None, None, 0, arm.n)
    s = spread(ratios)
    return Spread(s.median, s.low, s.high, len(ratios), arm.n)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _range(lo: float, hi: float, digits: int) -> str:
    a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return a if a == b else f"{a}-{b}"


def _reach(s: Stats, first: bool) -> str:
    e, t = s.spread("epochs_to_target"), s.spread("time_to_target_s")
    text = f"in {s.reached}/{s.n}" + (" seeds" if first else "")
    if e.median is not None:
        unit = " epochs (median " if first else " ("
        text += f" in {e.median:g}{unit}{_secs(t.median)} s)"
    return text


def _epochs(a: Stats, b: Stats, an: str, bn: str) -> str:
    ea, eb = a.spread("epochs_to_target").median, b.spread("epochs_to_target").median
    if ea is not None and eb is not None:
        r = eb / ea
        if r >= _SAME_EPOCHS:
            return f"{r:.1f}x fewer epochs"
        if r <= 1 / _SAME_EPOCHS:
            return f"{1 / r:.1f}x more epochs"
        return "as many epochs"
    if ea is not None:
        return _missed(bn, b)
    if eb is not None:
        return _missed(an, a)
    return "neither reached the target in most seeds"


def _clock(a: Stats, b: Stats, an: str, bn: str) -> tuple[str, int]:
    """The clock on the seeds both reached, and who won it there (1: a, -1: b, 0: tie or no race)."""
    pairs = time_ratios(a, b)
    if not pairs:
        return "no seed where both reached the target, so no race on the clock", 0
    q = [r for _, r in pairs]
    seeds = ", ".join(str(s) for s, _ in pairs)
    where = f"seed{'s' if len(pairs) > 1 else ''} {seeds}"
    if max(q) <= 1 / TIE:
        return (
            f"on the clock {an} was faster in every seed both reached "
            f"({an} took {_range(min(q), max(q), 2)}x {bn}'s time, {where})",
            1,
        )
    if min(q) >= TIE:
        return (
            f"on the clock {bn} was faster in every seed both reached "
            f"({an} took {_range(min(q), max(q), 2)}x {bn}'s time, {where})",
            -1,
        )
    took = _range(min(q), max(q), 2)
    return f"on the clock a tie where both reached ({an} took {took}x {bn}'s time, {where})", 0


def _missed(name: str, s: Stats) -> str:
    return f"{name} missed the target in {s.n - s.reached}/{s.n} seeds"


def verdict(a: Stats, b: Stats, metric: str, target: float, higher: bool = True) -> str:
    """One line: arm ``a`` against the baseline ``b`` on reaching ``metric`` ``target``."""
    an = "K-FAC" if b.first_order and not a.first_order and " + K-FAC" in a.label else a.label
    bn = b.label
    op = ">=" if higher else "<="
    head = f"{a.label} reached {metric} {op} {target:g} {_reach(a, True)}, {bn} {_reach(b, False)}"
    clock, won = _clock(a, b, an, bn)
    line = f"{head}: {_epochs(a, b, an, bn)}; {clock}"
    ta, tb = a.spread("time_to_target_s").median, b.spread("time_to_target_s").median
    if ta is not None and (tb is None or ta < tb) and won != 1 and b.reached < b.n:
        line += f"; {an}'s median time is lower only because {_missed(bn, b)}"
    if tb is not None and (ta is None or tb < ta) and won != -1 and a.reached < a.n:
        line += f"; {bn}'s median time is lower only because {_missed(an, a)}"
    for name, s in ((an, a), (bn, b)):
        fell = s.fell_back(target, higher)
        if fell:
            line += (
                f"; {name} fell back below the target after reaching it in {fell}/{s.reached} seeds"
            )
    return line
