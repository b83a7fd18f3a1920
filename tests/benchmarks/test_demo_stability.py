"""``benchmarks/demo_stability.py`` reads the clock claim out of a verdict line (no demo is run here)."""

from __future__ import annotations

from benchmarks.demo_stability import claim_of, verdict_of

#: A verdict line of a real demo (compare's wording), and the two other clock claims in the same words.
FASTER = (
    "verdict: SGD + K-FAC (COMM-OPT) reached top1 >= 0.985 in 10/10 seeds in 9.5 epochs (median 2.0 s), SGD "
    "in 6/10 in 23 (2.9 s): time to target 0.70 [0-0.86]x SGD's: K-FAC faster on the clock; epochs to "
    "target 0.42 [0-0.52]x: K-FAC needs fewer epochs (95 % CI: paired t interval on log ratios, 10 seeds)"
)


def test_the_claim_is_the_one_that_ends_in_on_the_clock() -> None:
    assert claim_of(FASTER) == "faster"
    unclear = FASTER.replace(
        "K-FAC faster on the clock", "no clear difference on the clock (about 14 seeds per arm)"
    )
    assert claim_of(unclear) == "no clear difference"
    # The epochs' claim comes after the clock's and is not read for it.
    mixed = FASTER.replace("K-FAC needs fewer epochs", "no clear difference in epochs")
    assert claim_of(mixed) == "faster"
    assert claim_of(FASTER.replace("faster on", "slower on")) == "slower"
    assert claim_of("verdict: nothing to say") == "?"


def test_the_verdict_is_the_demos_last_verdict_line() -> None:
    out = (
        "kfac-bench demo: ...\nverdict: first\nverdict: SGD + K-FAC ... faster\nwrote compare.md\n"
    )
    assert verdict_of(out) == "verdict: SGD + K-FAC ... faster" and verdict_of("no verdict") == ""
