"""``process_group=``: K-FAC over a subgroup (the data-parallel group under tensor or pipeline parallelism),
or local inside a distributed job (a group of one): 4 gloo ranks, compared with single processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kfac_bench.kfac import KFACPreconditioner

from ..distributed import run_distributed
from .test_distributed import LOCAL_BATCH, kfac_kwargs, make_model

pytestmark = pytest.mark.distributed

STEPS = 4
#: Each group of two its own strategy, so that a collective leaking out of a group would mismatch (hang).
GROUP_OPTIONS = [
    {"grad_worker_fraction": "mem_opt", "factor_reduction": "reduce"},
    {"grad_worker_fraction": "comm_opt", "compute_method": "inverse"},
]


def group_batch(group: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one group at one step (groups train on different data)."""
    g = torch.Generator().manual_seed(1000 * group + step)
    n = LOCAL_BATCH * size
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 5, (n,), generator=g)


def train_in_group(
    rank: int, size: int, group_id: int, group: dist.ProcessGroup, options: dict[str, Any]
) -> tuple[list[list[torch.Tensor]], dict[str, int]]:
    """K-FAC over ``group``; gradients averaged inside it. Returns the gradients after each step()."""
    model = make_model()
    p = KFACPreconditioner(model, process_group=group, **kfac_kwargs(**options))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = group_batch(group_id, step, size)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        if size > 1:
            for q in model.parameters():
                dist.all_reduce(q.grad, group=group)
                q.grad /= size
        p.step()
        out.append([q.grad.clone() for q in model.parameters()])
        opt.step()
    return out, dict(p.comm.counts)


def groups_worker(rank: int, world: int) -> dict[str, Any]:
    pairs = [
        dist.new_group([0, 1]),
        dist.new_group([2, 3]),
    ]  # every rank creates both (torch's rule)
    singles = [dist.new_group([r]) for r in range(world)]
    gid = rank // 2
    pair, pair_counts = train_in_group(rank % 2, 2, gid, pairs[gid], GROUP_OPTIONS[gid])
    single, single_counts = train_in_group(
        0, 1, 10 + rank, singles[rank], {"grad_worker_fraction": 1.0}
    )
    return {
        "pair": pair,
        "pair_counts": pair_counts,
        "single": single,
        "single_counts": single_counts,
    }


def reference(group_id: int, size: int, options: dict[str, Any]) -> list[list[torch.Tensor]]:
    """One process on the group's concatenated batch (torch.distributed not initialised here)."""
    model = make_model()
    opts = {
        k: v for k, v in options.items() if k not in ("grad_worker_fraction", "factor_reduction")
    }
    p = KFACPreconditioner(model, **kfac_kwargs(**opts))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = group_batch(group_id, step, size)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        p.step()
        out.append([q.grad.clone() for q in model.parameters()])
        opt.step()
    return out


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]], what: str) -> None:
    for step, (g_step, w_step) in enumerate(zip(got, want)):
        for g, w in zip(g_step, w_step):
            torch.testing.assert_close(
                g, w, rtol=1e-5, atol=1e-9, msg=lambda m, s=step: f"{what} step {s}: {m}"
            )


def test_two_groups_of_two_each_equal_one_process_and_a_group_of_one_stays_local() -> None:
    results = run_distributed(groups_worker, 4, timeout=180)
    for gid, options in enumerate(GROUP_OPTIONS):
        want = reference(gid, 2, options)
        for rank in (2 * gid, 2 * gid + 1):
            assert_same(results[rank]["pair"], want, f"group {gid} rank {rank}")
    assert results[0]["pair_counts"].get("grad_broadcast", 0) > 0  # MEM-OPT did communicate
    for rank in range(4):
        assert_same(results[rank]["single"], reference(10 + rank, 1, {}), f"single rank {rank}")
        assert results[rank]["single_counts"] == {}  # nothing sent by a group of one


def outsider_worker(rank: int, world: int) -> str:
    group = dist.new_group([1])
    if rank == 1:
        return ""
    try:
        KFACPreconditioner(make_model(), process_group=group)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_rank_outside_the_group_gets_a_clear_error() -> None:
    assert "not a member" in run_distributed(outsider_worker, 2, timeout=60)[0]
