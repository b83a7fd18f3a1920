"""WHEN: hyperparameters as functions of the preconditioner's step count.

Every scheduled hyperparameter of :class:`~kfac_bench.kfac.KFACPreconditioner` is either a constant or a
``Callable[[int], value]`` taking the number of completed ``step()`` calls. Epoch-based schedules (damping
decay, interval decay) are built by the harness as plain functions of the epoch, wrapped as such
callables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, Union

T = TypeVar("T", int, float)
Scheduled = Union[T, Callable[[int], T]]  # noqa: UP007 (a generic alias needs Union)


def resolve(value: Scheduled[T], step: int) -> T:
    """The value of a constant-or-callable hyperparameter at ``step``."""
    return value(step) if callable(value) else value


def is_due(interval: Scheduled[int], step: int) -> bool:
    """Whether an update with the given (possibly scheduled) interval runs at ``step``.

    Raises:
        ValueError: if the interval resolves to a value below 1.
    """
    n = int(resolve(interval, step))
    if n < 1:
        raise ValueError(f"update interval must be >= 1, got {n} at step {step}")
    return step % n == 0


def step_decay(base: float, milestones: Sequence[int], factor: float) -> Callable[[int], float]:
    """``base * factor**k`` where k is the number of milestones <= the argument (e.g. the epoch).

    A plain function of its argument: calling it twice with the same value gives the same result, unlike
    the reference scheduler, which compounds its factor on every call after a milestone.
    """
    points = sorted(milestones)

    def value(t: int) -> float:
        return base * factor ** sum(1 for m in points if t >= m)

    return value
