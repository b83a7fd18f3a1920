"""Time-to-accuracy bookkeeping: the run's clocks, its targets, throughput and K-FAC stage times.

Everything accumulates over restarts: a checkpoint stores ``train_time_s`` (optimizer steps only) and
``wall_time_s`` (steps + evaluations + checkpoints), the throughput sums and the stage seconds, and a resumed
run continues from them, so the time-to-target of a preempted run counts only the time spent working on it.
:class:`TargetTracker` is the run's one stop test: a run reaches its target when every target is met.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Clock", "StageTotals", "StepTimer", "TargetTracker", "Throughput", "percentile"]


class Clock:
    """An accumulating stopwatch (``elapsed`` includes the offset restored from a checkpoint)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self._start: float | None = None

    def start(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self.offset += time.perf_counter() - self._start
            self._start = None

    @property
    def elapsed(self) -> float:
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.offset + running


@dataclass
class TargetTracker:
    """First evaluation at which every target is met, and the best value of the primary metric.

    Attributes:
        targets: metric name -> target value.
        primary: the metric named first in summaries (the task's ``target_metric``).
        higher_is_better: direction of all target metrics.
    """

    targets: dict[str, float]
    primary: str
    higher_is_better: bool = True
    reached: dict[str, Any] | None = None
    best: float | None = None
    best_record: dict[str, Any] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)

    def met(self, metrics: dict[str, float]) -> bool:
        if not self.targets:
            return False
        for name, target in self.targets.items():
            value = metrics.get(name)
            if value is None or not math.isfinite(value):
                return False
            if (value < target) if self.higher_is_better else (value > target):
                return False
        return True

    def update(self, record: dict[str, Any]) -> bool:
        """Account for one evaluation ``record`` (with ``metrics``, step, epoch, times); True if the
        targets are met for the first time."""
        self.last = record
        value = record["metrics"].get(self.primary)
        if value is not None and math.isfinite(value):
            better = self.best is None or (
                value > self.best if self.higher_is_better else value < self.best
            )
            if better:
                self.best, self.best_record = value, record
        if self.reached is None and self.met(record["metrics"]):
            self.reached = record
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reached, self.best = state_dict["reached"], state_dict["best"]
        self.best_record, self.last = state_dict["best_record"], state_dict["last"]


@dataclass
class Throughput:
    """Step times and samples over the optimizer steps of this run (all restarts)."""

    steps: int = 0
    samples: int = 0
    step_time_s: float = 0.0

    def add(self, seconds: float, samples: int) -> None:
        self.steps += 1
        self.samples += samples
        self.step_time_s += seconds

    @property
    def mean_step_time_s(self) -> float | None:
        return self.step_time_s / self.steps if self.steps else None

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.step_time_s if self.step_time_s > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps, self.samples = state_dict["steps"], state_dict["samples"]
        self.step_time_s = state_dict["step_time_s"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the closest ranks (NumPy's
    default method)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class StepTimer:
    """``train.mode=benchmark``'s measurement: the wall time from the end of one optimizer step to the end of
    the next (so data loading and the start of each epoch count), for every step after ``warmup`` untimed
    ones. Not checkpointed: a benchmark is one process's measurement."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps = 0
        self.samples = 0
        self.times: list[float] = []
        self._last: float | None = None

    def start(self) -> None:
        """The clock of the first step starts now (the loop starts)."""
        self._last = time.perf_counter()

    def tick(self, samples: int) -> None:
        """One optimizer step of ``samples`` examples (over all ranks) ended now."""
        now = time.perf_counter()
        self.steps += 1
        if self.steps > self.warmup and self._last is not None:
            self.times.append(now - self._last)
            self.samples += samples
        self._last = now

    def summary(self) -> dict[str, Any]:
        """Warm-up and timed steps, samples/s over the timed steps, and their step time's mean and
        p50/p90/p99 in seconds (None without a timed step)."""
        total = sum(self.times)
        return {
            "warmup_steps": min(self.steps, self.warmup),
            "timed_steps": len(self.times),
            "samples": self.samples,
            "samples_per_s": self.samples / total if total > 0 else None,
            "step_time_s": {
                "mean": total / len(self.times),
                **{f"p{q}": percentile(self.times, q) for q in (50, 90, 99)},
            }
            if self.times
            else None,
        }


class StageTotals:
    """Seconds per K-FAC stage over the whole run: what earlier processes of the run measured (restored from
    the checkpoint) plus what ``precond.stage_times()`` measured in this one.

    Args:
        precond: the preconditioner, or None (a first-order run has no stages).
    """

    def __init__(self, precond: Any | None) -> None:
        self.precond = precond
        self.offset: dict[str, float] = {}

    def totals(self) -> dict[str, float]:
        """Stage name -> seconds, sorted by name."""
        stage_times = getattr(self.precond, "stage_times", None)
        current = stage_times() if stage_times is not None else {}
        keys = set(self.offset) | set(current)
        return {k: self.offset.get(k, 0.0) + float(current.get(k, 0.0)) for k in sorted(keys)}

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.totals()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.offset = dict(state_dict["seconds"])
