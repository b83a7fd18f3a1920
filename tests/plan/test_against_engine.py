"""The planner's per-rank memory and traffic equal what the engine holds and sends on real gloo runs.

Each configuration trains two steps with two micro-batches each (factors and decompositions every step) and
reads the engine at each category's peak: ``memory_usage()`` between the second forward and its backward
(batch sums plus the pending input factor), between the last backward and ``step()`` (factor buckets in
flight) and after ``step()`` (running factors and decompositions); ``Communicator.counts`` and
``payload_bytes`` over the second step (the first also runs the one-off readiness all-reduce).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import FactorReduction, KFACPreconditioner, Placement, scan_model
from kfac_bench.plan.costs import MEMORY, WHEN, Scenario, equal_group_workers, rank_loads
from kfac_bench.plan.recipe import engine_settings

from ..distributed import run_distributed

pytestmark = pytest.mark.distributed

MICRO = 2
LOCAL = 3


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "three":  # fewer layers than ranks: round robin splits A and G (SC20)
        return nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 6 * 6, 7), nn.Tanh(), nn.Linear(7, 9), nn.Linear(9, 5)
        )
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 8),
        nn.Tanh(),
        nn.Linear(8, 5),
    )


OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    # Several buckets, upper triangles, factors sent in a lower precision, inverses in float64.
    "small_buckets": {
        "allreduce_bucket_cap_mb": 200 / 2**20,
        "symmetry_aware": True,
        "comm_dtype": torch.bfloat16,
        "inv_dtype": torch.float64,
    },
    "inverse": {"compute_method": "inverse"},
}


def configs(world: int) -> list[tuple[str, str, int, str, str]]:
    out = [
        (model, opts, m, placement, reduction)
        for model, m, placement, reduction in itertools.product(
            ("five", "three"),
            equal_group_workers(world),
            ("lpt", "round_robin"),
            ("allreduce", "reduce"),
        )
        for opts in ("default",)
    ]
    out += [
        ("five", opts, m, "lpt", "reduce")
        for opts in ("small_buckets", "inverse")
        for m in (1, world)
    ]
    return out


def measure_worker(rank: int, world: int) -> list[dict[str, Any]]:
    results = []
    for model_kind, opts, m, placement, reduction in configs(world):
        model = make_model(model_kind)
        p = KFACPreconditioner(
            model,
            grad_worker_fraction=m / world,
            placement=placement,
            factor_reduction=reduction,
            accumulation_steps=MICRO,
            lr=0.1,
            **OPTIONS[opts],
        )
        peak = dict.fromkeys(MEMORY, 0)
        sent: dict[str, int] = {}
        calls: dict[str, int] = {}
        for step in range(2):
            before = (dict(p.comm.payload_bytes), dict(p.comm.counts))
            model.zero_grad()
            g = torch.Generator().manual_seed(10 * step + rank)
            for micro in range(MICRO):
                x = torch.randn(LOCAL, 3, 6, 6, generator=g)
                y = torch.randint(0, 5, (LOCAL,), generator=g)
                loss = F.cross_entropy(model(x), y) / MICRO
                if micro == MICRO - 1:  # the second forward: pending input factors + running sums
                    peak["batch_buffers"] = p.memory_usage()["batch_buffers"]
                loss.backward()
            for prm in model.parameters():
                torch.distributed.all_reduce(prm.grad)
                prm.grad /= world
            peak["comm_buffers"] = p.memory_usage()["comm_buffers"]
            p.step()
            if step == 1:
                sent = {k: v - before[0].get(k, 0) for k, v in p.comm.payload_bytes.items()}
                calls = {k: v - before[1].get(k, 0) for k, v in p.comm.counts.items()}
        after = p.memory_usage()
        for key in ("factors", "decompositions", "outer_products"):
            peak[key] = after[key]
        results.append({"memory": peak, "sent": sent, "calls": calls})
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_planned_memory_and_traffic_equal_the_engines(world: int) -> None:
    measured = run_distributed(measure_worker, world, timeout=300)
    for i, (model_kind, opts, m, placement, reduction) in enumerate(configs(world)):
        model = make_model(model_kind)
        settings = engine_settings(model, **OPTIONS[opts])
        scenario = Scenario(world, m, Placement.parse(placement), FactorReduction.parse(reduction))
        planned = rank_loads(scan_model(model).layers, settings, scenario, accumulation_steps=MICRO)
        total = planned.total_memory()
        for rank in range(world):
            got = measured[rank][i]
            where = f"{model_kind} {opts} m={m} {placement} {reduction} rank {rank}"
            want = {k: v[rank] for k, v in planned.memory.items()}
            # Every category is exact; the bar (5 %) applies to the per-rank total.
            assert got["memory"] == want, where
            measured_total = sum(got["memory"][k] for k in MEMORY if k != "outer_products")
            assert abs(measured_total - total[rank]) <= 0.05 * total[rank], where
            kinds = {k for k in got["sent"] if got["sent"][k]}
            assert kinds == set(planned.payload), where
            for kind in WHEN:
                assert got["sent"].get(kind, 0) == planned.payload.get(kind, [0] * world)[rank], (
                    where,
                    kind,
                )
                assert got["calls"].get(kind, 0) == planned.calls.get(kind, [0] * world)[rank], (
                    where,
                    kind,
                )
