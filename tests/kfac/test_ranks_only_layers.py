"""Layers that run on some ranks only (data-dependent MoE routing) and uneven per-rank batches: factors are
reduced over the ranks that ran each layer, weighted by rows, and equal one process on the pooled batch
(2 gloo ranks, with and without DDP); no collective mismatch, whatever ran where."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

from ..distributed import run_distributed

pytestmark = pytest.mark.distributed

D = torch.float64
D_IN, D_OUT, EXPERTS, CLASSES = 4, 3, 3, 5
STEPS = 3


class MoE(nn.Module):
    """Token-level experts chosen by ``route`` (one expert per token); an expert no token chose is called
    with zero rows, as routing code does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D_IN, D_IN)
        self.experts = nn.ModuleList(nn.Linear(D_IN, D_OUT) for _ in range(EXPERTS))
        self.head = nn.Linear(D_OUT, CLASSES)
        self.to(D)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        out = h.new_zeros(h.shape[0], D_OUT)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, expert(h[idx]))
        return self.head(torch.tanh(out))


def rank_batch(step: int, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0 routes to experts 0 and 1, rank 1 to expert 0 only; expert 2 runs nowhere."""
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(rows, D_IN, dtype=D, generator=g)
    route = torch.arange(rows) % 2 if rank == 0 else torch.zeros(rows, dtype=torch.long)
    return x, route, torch.randint(0, CLASSES, (rows,), generator=g)


def kwargs(**extra: Any) -> dict[str, Any]:
    return dict(factor_decay=0.5, damping=0.01, kl_clip=None, lr=0.1, inv_update_steps=1) | extra


def record(model: nn.Module, p: KFACPreconditioner) -> dict[str, Any]:
    return {
        "grads": {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None},
        "factors": {
            n: (s.a_factor.clone(), s.g_factor.clone())
            for n, s in p.layers.items()
            if s.a_factor is not None
        },
        "ready": sorted(n for n, s in p.layers.items() if s.ready),
    }


def worker(
    rank: int, world: int, ddp: bool, rows: list[int], fraction: str
) -> list[dict[str, Any]]:
    model = MoE()
    wrapped = (
        nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    )
    p = KFACPreconditioner(wrapped, grad_worker_fraction=fraction, **kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    total = sum(rows)
    for step in range(STEPS):
        x, route, y = rank_batch(step, rank, rows[rank])
        opt.zero_grad()
        F.cross_entropy(wrapped(x, route), y).backward()  # the mean over this rank's rows
        if (
            not ddp
        ):  # the pooled batch's gradient: rank means weighted by rows (DDP averages: equal rows)
            for q in model.parameters():
                if q.grad is None:  # an idle expert's missing gradient is zero here
                    q.grad = torch.zeros_like(q)
                q.grad.mul_(rows[rank] / total)
                dist.all_reduce(q.grad)
        p.step()
        out.append(record(model, p))
        opt.step()
    return out


def pooled(rows: list[int]) -> list[dict[str, Any]]:
    """One process on the concatenated batches of both ranks."""
    model = MoE()
    p = KFACPreconditioner(model, **kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        parts = [rank_batch(step, r, n) for r, n in enumerate(rows)]
        x, route, y = (torch.cat(t) for t in zip(*parts))
        opt.zero_grad()
        F.cross_entropy(model(x, route), y).backward()
        p.step()
        out.append(record(model, p))
        opt.step()
    return out


@pytest.mark.parametrize(
    ("ddp", "rows", "fraction"),
    [(True, [6, 6], "comm_opt"), (False, [6, 6], "mem_opt"), (False, [7, 4], "hybrid_opt")],
)
def test_an_expert_idle_on_one_rank_equals_one_process_on_the_pooled_batch(
    ddp: bool, rows: list[int], fraction: str
) -> None:
    want = pooled(rows)
    results = run_distributed(worker, 2, ddp, rows, fraction, timeout=120)
    for rank, got in enumerate(results):
        for step, (g, w) in enumerate(zip(got, want)):
            where = f"rank {rank} step {step}"
            # Expert 2 ran nowhere: no factors, plain gradient; every other layer is preconditioned.
            assert g["ready"] == w["ready"] == ["embed", "experts.0", "experts.1", "head"], where
            assert set(g["factors"]) == set(w["factors"]), where
            for name, (a, gg) in w["factors"].items():
                torch.testing.assert_close(g["factors"][name][0], a, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(g["factors"][name][1], gg, rtol=1e-10, atol=1e-12)
            for name, grad in w["grads"].items():
                torch.testing.assert_close(
                    g["grads"][name],
                    grad,
                    rtol=1e-8,
                    atol=1e-12,
                    msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
                )
