"""How ``kfac-bench tune`` ranks the grid points of one arm: by what the target measures robustly first.

A grid point is a learning rate (and, for K-FAC, a damping) run over seeds. Its points are ranked by

1. **the seeds that reached the target** (more first): a point that misses in a seed is worse than one
   that never does, however fast its other seeds were;
2. **the median epochs to target** over seeds (fewer first; a seed that missed or diverged counts as
   never): epochs are counted, not timed, so the machine's load cannot move them;
3. **the clock, only where it separates**: among the points tied on both, the one with the least median
   time to target wins when the 95 % interval of its time ratio to every other tied point lies below 1
   (:func:`kfac_bench.compare.stats.ratio_interval`, paired by seed; a run that missed is censored, so it
   can never make a point faster). Otherwise the points it does not separate from stay **tied**, and the
   tie goes to the smaller learning rate (then the larger damping): the more conservative values, never a
   difference the clock's noise made.

:func:`rank` returns the points in that order with the winner's reason and the points tied with it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kfac_bench.compare.stats import Obs, ratio_interval

__all__ = ["Point", "Ranking", "censored_time", "points_of", "rank"]


@dataclass
class Point:
    """One grid point of one arm: its runs' outcomes over seeds (``summaries`` in seed order)."""

    arm: str
    lr: float
    damping: float | None
    summaries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seeds(self) -> list[int]:
        return [int(s["config"]["train"]["seed"]) for s in self.summaries]

    @property
    def reached(self) -> int:
        return sum(bool(s.get("reached_target")) for s in self.summaries)

    @property
    def epochs(self) -> list[float]:
        """Epochs to target per seed; inf where the seed missed or diverged."""
        return [
            float(s["epochs_to_target"]) if s.get("reached_target") else math.inf
            for s in self.summaries
        ]

    @property
    def times(self) -> list[float]:
        """Censored time to target per seed (:func:`censored_time`)."""
        return [censored_time(s) for s in self.summaries]

    @property
    def median_epochs(self) -> float:
        return statistics.median(self.epochs) if self.summaries else math.inf

    @property
    def median_time(self) -> float:
        return statistics.median(self.times) if self.summaries else math.inf

    def observations(self) -> list[Obs]:
        """The clock per seed for an interval: a seed that missed is censored at its training time, one
        that diverged is left out (it never reaches: no time to compare)."""
        return [
            Obs(t, not s.get("reached_target"), int(s["config"]["train"]["seed"]))
            for s, t in zip(self.summaries, self.times)
            if math.isfinite(t)
        ]

    def values(self, sections: Sequence[str]) -> dict[str, Any]:
        """The config ``sections`` its runs ran (the first seed's: every seed of a point runs the same)."""
        config = self.summaries[0]["config"] if self.summaries else {}
        return {k: config[k] for k in sections if k in config}


def censored_time(summary: dict[str, Any]) -> float:
    """A run's time to target, censored: reached -> its time to target; missed -> its whole training
    (wall) time, a lower bound; diverged -> inf (never)."""
    if summary.get("reached_target"):
        return float(summary["time_to_target_s"])
    if summary.get("status") == "diverged":
        return math.inf
    return float(summary["wall_time_s"])


def points_of(summaries: Sequence[dict[str, Any]], arm: str) -> list[Point]:
    """``arm``'s run summaries as grid points (order of first appearance), each point's runs by seed."""
    points: dict[tuple[float, float | None], Point] = {}
    for s in summaries:
        config = s["config"]
        lr = float(config["optimizer"]["lr"])
        damping = float(config["kfac"]["damping"]) if s.get("kfac_enabled") else None
        points.setdefault((lr, damping), Point(arm, lr, damping)).summaries.append(s)
    for p in points.values():
        p.summaries.sort(key=lambda s: int(s["config"]["train"]["seed"]))
    return list(points.values())


@dataclass
class Ranking:
    """An arm's points best first; ``tied``: the points the winner could not be told from (itself
    included when there is a tie); ``reason``: why the winner won, in words for tune.md."""

    points: list[Point]
    tied: list[Point]
    reason: str

    @property
    def best(self) -> Point | None:
        return self.points[0] if self.points else None

    @property
    def reached(self) -> bool:
        """Whether any point reached the target in any seed (else the arm has no tuned values)."""
        return any(p.reached for p in self.points)


def _count_key(p: Point) -> tuple[int, float]:
    return (-p.reached, p.median_epochs)


def _conservative(p: Point) -> tuple[float, float]:
    return (p.lr, -(p.damping or 0.0))


def rank(points: Sequence[Point]) -> Ranking:
    """``points`` best first (module docstring), with the winner's tie and reason."""
    if not points:
        return Ranking([], [], "no run")
    by_count = sorted(points, key=lambda p: (_count_key(p), p.median_time, _conservative(p)))
    top = [p for p in by_count if _count_key(p) == _count_key(by_count[0])]
    rest = by_count[len(top) :]
    if not by_count[0].reached:
        return Ranking(by_count, [], "no point reached the target")
    what = f"{by_count[0].reached}/{len(by_count[0].summaries)} seeds reached the target"
    what += f", median {by_count[0].median_epochs:g} epochs"
    if len(top) == 1:
        return Ranking(by_count, [], f"{what}: the fewest epochs of the grid")
    fastest = min(top, key=lambda p: (p.median_time, _conservative(p)))
    others = [p for p in top if p is not fastest]
    apart = [
        p
        for p in others
        if (iv := ratio_interval(fastest.observations(), p.observations())).high is not None
        and iv.high < 1
    ]
    if len(apart) == len(others):
        ordered = [fastest, *sorted(others, key=lambda p: p.median_time)]
        reason = (
            f"{what}, like {len(others)} other point(s); its time to target is below theirs with 95 % "
            "confidence (paired by seed)"
        )
        return Ranking(ordered + rest, [], reason)
    tied = sorted([fastest, *(p for p in others if p not in apart)], key=_conservative)
    ordered = tied + sorted(apart, key=lambda p: p.median_time)
    reason = (
        f"{what}, tied with {len(tied) - 1} other point(s) that the clock does not separate (95 % "
        "interval of the time ratio holds 1): the tie goes to the smaller LR (then the larger damping)"
    )
    return Ranking(ordered + rest, tied, reason)
