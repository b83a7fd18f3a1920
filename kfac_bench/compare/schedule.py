"""When the arms of a comparison ran: a claim is only as good as the design of the experiment behind it.

Every run records the wall-clock time it started and ended training (``summary.json``: ``started_at``,
``ended_at``, Unix seconds). Two arms whose runs ran in separate blocks of time (every run of one ended
before any run of the other started) cannot be told apart from a change in the machine's load between the
blocks: an A/A test (one recipe as two arms, run arm after arm) claims "faster" under such a change. The
comparison then says so and makes no claim. Arms run interleaved (``kfac-bench train -m`` runs a seed's arms
back to back) or at the same time (``kfac-bench demo``) share every stretch of time, and pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["blocked_in_time", "schedule_of", "span"]


def span(summary: dict[str, Any]) -> tuple[float, float] | None:
    """(started_at, ended_at) of a run's summary, or None when it does not record both."""
    start, end = summary.get("started_at"), summary.get("ended_at")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return None
    if isinstance(start, bool) or isinstance(end, bool) or end < start:
        return None
    return float(start), float(end)


def blocked_in_time(
    arm: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], label: str, base_label: str
) -> str | None:
    """One line when the runs of ``arm`` and of ``baseline`` (their summaries) ran in two separate blocks of
    time, each with at least two runs; None when they interleave or overlap, or when a run does not record
    its times (then nothing can be said about the schedule)."""
    a = [span(s) for s in arm]
    b = [span(s) for s in baseline]
    if len(a) < 2 or len(b) < 2 or None in a or None in b:
        return None
    spans_a = [s for s in a if s is not None]
    spans_b = [s for s in b if s is not None]
    first, then = None, None
    if max(e for _, e in spans_a) <= min(s for s, _ in spans_b):
        first, then = label, base_label
    elif max(e for _, e in spans_b) <= min(s for s, _ in spans_a):
        first, then = base_label, label
    if first is None:
        return None
    return (
        f"the arms ran in separate blocks of time (every {first} run before any {then} run), so a change "
        "of machine load between the blocks would read as a difference: no claim; run a seed's arms "
        "back to back (kfac-bench train -m interleaves them) or at the same time"
    )


def schedule_of(arm: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> str:
    """``interleaved`` when both arms record their times and share stretches of time, else ``unknown``
    (:func:`blocked_in_time` names the third case, ``blocked``)."""
    known = all(span(s) is not None for s in [*arm, *baseline])
    return "interleaved" if known and len(arm) and len(baseline) else "unknown"
