"""The cluster's readings of K-FAC's every-step growth (kfac_bench/plan/cluster.py): the rising part is the
least-squares non-decreasing fit through 1 at the reference world size, and every reading gives the
reference model back."""

from __future__ import annotations

import itertools
import random

import pytest

from kfac_bench.plan.cluster import KFAC_READINGS, Cluster, Variant, rising_part


def _brute_force(table: dict[int, float], at: int) -> dict[int, float]:
    """The nearest non-decreasing sequence through 1 at ``at``, by trying every candidate value: a
    least-squares monotone fit takes the means of contiguous runs of the values, or the bound 1."""
    keys = sorted(table)
    values = [table[k] for k in keys]
    means = {1.0} | {
        sum(values[i:j]) / (j - i)
        for i in range(len(values))
        for j in range(i + 1, len(values) + 1)
    }
    best, best_sse = None, float("inf")
    for seq in itertools.product(sorted(means), repeat=len(keys)):
        fitted = dict(zip(keys, seq))
        if fitted[at] != 1.0 or any(a > b for a, b in itertools.pairwise(seq)):
            continue
        sse = sum((fitted[k] - table[k]) ** 2 for k in keys)
        if sse < best_sse - 1e-15:
            best, best_sse = fitted, sse
    assert best is not None
    return best


def test_rising_part_by_hand() -> None:
    # Longhorn's shape: above 1 at 16 and 32 GPUs (not rising), rising from 64 on.
    got = rising_part({16: 1.2, 32: 1.3, 64: 1.0, 128: 1.1, 256: 2.0}, 64)
    assert got == pytest.approx({16: 1.0, 32: 1.0, 64: 1.0, 128: 1.1, 256: 2.0})
    # Rising everywhere: kept as it is; a dip above the reference is pooled with its neighbour.
    got = rising_part({16: 0.8, 32: 0.9, 64: 1.0, 128: 1.6, 256: 1.4}, 64)
    assert got == pytest.approx({16: 0.8, 32: 0.9, 64: 1.0, 128: 1.5, 256: 1.5})


def test_rising_part_is_the_nearest_non_decreasing_fit() -> None:
    rng = random.Random(0)
    for _ in range(100):
        keys = [2**i for i in range(rng.randint(2, 4))]
        at = rng.choice(keys)
        table = {k: 1.0 if k == at else rng.uniform(0.5, 2.5) for k in keys}
        assert rising_part(table, at) == pytest.approx(_brute_force(table, at)), table


def _cluster() -> Cluster:
    return Cluster(
        path="c.yaml",
        device="test",
        reference_model="resnet50",
        reference_world_size=64,
        reference_gradient_bytes=1e8,
        reference_every_step_s=0.025,
        baseline_growth_s={16: 0.0, 64: 0.0, 256: 0.1},
        kfac_growth={16: 1.2, 32: 1.3, 64: 1.0, 128: 1.1, 256: 2.0},
        spread=0.05,
    )


def test_every_reading_gives_the_reference_model_back() -> None:
    """The reference's own every-step work (0.025 s at 64 GPUs) grows by the measured ratio whichever way
    it is read: the readings differ only for another model."""
    cluster = _cluster()
    for n in (16, 32, 64, 128, 256):
        for kfac in KFAC_READINGS:
            factor = cluster.every_step_factor(n, 64, Variant(kfac=kfac), 0.025)
            assert factor == pytest.approx(cluster.kfac_growth[n]), (n, kfac)


def test_a_model_with_six_times_the_work_takes_the_rise_as_a_ratio_and_the_rest_in_seconds() -> (
    None
):
    cluster = _cluster()
    work = 0.150

    def factor(n: int, kfac: str) -> float:
        return cluster.every_step_factor(n, 64, Variant(kfac=kfac), work)

    # At 32 GPUs the reference's 1.3x does not rise with N: 0.3 x 25 ms is added, not 0.3 x 150 ms.
    assert factor(32, "split") * work == pytest.approx(work + 0.3 * 0.025)
    assert factor(32, "ratio") == pytest.approx(1.3)
    assert factor(32, "seconds") == pytest.approx(factor(32, "split"))
    # At 256 GPUs it rises: the whole work stretches 2x.
    assert factor(256, "split") == pytest.approx(2.0)
    assert factor(256, "seconds") * work == pytest.approx(work + 0.025)
    # Between listed world sizes, linear in log2 N as every table.
    assert factor(181, "split") == pytest.approx(1.1 + 0.9 * 0.5, rel=2e-2)
    # Measured at another world size (128): relative to the growth there.
    assert cluster.every_step_factor(256, 128, Variant(), work) == pytest.approx(2.0 / 1.1)
