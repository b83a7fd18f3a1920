"""The factor bucket plan as a pure function, and the bytes every collective carries (``payload_bytes``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.assignment import LayerWork
from kfac_bench.kfac.comm import Bucket, factor_entries, make_buckets

from ..distributed import run_distributed
from .test_distributed import kfac_kwargs, make_model, train


def test_factor_entries_run_in_backward_order_with_their_reduce_target() -> None:
    plan = {
        "first": LayerWork("first", 5, 3, a_owner=0, g_owner=1, grad_workers=(0, 1)),
        "last": LayerWork("last", 4, 2, a_owner=1, g_owner=1, grad_workers=(0, 1)),
    }
    assert factor_entries(plan, reduce=False) == [
        ("last/g", 2, None),
        ("last/a", 4, None),
        ("first/g", 3, None),
        ("first/a", 5, None),
    ]
    assert [dst for _, _, dst in factor_entries(plan, reduce=True)] == [1, 1, 1, 0]


def test_buckets_group_consecutive_factors_of_one_target_under_the_cap() -> None:
    # Cap 100 bytes at 4 bytes per element = 25 elements.
    cap_mb = 100 / 2**20
    entries = [("a", 3, None), ("b", 4, None), ("c", 2, None), ("d", 6, None), ("e", 2, 0)]
    got = make_buckets(entries, 4, cap_mb, symmetry_aware=False)
    # 9 + 16 = 25 fit; +4 would not. d (36 > 25) is alone; e has another target. Each bucket also
    # carries one weight per factor and the rank's loss terms (not counted against the cap).
    assert got == [
        Bucket(["a", "b"], None, 25 + 3),
        Bucket(["c"], None, 4 + 2),
        Bucket(["d"], None, 36 + 2),
        Bucket(["e"], 0, 4 + 2),
    ]
    assert [b.dims for b in got] == [[3, 4], [2], [6], [2]]
    packed = make_buckets(entries, 4, cap_mb, symmetry_aware=True)
    # Upper triangles: 6, 10, 3, 21, 3 elements -> 6+10+3 = 19, then 21 alone (19+21 > 25).
    assert [(b.keys, b.numel) for b in packed] == [
        (["a", "b", "c"], 19 + 4),
        (["d"], 21 + 2),
        (["e"], 3 + 2),
    ]


def bytes_worker(rank: int, world: int, fraction: str, options: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    p = KFACPreconditioner(
        ddp,
        **kfac_kwargs(
            factor_update_steps=2, inv_update_steps=4, grad_worker_fraction=fraction, **options
        ),
    )
    per_step = []
    for s in range(6):
        before = dict(p.comm.payload_bytes)
        train(ddp, p, world, rank, range(s, s + 1), sync_grads=False)
        per_step.append({k: v - before.get(k, 0) for k, v in p.comm.payload_bytes.items()})
    return {
        "per_step": per_step,
        "dims": [(s.a_dim, s.g_dim) for s in p.layers.values()],
        "buckets": len(p.comm.buckets),
        "blocks": [s.work.grad_workers for s in p.layers.values()],  # type: ignore[union-attr]
    }


@pytest.mark.parametrize(
    ("fraction", "options"),
    [
        ("comm_opt", {}),
        ("mem_opt", {"factor_reduction": "reduce"}),
        ("comm_opt", {"symmetry_aware": True, "comm_dtype": torch.float32}),
    ],
)
def test_payload_bytes_are_the_sizes_of_what_each_collective_carries(
    fraction: str, options: dict[str, Any]
) -> None:
    world = 2
    results = run_distributed(bytes_worker, world, fraction, options)
    dims = results[0]["dims"]
    factor_size = 4 if "comm_dtype" in options else 8  # the model and its factors are float64
    per_factor = (
        (lambda d: d * (d + 1) // 2) if options.get("symmetry_aware") else (lambda d: d * d)
    )
    factors = factor_size * sum(per_factor(a) + per_factor(g) for a, g in dims)
    factors += factor_size * (2 * len(dims) + results[0]["buckets"])  # weights, terms per bucket
    kind = "factor_reduce" if options.get("factor_reduction") == "reduce" else "factor_allreduce"
    # Eigen parts in float64: Q_A, λ_A, Q_G, λ_G and the outer product 1/(λ_G λ_Aᵀ + γ).
    parts = [8 * (a * a + a + g * g + g + g * a) for a, g in dims]
    grads = 8 * sum(g * a for a, g in dims)
    for rank, res in enumerate(results):
        for s, sent in enumerate(res["per_step"]):
            assert sent.get(kind, 0) == (factors if s % 2 == 0 else 0), (rank, s, sent)
            mine = sum(p for p, block in zip(parts, res["blocks"]) if rank in block)
            shared = fraction == "comm_opt" and s % 4 == 0
            assert sent.get("decomposition_broadcast", 0) == (mine if shared else 0), (rank, s)
            assert sent.get("grad_broadcast", 0) == (grads if fraction == "mem_opt" else 0)
