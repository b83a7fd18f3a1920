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

:func:`rank` returns the points in that order with the winner's reason and the points tied with it;
:func:`table` and :func:`plot_png` show them (tune.md/.csv, tune.png).
"""

from __future__ import annotations

import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kfac_bench.compare.stats import Obs, ratio_interval

__all__ = [
    "Point",
    "Ranking",
    "censored_time",
    "plot_png",
    "points_of",
    "rank",
    "spread_text",
    "table",
]


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


def spread_text(values: Sequence[float]) -> str:
    """``median [min-max]`` of ``values`` (3 significant digits; inf reads "never")."""

    def num(v: float) -> str:
        return "never" if math.isinf(v) else f"{v:.3g}"

    if not values or all(math.isinf(v) for v in values):
        return "never"
    text, low, high = num(statistics.median(values)), num(min(values)), num(max(values))
    return text if low == high else f"{text} [{low}-{high}]"


def table(rankings: dict[str, Ranking], budget: str) -> tuple[str, list[list[Any]]]:
    head = [
        "arm",
        "lr",
        "damping",
        "seeds",
        "reached",
        "epochs to target",
        "time to target (s)",
        "rank",
    ]
    rows = []
    for arm, ranking in rankings.items():
        for i, p in enumerate(ranking.points, 1):
            mark = "best" if p is ranking.best and ranking.reached else ""
            if p in ranking.tied and p is not ranking.best:
                mark = "tied with best"
            rows.append(
                [
                    arm,
                    f"{p.lr:g}",
                    "" if p.damping is None else f"{p.damping:g}",
                    " ".join(str(s) for s in p.seeds),
                    f"{p.reached}/{len(p.summaries)}",
                    spread_text(p.epochs),
                    spread_text(p.times),
                    f"{i}" + (f" ({mark})" if mark else ""),
                ]
            )
    lines = [
        f"Budget: {budget}. Ranked by seeds reaching the target, then median epochs to target (counted, so "
        "the machine's load cannot move it); the clock breaks a tie only where the 95 % interval of the "
        "time ratio (paired by seed) separates two points, else they are tied and the smaller LR (then "
        "the larger damping) is chosen. Cells: median [min-max] over seeds; a seed that missed or "
        "diverged counts as never for epochs; for time, a missed seed counts its whole training time (a "
        "lower bound) and a diverged one never.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        *(f"- {arm}: {r.reason}" for arm, r in rankings.items()),
    ]
    return "\n".join(lines) + "\n", [head, *rows]


def plot_png(points: list[Point]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple[str, float | None], list[Point]] = {}
    for p in points:
        lines.setdefault((p.arm, p.damping), []).append(p)
    for (arm, damping), pts in sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        pts.sort(key=lambda p: p.lr)
        label = arm if damping is None else f"{arm}, damping {damping:g}"
        finite = [p for p in pts if math.isfinite(p.median_epochs)]
        (line,) = ax.plot(
            [p.lr for p in finite], [p.median_epochs for p in finite], marker="o", label=label
        )
        missed = [p for p in finite if p.reached < len(p.summaries)]
        ax.plot(
            [p.lr for p in missed],
            [p.median_epochs for p in missed],
            "x",
            color=line.get_color(),
            ms=10,
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("median epochs to target")
    ax.set_title(
        "tune: x = some seeds missed the target; points that never reached: not drawn", fontsize=9
    )
    if lines:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()
