"""Factor communication: buckets, overlap with the backward pass, triangular packing, lower precision."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.comm import pack_triu, unpack_triu

from ..distributed import run_distributed
from .test_distributed import LOCAL_BATCH, global_batch, make_model

pytestmark = pytest.mark.distributed


def test_triangular_packing_round_trips() -> None:
    x = torch.randn(5, 5)
    s = x + x.t()
    assert pack_triu(s).numel() == 15
    torch.testing.assert_close(unpack_triu(pack_triu(s), 5), s)


def factor_worker(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    p = KFACPreconditioner(ddp, factor_decay=0.0, **options)
    x, y = global_batch(0, world)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    F.cross_entropy(ddp(x[sl]), y[sl]).backward()
    launched_in_backward = p.comm.counts["factor_allreduce"]
    comm_bytes = p.memory_usage()["comm_buffers"]
    p.step()
    return {
        "comm_bytes": comm_bytes,
        "comm_bytes_after": p.memory_usage()["comm_buffers"],
        "dims": [(s.a_dim, s.g_dim) for s in p.layers.values()],
        "factors": {n: (s.a_factor, s.g_factor) for n, s in p.layers.items()},
        "buckets": len(p.comm.buckets),
        "launched_in_backward": launched_in_backward,
        "launched": p.comm.counts["factor_allreduce"],
    }


def test_buckets_launch_during_backward_and_variants_agree() -> None:
    world = 2
    variants = {
        "plain": {},
        "small_buckets": {"allreduce_bucket_cap_mb": 0.0005},
        "triangular": {"symmetry_aware": True},
        "bf16": {"comm_dtype": torch.bfloat16},
    }
    results = {k: run_distributed(factor_worker, world, v) for k, v in variants.items()}
    plain = results["plain"][0]
    # Every bucket was launched from the gradient hooks, before step() was called.
    for name in ("plain", "small_buckets"):
        for res in results[name]:
            assert res["launched_in_backward"] == res["launched"] == res["buckets"]
    assert results["small_buckets"][0]["buckets"] > plain["buckets"] == 1
    # memory_usage() counts the buckets in flight between the last backward pass and step(), as documented.
    for name, size, packed in (("plain", 8, False), ("triangular", 8, True), ("bf16", 2, False)):
        res = results[name][0]
        elems = sum(d * (d + 1) // 2 if packed else d * d for dims in res["dims"] for d in dims)
        elems += 2 * len(res["dims"]) + res["buckets"]  # each factor's weight, each bucket's terms
        assert res["comm_bytes"] == size * elems and res["comm_bytes_after"] == 0
    # gloo may sum a bucket in a different order depending on how the factors are packed into it (bucket
    # size, triangles), so float64 factors agree to rounding, not bit for bit (8.9e-16 seen): a few ulps.
    ulps = 8 * torch.finfo(torch.float64).eps
    for name, tol in (("small_buckets", ulps), ("triangular", ulps), ("bf16", 1e-2)):
        for layer, (a, g) in results[name][0]["factors"].items():
            pa, pg = plain["factors"][layer]
            torch.testing.assert_close(a, pa, rtol=tol, atol=tol * pa.abs().max().item())
            torch.testing.assert_close(g, pg, rtol=tol, atol=tol * pg.abs().max().item())
