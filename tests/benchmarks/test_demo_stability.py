"""``benchmarks/demo_stability.py`` reads the clock claim from compare.csv's ``claim`` column (no demo is
run here: the comparison is of hand-made runs)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.demo_stability import claim_of, verdict_of
from kfac_bench.compare.report import find_runs, write_outputs
from tests.compare.test_arms import arms


def test_the_claim_is_compare_csvs_claim_column(tmp_path: Path) -> None:
    faster = arms(tmp_path / "f", [(9, 0.1), (9, 0.11), (8, 0.1)], [(3, 0.1)] * 3)
    write_outputs(find_runs(faster), tmp_path / "f_out")
    assert claim_of(tmp_path / "f_out" / "compare.csv") == "faster"
    slower = arms(tmp_path / "s", [(3, 0.1)] * 3, [(9, 0.1), (9, 0.11), (8, 0.1)])
    write_outputs(find_runs(slower), tmp_path / "s_out")
    assert claim_of(tmp_path / "s_out" / "compare.csv") == "slower"
    same = arms(tmp_path / "n", [(5, 0.1), (5, 0.12)], [(5, 0.11), (5, 0.1)])
    write_outputs(find_runs(same), tmp_path / "n_out")
    assert claim_of(tmp_path / "n_out" / "compare.csv") == "none"
    assert claim_of(tmp_path / "missing.csv") == "?"


def test_the_verdict_is_the_demos_last_verdict_line() -> None:
    out = (
        "kfac-bench demo: ...\nverdict: first\nverdict: SGD + K-FAC ... faster\nwrote compare.md\n"
    )
    assert verdict_of(out) == "verdict: SGD + K-FAC ... faster" and verdict_of("no verdict") == ""
