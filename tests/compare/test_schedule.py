"""compare makes no claim about arms that ran in separate blocks of time (load drift would read as a
difference), and claims as before for arms that interleave or ran at once."""

from __future__ import annotations

import json
from pathlib import Path

from kfac_bench.compare.report import Comparison, find_runs
from kfac_bench.compare.schedule import blocked_in_time, span
from tests.compare.test_arms import curve, make_run


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


def _campaign(tmp_path: Path, spans: dict[str, list[tuple[float, float]]]) -> Comparison:
    """SGD (baseline) and K-FAC, four seeds each, K-FAC clearly faster on the clock (0.5 vs 1 s per
    epoch); each run's span as given."""
    paths = []
    for arm, arm_spans in spans.items():
        for seed, (start, end) in enumerate(arm_spans):
            path = make_run(
                tmp_path / f"{arm}{seed}",
                seed=seed,
                curve=curve(3),
                epoch_s=0.5 if arm == "kfac" else 1.0 + 0.01 * seed,
                step_s=0.02,
                kfac="comm_opt" if arm == "kfac" else None,
            )
            summary = json.loads((path / "summary.json").read_text())
            summary.update(started_at=start, ended_at=end)
            (path / "summary.json").write_text(json.dumps(summary))
            paths.append(path)
    return Comparison(find_runs(paths, on_warning=lambda _: None))


def test_a_blocked_campaign_makes_no_clock_claim_and_says_why(tmp_path: Path) -> None:
    blocked = _campaign(
        tmp_path / "blocked",
        {"sgd": [(0, 1), (1, 2), (2, 3), (3, 4)], "kfac": [(5, 6), (6, 7), (7, 8), (8, 9)]},
    )
    interleaved = _campaign(
        tmp_path / "interleaved",
        {"sgd": [(0, 1), (3, 4), (4, 5), (7, 8)], "kfac": [(1, 2), (2, 3), (5, 6), (6, 7)]},
    )
    rows = {"blocked": blocked.rows()[1], "interleaved": interleaved.rows()[1]}
    # The same runs' numbers: faster where the design separates the arms from drift, no claim where not.
    assert (
        rows["interleaved"]["claim"] == "faster"
        and rows["interleaved"]["schedule"] == "interleaved"
    )
    assert rows["blocked"]["claim"] == "none" and rows["blocked"]["schedule"] == "blocked"
    assert (
        rows["blocked"]["epochs_claim"] == rows["interleaved"]["epochs_claim"]
    )  # epochs: no clock
    (line,) = blocked.verdicts()
    assert "no claim on the clock" in line and "separate blocks of time" in line
    (line,) = interleaved.verdicts()
    assert "faster on the clock" in line
