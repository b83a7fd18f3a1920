"""How much faster (or slower) an arm is than the baseline, with a 95 % confidence interval.

The measure is the ratio of the arm's time (or epochs) to target over the baseline's. Noise on the clock is
multiplicative (a busy machine stretches a whole run), so the interval is taken on log ratios and
exponentiated:

- **Paired** where both arms ran at least two of the same seeds: a t interval on the seeds' log ratios
  ``log(arm / baseline)`` (Student's t with n - 1 degrees of freedom). Its coverage is exact when the log
  ratios are normal (log-normal run-to-run noise), at any n >= 2; a percentile bootstrap undercovers at the
  3 to 8 seeds a comparison has, and a rank-based (Wilcoxon) interval cannot reach 95 % below 6 pairs.
- **Unpaired** otherwise (no common seeds, or seeds not recorded): Welch's t interval on the difference of
  the arms' mean log values.

A run that missed the target is **censored**: it took at least its training time (epochs), the true
value is unknown above that. It is never dropped, and never read in the direction that favours a claim:
the interval's upper end (which must be below 1 for "faster") puts a censored arm run at +infinity (the
baseline's censored runs at their lower bound, which makes the ratio larger, not smaller); the lower end
(which must be above 1 for "slower") does the mirror image. So an arm that missed the target in a seed can
never be called faster, and a baseline that missed can never make the arm slower. The point estimate (the
geometric mean ratio) reads censored runs at their lower bound and is labelled as such.

**Power** (:attr:`Interval.seeds_for_power`): how many seeds per arm a comparison with the observed
run-to-run spread needs to detect a true ratio of :data:`POWER_RATIO` (or its inverse) with
:data:`POWER` probability: the exact power of the same t test (noncentral t) at that ratio, with the spread
(the standard deviation of the log ratios, or of each arm's log values) read from the runs. It is a design
figure for the next campaign, not post-hoc power: the effect is fixed in advance, never the observed one
(which would only restate the interval, and swing with it). It needs a spread: none with fewer than two
pairs (runs), and none while a run is censored (its value is a bound, not an observation of the spread).

Beside it, MLPerf Training's scoring of an arm where it has at least 5 runs: the fastest and the slowest
time to target are dropped and the rest averaged (a run that missed counts as +infinity).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

__all__ = [
    "CONFIDENCE",
    "MLPERF_MIN_RUNS",
    "POWER",
    "POWER_RATIO",
    "Interval",
    "Obs",
    "mlperf_score",
    "ratio_interval",
]

#: The intervals' confidence level.
CONFIDENCE = 0.95
#: MLPerf's olympic scoring needs this many runs (it drops two).
MLPERF_MIN_RUNS = 5
#: The true ratio (time or epochs, arm over baseline) a power statement is about, and the power asked.
POWER_RATIO = 0.9
POWER = 0.8
#: The most seeds :attr:`Interval.seeds_for_power` looks for.
_MAX_SEEDS = 1000


@dataclass(frozen=True)
class Obs:
    """One run's time (or epochs) to target; ``censored``: the run missed the target and ``value`` is the
    time (epochs) it trained, a lower bound."""

    value: float
    censored: bool
    seed: int | None = None


@dataclass(frozen=True)
class Interval:
    """The arm/baseline ratio, its 95 % interval and how it was computed.

    Attributes:
        ratio: the geometric mean ratio (censored runs read at their lower bound); None without data.
        low, high: the interval's ends (0.0 and inf when open on that side: too few seeds, or a censored
            run); None without data.
        method: how the interval was computed, for the output (``"paired t on log ratios, 3 seeds"``).
        n: the pairs (paired) or the arm's runs (unpaired) that entered.
        censored: runs in the interval that missed the target.
        seeds_for_power: seeds per arm that the observed spread needs to detect a true ratio of
            :data:`POWER_RATIO` with :data:`POWER` probability (module docstring); None without a spread
            (under two pairs or runs per arm, a censored run) or beyond :data:`_MAX_SEEDS`.
        spread: the standard deviation that figure was computed from (of the seeds' log ratios, paired;
            of the log ratio of one run per arm, unpaired); None where there is no spread to read.
    """

    ratio: float | None
    low: float | None
    high: float | None
    method: str
    n: int = 0
    censored: int = 0
    spread: float | None = None
    #: The test's (degrees of freedom, standard error) with m seeds per arm, at the observed spread.
    design: Callable[[int], tuple[float, float]] | None = field(
        default=None, repr=False, compare=False
    )

    @cached_property
    def seeds_for_power(self) -> int | None:
        """Computed when asked (a search over noncentral t's): see the class docstring."""
        return None if self.design is None else _power_seeds(self.design)

    @property
    def claim(self) -> int:
        """-1: the arm takes less (the whole interval below 1); 1: more (above 1); 0: no clear difference."""
        if self.high is not None and self.high < 1:
            return -1
        if self.low is not None and self.low > 1:
            return 1
        return 0


def _t(df: float) -> float:
    """The two-sided :data:`CONFIDENCE` quantile of Student's t with ``df`` degrees of freedom (a
    fractional ``df``, Welch's, rounded down to 0.01: a slightly wider interval, never a narrower one)."""
    return _t_cached(math.floor(df * 100) / 100)


@lru_cache(maxsize=4096)
def _t_cached(df: float) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


def _bounds(mean: float, se: float, df: float) -> tuple[float, float]:
    if se == 0:
        return mean, mean
    half = _t(df) * se
    return mean - half, mean + half


def _usable(obs: Sequence[Obs]) -> list[Obs]:
    """Runs with a positive finite value (a ratio of zero or of nothing has no log)."""
    return [o for o in obs if math.isfinite(o.value) and o.value > 0]


def _paired(arm: list[Obs], base: list[Obs], skipped: str) -> Interval:
    by_seed = {o.seed: o for o in base}
    pairs = [(a, by_seed[a.seed]) for a in arm if a.seed in by_seed]
    n = len(pairs)
    d = [math.log(a.value) - math.log(b.value) for a, b in pairs]
    mean = statistics.fmean(d)
    sd = statistics.stdev(d)
    se = sd / math.sqrt(n)
    # Each end read the way that goes against its claim (module docstring): an arm run that missed
    # could have taken forever (no upper end), a baseline run that missed likewise (no lower end); the
    # other side's censored values are bounds in the safe direction and enter as they are.
    hi_open = any(a.censored for a, _ in pairs)
    lo_open = any(b.censored for _, b in pairs)
    low, high = _bounds(mean, se, n - 1)
    low, high = (-math.inf if lo_open else low), (math.inf if hi_open else high)
    censored = sum(a.censored for a, _ in pairs) + sum(b.censored for _, b in pairs)
    censored_any = hi_open or lo_open
    return Interval(
        math.exp(mean),
        math.exp(low),
        math.exp(high),
        f"paired t interval on log ratios, {n} seeds{skipped}",
        n,
        censored,
        None if censored_any else sd,
        None if censored_any else (lambda m: (m - 1, sd / math.sqrt(m))),
    )


def _power(df: float, se: float) -> float:
    """The probability that the two-sided t test (``df`` degrees of freedom, standard error ``se``) of
    log ratios rejects 1 when the true log ratio is ``log(POWER_RATIO)``: noncentral t."""
    from scipy.stats import nct, norm

    if se == 0:
        return 1.0
    crit, ncp = _t(df), abs(math.log(POWER_RATIO)) / se
    power = float(nct.sf(crit, df, ncp) + nct.cdf(-crit, df, ncp))
    if not math.isfinite(power):  # scipy's nct gives up far in the tail: the normal limit
        power = float(norm.sf(crit - ncp) + norm.cdf(-crit - ncp))
    return power


def _power_seeds(design: Callable[[int], tuple[float, float]]) -> int | None:
    """The fewest seeds per arm m >= 2 whose test has :data:`POWER` at :data:`POWER_RATIO`;
    ``design(m)`` gives that test's (degrees of freedom, standard error). None beyond
    :data:`_MAX_SEEDS`. The power grows with m: doubling brackets it, a bisection finds it."""
    lo, hi = 2, 2
    while _power(*design(hi)) < POWER:
        if hi >= _MAX_SEEDS:
            return None
        lo, hi = hi + 1, min(2 * hi, _MAX_SEEDS)
    while lo < hi:
        mid = (lo + hi) // 2
        if _power(*design(mid)) >= POWER:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _welch(arm: list[Obs], base: list[Obs], skipped: str) -> Interval:
    x = [math.log(o.value) for o in arm]
    y = [math.log(o.value) for o in base]
    vx, vy = statistics.variance(x), statistics.variance(y)
    nx, ny = len(x), len(y)
    se = math.sqrt(vx / nx + vy / ny)
    df = (
        (vx / nx + vy / ny) ** 2 / ((vx / nx) ** 2 / (nx - 1) + (vy / ny) ** 2 / (ny - 1))
        if se > 0
        else nx + ny - 2
    )
    mean = statistics.fmean(x) - statistics.fmean(y)
    hi_open = any(o.censored for o in arm)
    lo_open = any(o.censored for o in base)
    low, high = _bounds(mean, se, df)
    low, high = (-math.inf if lo_open else low), (math.inf if hi_open else high)
    censored_any = hi_open or lo_open

    def design(m: int) -> tuple[float, float]:
        v = (vx + vy) / m
        df = v**2 / ((vx / m) ** 2 / (m - 1) + (vy / m) ** 2 / (m - 1)) if v > 0 else 2 * m - 2
        return df, math.sqrt(v)

    return Interval(
        math.exp(mean),
        math.exp(low),
        math.exp(high),
        f"Welch t interval on log values, unpaired ({nx} and {ny} runs){skipped}",
        nx,
        sum(o.censored for o in arm) + sum(o.censored for o in base),
        None if censored_any else math.sqrt(vx + vy),
        None if censored_any else design,
    )


def ratio_interval(arm: Sequence[Obs], base: Sequence[Obs]) -> Interval:
    """The arm/baseline ratio of :class:`Obs` values with its 95 % interval: paired on the seeds both arms
    ran when there are at least two, else unpaired (module docstring). A run with a zero value (a target
    met before the first step) is left out and counted in the method."""
    usable_a, usable_b = _usable(arm), _usable(base)
    dropped = len(arm) + len(base) - len(usable_a) - len(usable_b)
    skipped = f"; {dropped} run(s) at 0 left out" if dropped else ""
    common = {o.seed for o in usable_a if o.seed is not None} & {
        o.seed for o in usable_b if o.seed is not None
    }
    if len(common) >= 2:
        return _paired(
            [o for o in usable_a if o.seed in common],
            [o for o in usable_b if o.seed in common],
            skipped,
        )
    if len(usable_a) >= 2 and len(usable_b) >= 2:
        return _welch(usable_a, usable_b, skipped)
    if usable_a and usable_b:
        ratio = math.exp(
            statistics.fmean(math.log(o.value) for o in usable_a)
            - statistics.fmean(math.log(o.value) for o in usable_b)
        )
        why = "1 common seed" if len(common) == 1 else "a single run in an arm"
        censored = sum(o.censored for o in usable_a) + sum(o.censored for o in usable_b)
        return Interval(
            ratio, 0.0, math.inf, f"none ({why}: an interval needs 2){skipped}", 1, censored
        )
    return Interval(None, None, None, f"none (no usable run){skipped}")


def mlperf_score(obs: Sequence[Obs]) -> float | None:
    """MLPerf Training's score of one arm: with at least :data:`MLPERF_MIN_RUNS` runs, the mean time to
    target without the fastest and the slowest run (a run that missed counts as +inf); None with fewer
    runs or when a run that missed remains after the drop."""
    if len(obs) < MLPERF_MIN_RUNS:
        return None
    values = sorted(math.inf if o.censored else o.value for o in obs)[1:-1]
    mean = statistics.fmean(values)
    return mean if math.isfinite(mean) else None
