"""The comparison's interval (:mod:`kfac_bench.compare.stats`): its coverage on synthetic runs with a known
ratio, how censored runs (missed the target) open it, the seeds the spread would need, MLPerf's score.

Coverage: seed ``i`` of the baseline takes ``exp(N(mu_i, 0.3))`` seconds (seeds differ), the arm ``R`` times
that with its own log-normal noise, so the true ratio is ``R``; the 95 % interval must hold ``R`` in about
95 % of draws at the seed counts compare sees (3 to 8). 4000 draws: the binomial standard error of a true
95 % is 0.34 %, so [93.8 %, 96.2 %] is 3.5 standard errors wide each way.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kfac_bench.compare.stats import Interval, Obs, mlperf_score, ratio_interval

DRAWS = 4000


def _draw(rng: random.Random, n: int, ratio: float, paired: bool) -> tuple[list[Obs], list[Obs]]:
    base, arm = [], []
    for i in range(n):
        level = rng.gauss(0.0, 0.5)  # this seed's difficulty, shared by both arms when paired
        base.append(Obs(math.exp(level + rng.gauss(0, 0.3)), False, i if paired else None))
        other = level if paired else rng.gauss(0.0, 0.5)
        arm.append(Obs(ratio * math.exp(other + rng.gauss(0, 0.3)), False, i if paired else None))
    return arm, base


@pytest.mark.parametrize("n", [3, 5, 8])
def test_the_paired_interval_covers_the_true_ratio_95_percent_of_the_time(n: int) -> None:
    rng = random.Random(n)
    hits = 0
    for _ in range(DRAWS):
        iv = ratio_interval(*_draw(rng, n, 0.7, paired=True))
        assert iv.low is not None and iv.high is not None
        hits += iv.low <= 0.7 <= iv.high
    assert 0.938 <= hits / DRAWS <= 0.962
    assert iv.method == f"paired t interval on log ratios, {n} seeds"


def test_the_unpaired_interval_covers_the_true_ratio_about_95_percent_of_the_time() -> None:
    rng = random.Random(7)
    hits = 0
    for _ in range(DRAWS):
        iv = ratio_interval(*_draw(rng, 5, 1.3, paired=False))
        assert iv.low is not None and iv.high is not None
        hits += iv.low <= 1.3 <= iv.high
    # Welch's interval is approximate (the degrees of freedom are estimated): a little wider band.
    assert 0.93 <= hits / DRAWS <= 0.97
    assert iv.method.startswith("Welch t interval on log values, unpaired (5 and 5 runs)")


def test_claims_follow_the_interval() -> None:
    assert Interval(0.8, 0.7, 0.95, "m").claim == -1  # all below 1: less time
    assert Interval(1.2, 1.05, 1.3, "m").claim == 1
    assert Interval(0.9, 0.7, 1.01, "m").claim == 0


def _obs(values: list[float], censored: list[bool] | None = None) -> list[Obs]:
    flags = censored or [False] * len(values)
    return [Obs(v, c, i) for i, (v, c) in enumerate(zip(values, flags))]


def test_an_arm_run_that_missed_opens_the_upper_end_only() -> None:
    base = _obs([2.0, 2.1, 1.9, 2.0])
    arm = _obs([1.0, 1.05, 0.95, 1.2], [False, False, False, True])
    iv = ratio_interval(arm, base)
    assert iv.high == math.inf and iv.censored == 1
    d = [math.log(a.value / b.value) for a, b in zip(arm, base)]
    t3 = 3.182446305284263  # Student's t, 3 degrees of freedom, 97.5 %
    low = statistics.fmean(d) - t3 * statistics.stdev(d) / 2
    assert iv.low == pytest.approx(math.exp(low)) and iv.claim == 0
    assert iv.ratio == pytest.approx(math.exp(statistics.fmean(d)))


def test_a_baseline_run_that_missed_opens_the_lower_end_only() -> None:
    arm = _obs([1.0, 1.05, 0.95, 1.0])
    base = _obs([2.0, 2.1, 1.9, 1.5], [False, False, False, True])
    iv = ratio_interval(arm, base)
    assert iv.low == 0.0 and iv.high is not None and iv.high < 1 and iv.claim == -1


def test_both_missing_the_same_seed_leaves_no_claim() -> None:
    flags = [False, False, True]
    iv = ratio_interval(_obs([1.0, 1.1, 3.0], flags), _obs([2.0, 2.2, 3.0], flags))
    assert (iv.low, iv.high, iv.claim) == (0.0, math.inf, 0)


def test_the_power_figure_is_the_seeds_a_ratio_of_09_needs_at_the_observed_spread() -> None:
    # Log ratios with sd 0.2 over 3 seeds: the figure is m with power >= 80 % at a true ratio of 0.9,
    # checked here by simulating that t test (numpy, not the noncentral t the code uses).
    import numpy as np
    from scipy.stats import t

    d = [-0.3, -0.1, 0.1]
    iv = ratio_interval(_obs([math.exp(x) for x in d]), _obs([1.0, 1.0, 1.0]))
    assert iv.claim == 0 and iv.spread == pytest.approx(statistics.stdev(d))
    m = iv.seeds_for_power
    assert m is not None

    def simulated_power(k: int) -> float:
        rng = np.random.default_rng(k)
        x = rng.normal(math.log(0.9), iv.spread, size=(20000, k))
        stat = np.abs(x.mean(axis=1)) / (x.std(axis=1, ddof=1) / math.sqrt(k))
        return float((stat > t.ppf(0.975, k - 1)).mean())

    assert simulated_power(m) >= 0.79 and simulated_power(m - 2) < 0.8
    # Not post-hoc power: the observed ratio does not enter, only the spread (the same log ratios
    # shifted to an observed ratio of 1, or of 0.8, give the same figure).
    for shift in (0.1, -0.123):
        moved = ratio_interval(_obs([math.exp(x + shift) for x in d]), _obs([1.0, 1.0, 1.0]))
        assert moved.seeds_for_power == m
    # A wider spread needs more seeds; a censored run gives no spread to base the figure on.
    wide = ratio_interval(_obs([math.exp(2 * x) for x in d]), _obs([1.0, 1.0, 1.0]))
    assert wide.seeds_for_power is not None and wide.seeds_for_power > m
    cut = ratio_interval(_obs([math.exp(x) for x in d], [False, False, True]), _obs([1.0] * 3))
    assert cut.seeds_for_power is None and cut.spread is None


def test_unpaired_runs_get_the_welch_power_figure() -> None:
    arm = [Obs(v, False, None) for v in (1.0, 1.2, 0.9, 1.1)]
    base = [Obs(v, False, None) for v in (1.0, 1.1, 1.05, 0.95)]
    iv = ratio_interval(arm, base)
    assert iv.method.startswith("Welch") and iv.seeds_for_power is not None
    assert iv.seeds_for_power >= 2


def test_too_few_runs_give_an_open_interval_and_a_zero_value_is_left_out() -> None:
    one = ratio_interval(_obs([1.0]), _obs([2.0]))
    assert one.ratio == pytest.approx(0.5) and (one.low, one.high) == (0.0, math.inf)
    assert one.method.startswith("none")
    # A baseline at 0 epochs (the target met before the first step) has no ratio: left out, named.
    zero = ratio_interval(_obs([3.0, 4.0, 5.0]), _obs([0.0, 4.0, 5.0]))
    assert zero.n == 2 and "1 run(s) at 0 left out" in zero.method
    assert ratio_interval([], []).ratio is None


def test_mlperf_drops_the_fastest_and_slowest_of_five_or_more() -> None:
    assert mlperf_score(_obs([1.0, 2.0, 3.0, 4.0])) is None  # fewer than 5 runs
    assert mlperf_score(_obs([5.0, 1.0, 2.0, 3.0, 9.0])) == pytest.approx((2 + 3 + 5) / 3)
    # One run that missed is the slowest and is dropped; two leave an infinite mean.
    assert mlperf_score(_obs([1.0, 2.0, 3.0, 4.0, 9.0], [False] * 4 + [True])) == pytest.approx(3)
    assert mlperf_score(_obs([1.0, 2.0, 3.0, 4.0, 9.0], [False] * 3 + [True] * 2)) is None
