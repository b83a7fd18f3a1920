"""Distributed K-FAC computes what a single process computes, for every KAISA strategy (gloo on CPU)."""

from __future__ import annotations

import itertools
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
LOCAL_BATCH = 4
STEPS = 5  # factors every step; decompositions at steps 0, 2, 4 (1 and 3 reuse them)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 8),
        nn.Tanh(),
        nn.Linear(8, 5),
    ).to(D)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = LOCAL_BATCH * world
    return torch.randn(n, 3, 8, 8, generator=g, dtype=D), torch.randint(0, 5, (n,), generator=g)


def kfac_kwargs(**overrides: Any) -> dict[str, Any]:
    return (
        dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=0.001, lr=0.1)
        | overrides
    )


def train(
    model: nn.Module,
    precond: KFACPreconditioner,
    world: int,
    rank: int,
    steps: range,
    sync_grads: bool,
) -> list[list[torch.Tensor]]:
    """SGD + K-FAC on this rank's slice of each global batch; returns the gradients after ``step()``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorded = []
    for s in steps:
        x, y = global_batch(s, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        if sync_grads:  # a plain module: average the gradients ourselves, as DDP would
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        recorded.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return recorded


def reference(world: int, scaling: str, method: str) -> list[list[torch.Tensor]]:
    """One process. 'per_example': the concatenated global batch. 'kaisa': the same local-batch semantics
    (one micro-batch per rank, each loss a mean over the local batch, gradients averaged)."""
    model = make_model()
    p = KFACPreconditioner(
        model,
        **kfac_kwargs(
            compute_method=method,
            factor_scaling=scaling,
            accumulation_steps=world if scaling == "kaisa" else 1,
        ),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorded = []
    for s in range(STEPS):
        x, y = global_batch(s, world)
        opt.zero_grad()
        if scaling == "per_example":
            F.cross_entropy(model(x), y).backward()
        else:
            for xs, ys in zip(x.split(LOCAL_BATCH), y.split(LOCAL_BATCH)):
                F.cross_entropy(model(xs), ys).backward()
            for prm in model.parameters():
                prm.grad /= world
        p.step()
        recorded.append([prm.grad.clone() for prm in model.parameters()])
        opt.step()
    return recorded


def strategies(world: int) -> list[float]:
    return sorted({1.0, 0.5 if world >= 2 else 1.0, 1.0 / world})


CONFIGS = [
    dict(fraction=f, method=m, ddp=d, reduction=r, scaling="per_example")
    for f, m, d, r in itertools.product(
        ["comm_opt", "hybrid_opt", "mem_opt"],
        ["eigen", "inverse"],
        [True, False],
        ["allreduce", "reduce"],
    )
] + [
    dict(fraction=f, method="eigen", ddp=True, reduction="allreduce", scaling="kaisa")
    for f in ["comm_opt", "mem_opt"]
]


def equivalence_worker(rank: int, world: int) -> dict[int, Any]:
    out = {}
    for i, cfg in enumerate(CONFIGS):
        model = make_model()
        wrapped = nn.parallel.DistributedDataParallel(model) if cfg["ddp"] else model
        precond = KFACPreconditioner(
            wrapped,
            **kfac_kwargs(
                compute_method=cfg["method"],
                grad_worker_fraction=cfg["fraction"],
                factor_reduction=cfg["reduction"],
                factor_scaling=cfg["scaling"],
            ),
        )
        grads = train(
            wrapped if cfg["ddp"] else model, precond, world, rank, range(STEPS), not cfg["ddp"]
        )
        out[i] = {"grads": grads, "params": [p.detach().clone() for p in model.parameters()]}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_strategy_equals_a_single_process(world: int) -> None:
    results = run_distributed(equivalence_worker, world, timeout=240)
    refs = {
        (s, m): reference(world, s, m)
        for s in ("per_example", "kaisa")
        for m in ("eigen", "inverse")
    }
    for i, cfg in enumerate(CONFIGS):
        ref = refs[(cfg["scaling"], cfg["method"])]
        for rank, res in enumerate(results):
            for step, (got, want) in enumerate(zip(res[i]["grads"], ref)):
                for g, w in zip(got, want):
                    torch.testing.assert_close(
                        g,
                        w,
                        rtol=1e-5,
                        atol=1e-9,
                        msg=lambda m, c=cfg, r=rank, s=step: f"{c} rank {r} step {s}: {m}",
                    )
        for res in results[1:]:  # parameters stay identical across ranks
            for a, b in zip(res[i]["params"], results[0][i]["params"]):
                assert torch.equal(a, b), cfg


def counting_worker(rank: int, world: int, fraction: str, reduction: str) -> dict[str, Any]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    p = KFACPreconditioner(
        ddp,
        **kfac_kwargs(
            factor_update_steps=2,
            inv_update_steps=4,
            grad_worker_fraction=fraction,
            factor_reduction=reduction,
        ),
    )
    per_step = []
    for s in range(8):
        before = dict(p.comm.counts)
        train(ddp, p, world, rank, range(s, s + 1), sync_grads=False)
        per_step.append(
            {k: v - before.get(k, 0) for k, v in p.comm.counts.items() if v - before.get(k, 0)}
        )
    return {
        "per_step": per_step,
        "memory": p.memory_usage(),
        "plan": {n: s.work for n, s in p.layers.items()},
    }


@pytest.mark.parametrize("fraction", ["comm_opt", "hybrid_opt", "mem_opt"])
def test_collectives_run_only_when_scheduled(fraction: str) -> None:
    world = 4
    results = run_distributed(counting_worker, world, fraction, "allreduce")
    m = {"comm_opt": 4, "hybrid_opt": 2, "mem_opt": 1}[fraction]
    for res in results:
        for s, counts in enumerate(res["per_step"]):
            assert (counts.get("factor_allreduce", 0) > 0) == (s % 2 == 0), (s, counts)
            # A decomposition broadcast happens on decomposition steps, and only inside blocks of > 1 rank.
            assert (counts.get("decomposition_broadcast", 0) > 0) == (s % 4 == 0 and m > 1), (
                s,
                counts,
            )
            # The preconditioned gradient is broadcast every step exactly when fraction < 1: one per layer.
            assert counts.get("grad_broadcast", 0) == (4 if m < world else 0), (s, counts)


def test_memory_follows_the_strategy() -> None:
    """MEM-OPT: each rank holds the decompositions of its own layers only; 'reduce': only owned factors."""
    world = 4
    mem = run_distributed(counting_worker, world, "mem_opt", "reduce")
    comm = run_distributed(counting_worker, world, "comm_opt", "allreduce")
    plan = comm[0]["plan"]
    for res in comm[1:] + mem[1:]:  # every rank computed the same placement without communicating
        assert res["plan"] == (comm[0] if res in comm else mem[0])["plan"]
    eig = {
        n: 8 * (w.a_dim**2 + w.a_dim + w.g_dim**2 + w.g_dim + w.a_dim * w.g_dim)
        for n, w in plan.items()
    }
    fac = {n: 8 * (w.a_dim**2 + w.g_dim**2) for n, w in plan.items()}
    for rank in range(world):
        assert comm[rank]["memory"]["decompositions"] == sum(eig.values())
        assert comm[rank]["memory"]["factors"] == sum(fac.values())
        mplan = mem[rank]["plan"]
        mine = [n for n, w in mplan.items() if w.grad_workers == (rank,)]
        assert mem[rank]["memory"]["decompositions"] == sum(eig[n] for n in mine)
        owned = sum(
            8 * w.a_dim**2 * (w.a_owner == rank) + 8 * w.g_dim**2 * (w.g_owner == rank)
            for w in mplan.values()
        )
        assert mem[rank]["memory"]["factors"] == owned
    total = sum(m["memory"]["decompositions"] for m in mem)
    assert total == sum(eig.values())  # together the ranks hold each decomposition exactly once


def checkpoint_worker(
    rank: int, world: int, fraction: str, reduction: str, stop: int
) -> list[torch.Tensor]:
    """Train ``stop`` steps, checkpoint, resume in a fresh model + preconditioner, and compare with an
    uninterrupted run. Gradients are averaged per parameter rather than by DDP: DDP rebuilds its buckets
    after the first iteration of a new wrapper, which changes the summation order of a 4-rank all-reduce
    in the last bit and would hide whether K-FAC itself resumes exactly."""
    kwargs = kfac_kwargs(
        inv_update_steps=3, grad_worker_fraction=fraction, factor_reduction=reduction
    )
    model = make_model()
    p = KFACPreconditioner(model, **kwargs)
    train(model, p, world, rank, range(stop), sync_grads=True)
    state = p.state_dict(include_decompositions=True)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    p.remove()
    resumed = make_model()
    resumed.load_state_dict(model_state)
    p2 = KFACPreconditioner(resumed, **kwargs)
    p2.load_state_dict(state)
    train(resumed, p2, world, rank, range(stop, STEPS + 2), sync_grads=True)
    full = make_model()
    p3 = KFACPreconditioner(full, **kwargs)
    train(full, p3, world, rank, range(STEPS + 2), sync_grads=True)
    return [
        torch.stack([(a - b).abs().max() for a, b in zip(resumed.parameters(), full.parameters())])
    ]


@pytest.mark.parametrize(
    ("world", "fraction", "reduction"), [(2, "mem_opt", "reduce"), (4, "hybrid_opt", "allreduce")]
)
def test_checkpoint_on_n_ranks_resumes_identically(
    world: int, fraction: str, reduction: str
) -> None:
    for res in run_distributed(checkpoint_worker, world, fraction, reduction, 4):
        assert res[0].max().item() == 0.0


def failing_worker(rank: int, world: int) -> None:
    model = make_model()
    p = KFACPreconditioner(model, grad_worker_fraction="mem_opt")
    if rank == 1:

        def boom(*args: Any) -> None:
            raise RuntimeError("injected failure inside step() on rank 1")

        p.gradients.precondition = boom  # type: ignore[method-assign]
    train(model, p, world, rank, range(3), sync_grads=True)


def test_a_failing_rank_fails_the_test_instead_of_hanging() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed[\s\S]*injected failure"):
        run_distributed(failing_worker, 2, timeout=60)


def test_fraction_that_does_not_divide_the_world_names_the_valid_ones() -> None:
    with pytest.raises(RuntimeError, match=r"valid fractions here: 1/4, 2/4, 4/4"):
        run_distributed(_bad_fraction_worker, 4, timeout=60)


def _bad_fraction_worker(rank: int, world: int) -> None:
    KFACPreconditioner(make_model(), grad_worker_fraction=0.75)
