"""``plan.profile=true``: the n³ fit, the sampled sizes, and seconds per stage from measured rates."""

from __future__ import annotations

import pytest
from torch import nn

from kfac_bench.kfac import FactorReduction, Placement, scan_model
from kfac_bench.plan.costs import Scenario, rank_loads
from kfac_bench.plan.profile import fit_n3, profile_rates, sample_sizes
from kfac_bench.plan.recipe import engine_settings
from kfac_bench.plan.timing import Rates, stage_seconds


def test_fit_recovers_an_exact_cubic_cost() -> None:
    samples = [(n, 0.002 + 3e-9 * n**3) for n in (50, 100, 400, 800)]
    intercept, slope = fit_n3(samples)
    assert intercept == pytest.approx(0.002, rel=1e-6)
    assert slope == pytest.approx(3e-9, rel=1e-9)
    # A negative intercept is not a cost: the fit goes through the origin instead.
    assert fit_n3([(10, 0.0), (20, 8.0)])[0] == 0.0


def test_sampled_sizes_are_model_sizes_from_smallest_to_largest() -> None:
    dims = [64, 128, 147, 256, 512, 576, 1152, 2304, 4608, 2049, 1000]
    got = sample_sizes(dims, 5)
    assert got[0] == 64 and got[-1] == 4608 and set(got) <= set(dims) and len(got) <= 5
    assert sample_sizes([3, 3, 7]) == [3, 7]


def test_profiled_rates_give_seconds_per_stage() -> None:
    model = nn.Sequential(nn.Linear(40, 60), nn.Linear(60, 20))
    settings = engine_settings(model)
    layers = scan_model(model).layers
    rates = profile_rates([d for s in layers for d in (s.a_dim, s.g_dim)], settings, 5.0, 1e9)
    assert rates.source.startswith("profiled on CPU")
    assert [s["n"] for s in rates.samples] == sorted({20, 41, 60, 61})
    assert rates.decomposition_s_per_n3 > 0 and rates.gemm_flops > 0
    loads = rank_loads(layers, settings, Scenario(2, 1, Placement.LPT, FactorReduction.ALLREDUCE))
    sec = stage_seconds(loads, rates, (1, 10))
    # MEM-OPT on 2 ranks: each rank preconditions its own layers and broadcasts their gradients.
    grads = 4 * (60 * 41 + 20 * 61)
    assert sec["grad_broadcast"] == pytest.approx(grads / 1e9)
    # The factors, each factor's weight and the bucket's loss terms (one bucket).
    factor_elements = 41**2 + 60**2 + 61**2 + 20**2 + 4 + 1
    assert sec["factor_comm"] == pytest.approx(4 * factor_elements / 1e9)
    assert sec["decomposition_broadcast"] == 0.0
    fixed = Rates(1e-9, 0.0, 1e9, 1e9, "test")
    exact = stage_seconds(loads, fixed, (1, 10))
    owned = loads.owned_dims
    assert exact["decomposition"] == pytest.approx(max(1e-9 * sum(d**3 for d in o) for o in owned))
    assert exact["per_step"] == pytest.approx(
        exact["precondition"]
        + exact["grad_broadcast"]
        + exact["factor_comm"]
        + (exact["decomposition"] + exact["decomposition_broadcast"]) / 10
    )
