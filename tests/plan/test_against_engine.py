"""The planner's per-rank memory and traffic equal what the engine holds and sends on real gloo runs.

Each configuration trains two steps (factors and decompositions every step), most with two micro-batches
each, and reads ``memory_usage()`` at every moment of the second step where it can be read: after each
forward pass (batch sums plus the pending input factors), after each layer's gradient hook (factors handed
to the reduction, buckets launched), after each backward pass and after ``step()`` (running factors and
decompositions). The peak of each category, of the buffers together and of the total must equal the plan;
``Communicator.counts`` and ``payload_bytes`` over the second step too (the first also runs the one-off
readiness all-reduce). One rank is a single process (factors kept until ``step()``, nothing sent).
The plan is a GPU's: the workers hold same-shaped calls for one batch as a GPU does (the CPU computes
each call on arrival, :data:`kfac_bench.kfac.batching.HOLD`).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import FactorReduction, KFACPreconditioner, Placement, batching, scan_model
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


SMALL_BUCKETS: dict[str, Any] = {
    "allreduce_bucket_cap_mb": 200 / 2**20,
    "symmetry_aware": True,
    "comm_dtype": torch.bfloat16,
}
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    # Several buckets, upper triangles, factors sent in a lower precision, inverses in float64.
    "small_buckets": SMALL_BUCKETS | {"inv_dtype": torch.float64},
    "inverse": {"compute_method": "inverse"},
    # No accumulation: the buffers peak at the end of the backward pass (full factors on the wire) ...
    "one_micro": {"accumulation_steps": 1},
    # ... or during it, while the smaller packed buckets replace the factors as they launch.
    "one_micro_small_buckets": SMALL_BUCKETS | {"accumulation_steps": 1},
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
    ends = sorted({1, world})
    out += [
        ("five", opts, m, "lpt", "reduce") for opts in ("small_buckets", "inverse") for m in ends
    ]
    out += [("five", "one_micro", m, "lpt", "allreduce") for m in ends]
    out += [("three", "one_micro", 1, "round_robin", "reduce")]
    out += [("five", "one_micro_small_buckets", m, "lpt", "reduce") for m in ends]
    return out


def split(opts: str) -> tuple[dict[str, Any], int]:
    """The engine options of ``opts`` without the micro-batch count, and that count."""
    options = dict(OPTIONS[opts])
    return options, options.pop("accumulation_steps", MICRO)


class Moments:
    """``memory_usage()`` at every moment it can be read while ``on``: :meth:`record` is called by the loop
    after each forward, backward and ``step()``, and after each layer's gradient hook by a prehook on the
    same autograd node, registered after the preconditioner's (so it runs right after it)."""

    def __init__(self, p: KFACPreconditioner) -> None:
        self.p = p
        self.on = False
        self.seen: list[dict[str, int]] = []
        for layer in p.layers.values():
            layer.module.register_forward_hook(self._forward_hook)

    def record(self, *_: Any) -> None:
        if self.on:
            self.seen.append(self.p.memory_usage())

    def _forward_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.on and output.grad_fn is not None:
            output.grad_fn.register_prehook(self.record)


def measure_worker(rank: int, world: int) -> list[dict[str, Any]]:
    batching.HOLD["cpu"] = True  # this worker process only
    results = []
    for model_kind, opts, m, placement, reduction in configs(world):
        options, micro = split(opts)
        model = make_model(model_kind)
        p = KFACPreconditioner(
            model,
            grad_worker_fraction=m / world,
            placement=placement,
            factor_reduction=reduction,
            accumulation_steps=micro,
            lr=0.1,
            **options,
        )
        moments = Moments(p)  # watches the second step
        sent: dict[str, int] = {}
        calls: dict[str, int] = {}
        for step in range(2):
            moments.on = step == 1
            before = (dict(p.comm.payload_bytes), dict(p.comm.counts))
            model.zero_grad()
            g = torch.Generator().manual_seed(10 * step + rank)
            for _ in range(micro):
                x = torch.randn(LOCAL, 3, 6, 6, generator=g)
                y = torch.randint(0, 5, (LOCAL,), generator=g)
                loss = F.cross_entropy(model(x), y) / micro
                moments.record()
                loss.backward()
                moments.record()
            end_of_backward = p.memory_usage()
            for prm in model.parameters():
                torch.distributed.all_reduce(prm.grad)
                prm.grad /= world
            p.step()
            if step == 1:
                moments.record()
                sent = {k: v - before[0].get(k, 0) for k, v in p.comm.payload_bytes.items()}
                calls = {k: v - before[1].get(k, 0) for k, v in p.comm.counts.items()}
        peak = {k: max(mem[k] for mem in moments.seen) for k in (*MEMORY, "total")}
        hooks = len(moments.seen) - 2 * micro - 1
        results.append(
            {"memory": peak, "end": end_of_backward, "hooks": hooks, "sent": sent, "calls": calls}
        )
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_planned_memory_and_traffic_equal_the_engines(world: int) -> None:
    measured = run_distributed(measure_worker, world, timeout=300)
    for i, (model_kind, opts, m, placement, reduction) in enumerate(configs(world)):
        model = make_model(model_kind)
        options, micro = split(opts)
        settings = engine_settings(model, **options)
        scenario = Scenario(world, m, Placement.parse(placement), FactorReduction.parse(reduction))
        planned = rank_loads(scan_model(model).layers, settings, scenario, accumulation_steps=micro)
        total = planned.total_memory()
        for rank in range(world):
            got = measured[rank][i]
            where = f"{model_kind} {opts} m={m} {placement} {reduction} rank {rank}"
            assert got["hooks"] == micro * len(planned.work), (
                where
            )  # every gradient hook was watched
            want = {k: v[rank] for k, v in planned.memory.items()}
            # Every category at its peak, the buffers and the total at theirs: exact.
            assert got["memory"] == want | {"total": total[rank]}, where
            end = got["end"]
            if (
                world > 1
            ):  # the backward pass has launched every bucket and freed every batch factor
                assert end["batch_buffers"] == 0, where
                assert end["comm_buffers"] == want["comm_buffers"], where
            if (
                opts == "one_micro"
            ):  # full factors on the wire: the peak is the end of the backward pass
                assert end["total"] == total[rank], where
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
