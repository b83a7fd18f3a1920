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

__all__ = ["Clock", "StageTimes", "TargetTracker", "Throughput"]


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


class StageTimes:
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
