"""compare makes no claim about arms that ran in separate blocks of time (load drift would read as a
difference), and claims as before for arms that interleave or ran at once."""

from __future__ import annotations

from kfac_bench.compare.schedule import blocked_in_time, span


def _runs(*spans: tuple[float, float]) -> list[dict[str, float]]:
    return [{"started_at": s, "ended_at": e} for s, e in spans]


def test_arms_in_two_blocks_are_named_either_way_round() -> None:
    a = _runs((0, 10), (10, 20), (20, 30))
    b = _runs((30, 40), (40, 50), (50, 60))
    line = blocked_in_time(a, b, "K-FAC", "SGD")
    assert line is not None and "every K-FAC run before any SGD run" in line and "no claim" in line
    line = blocked_in_time(b, a, "K-FAC", "SGD")
    assert line is not None and "every SGD run before any K-FAC run" in line


def test_interleaved_or_simultaneous_arms_pass() -> None:
    # A seed's arms back to back, the first arm alternating (kfac-bench train -m).
    a = _runs((0, 10), (30, 40), (40, 50))
    b = _runs((10, 20), (20, 30), (50, 60))
    assert blocked_in_time(a, b, "K-FAC", "SGD") is None
    # At the same time (kfac-bench demo).
    same = _runs((0, 10), (10, 20))
    assert blocked_in_time(same, same, "K-FAC", "SGD") is None


def test_unknown_times_or_single_runs_say_nothing() -> None:
    assert blocked_in_time(_runs((0, 1)), _runs((5, 6)), "a", "b") is None  # one run each
    old = [{"time_to_target_s": 3.0}, {"time_to_target_s": 4.0}]  # a summary without the times
    assert blocked_in_time(old, _runs((5, 6), (6, 7)), "a", "b") is None


def test_a_span_must_be_two_ordered_numbers() -> None:
    assert span({"started_at": 1.0, "ended_at": 2.0}) == (1.0, 2.0)
    assert span({"started_at": 2.0, "ended_at": 1.0}) is None
    assert span({"started_at": True, "ended_at": 2.0}) is None
    assert span({"started_at": "1", "ended_at": 2.0}) is None
