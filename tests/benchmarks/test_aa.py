"""benchmarks/aa.py's arithmetic and its load shift (the campaigns themselves are the benchmark's run)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.aa import LoadShift, clopper_pearson
from tests.limits import hang_limit


def test_the_false_claim_rate_interval_is_clopper_pearsons() -> None:
    low, high = clopper_pearson(0, 20)
    assert low == 0.0 and high == pytest.approx(0.1684, abs=1e-4)
    low, high = clopper_pearson(1, 20)
    assert low == pytest.approx(0.00127, abs=1e-4) and high == pytest.approx(0.2487, abs=1e-4)
    assert clopper_pearson(20, 20)[1] == 1.0


def test_the_load_starts_at_half_the_runs_and_stops_with_the_campaign(tmp_path: Path) -> None:
    with LoadShift(tmp_path, half=2) as shift:
        (tmp_path / "0").mkdir()
        (tmp_path / "0" / "summary.json").write_text("{}")
        time.sleep(0.5)
        assert shift.burners == []  # one of two runs done: no load yet
        (tmp_path / "1").mkdir()
        (tmp_path / "1" / "summary.json").write_text("{}")
        deadline = time.monotonic() + hang_limit(10)
        while not shift.burners and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shift.burners and all(p.poll() is None for p in shift.burners)
    assert all(p.poll() is not None for p in shift.burners)
