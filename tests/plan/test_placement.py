"""A plan places every layer where the engine places it: both call :func:`kfac_bench.kfac.assignment.assign`
with the second-order method's decomposition cost and each layer's ``spatial`` flag.

The engine's side is a real ``KFACPreconditioner`` on the model, asked for its placement on a given number
of ranks (the same call it makes for its own process group); the plan's side is
:func:`~kfac_bench.plan.costs.rank_loads` on the scanned layers. ``eigen_lowrank`` prices large Linear
factors below ``n³`` and keeps convolution factors exact, so a placement that forgot either differs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from kfac_bench.kfac import FactorReduction, KFACPreconditioner, Placement, scan_model
from kfac_bench.kfac.assignment import assign
from kfac_bench.plan.costs import Scenario, equal_group_workers, rank_loads
from kfac_bench.plan.recipe import engine_settings

from ..kfac.test_assignment import LayerShape

#: Factors from 16 rows on are low rank under ``eigen_lowrank`` (the Linear ones).
LOWRANK = {"lowrank_fraction": 0.25, "lowrank_min_dim": 16}


def make_model() -> nn.Module:
    """Convolutions and Linear layers of many sizes around the low-rank threshold."""
    torch.manual_seed(0)
    convs = [nn.Conv2d(c_in, c_out, k) for c_in, c_out, k in ((3, 8, 3), (8, 24, 3), (24, 6, 1))]
    dims = [6, 96, 40, 120, 17, 64, 64, 12, 200, 33, 5]
    linears = [
        nn.Linear(a, b, bias=i % 2 == 0) for i, (a, b) in enumerate(itertools.pairwise(dims))
    ]
    return nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), *linears)


def engine_placement(method: str, world: int, m: int, placement: str, colocate: bool) -> dict:
    p = KFACPreconditioner(
        make_model(),
        compute_method=method,
        grad_worker_fraction=m / world,
        placement=placement,
        colocate_factors=colocate,
        **LOWRANK,
    )
    return p._placement(world)


def plan_placement(method: str, world: int, m: int, placement: str, colocate: bool) -> dict:
    model = make_model()
    settings = engine_settings(model, compute_method=method, colocate_factors=colocate, **LOWRANK)
    scenario = Scenario(world, m, Placement.parse(placement), FactorReduction.ALLREDUCE)
    return rank_loads(scan_model(model).layers, settings, scenario).work


@pytest.mark.parametrize("world", [4, 64])
@pytest.mark.parametrize("method", ["eigen", "inverse", "eigen_lowrank"])
def test_plan_places_every_layer_where_the_engine_does(world: int, method: str) -> None:
    workers = equal_group_workers(world)
    for m, placement, colocate in itertools.product(
        (1, workers[len(workers) // 2], world), ("lpt", "round_robin"), (True, False)
    ):
        engine = engine_placement(method, world, m, placement, colocate)
        assert len(engine) == 13
        assert plan_placement(method, world, m, placement, colocate) == engine, (
            m,
            placement,
            colocate,
        )


def test_low_rank_placement_differs_from_dense_pricing() -> None:
    """The check above has teeth: pricing every factor at ``n³``, or the convolutions as low rank,
    places this model differently under ``eigen_lowrank`` on 4 ranks."""
    p = KFACPreconditioner(make_model(), compute_method="eigen_lowrank", **LOWRANK)
    engine = p._placement(4)
    specs = scan_model(make_model()).layers
    dense = assign(specs, 4, 1.0, lambda n, spatial: float(n) ** 3)
    flat = [LayerShape(s.name, s.a_dim, s.g_dim) for s in specs]  # every layer taken as non-spatial
    no_spatial = assign(flat, 4, 1.0, p.method.decomposition_cost)
    assert dense != engine and no_spatial != engine
