"""``benchmarks/demo_stability.py`` reads the clock claim out of a verdict line (no demo is run here)."""

from __future__ import annotations

from benchmarks.demo_stability import claim_of, verdict_of


def test_the_claim_is_read_after_on_the_clock_else_anywhere_in_the_verdict() -> None:
    epochs_then_clock = (
        "verdict: K-FAC 2.4x fewer epochs (faster); on the clock a tie where both reached"
    )
    assert claim_of(epochs_then_clock) == "a tie"
    assert claim_of("verdict: time 0.81 [0.74, 0.90]: faster") == "faster"
    assert claim_of("verdict: time 0.95 [0.81, 1.12]: no clear difference (faster in 6/10)") == (
        "no clear difference"
    )
    assert claim_of("verdict: nothing to say") == "?"


def test_the_verdict_is_the_demos_last_verdict_line() -> None:
    out = (
        "kfac-bench demo: ...\nverdict: first\nverdict: SGD + K-FAC ... faster\nwrote compare.md\n"
    )
    assert verdict_of(out) == "verdict: SGD + K-FAC ... faster" and verdict_of("no verdict") == ""
