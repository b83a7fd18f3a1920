"""What the overlapped factor reduction keeps alive, read from the live tensors themselves (gloo on CPU).

Packing a bucket must free its batch factors (only the flat buffer holds them while the collective runs),
nothing may keep a layer's input gram once it is folded in (the autograd graph, and the gradient hooks on
it, outlive the backward pass while the loss is alive), and ``memory_usage()`` must count exactly what K-FAC
keeps alive at every moment it can be read: the storage of every live tensor with the preconditioner minus
the same run without it.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.comm import StepReduction

from ..distributed import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 2  # the second step is the steady state: running factors and decompositions exist
LOCAL = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 30),
        nn.Tanh(),
        nn.Linear(30, 5),
    )


def live_tensor_bytes() -> int:
    """Bytes of the storages of every live tensor, once gloo has let go of finished collectives' tensors.

    A collective returns when its result is in, but the gloo worker thread that ran it holds its tensors
    until it frees the work a moment later: a heap walk in that moment counts them (the last gradient
    all-reduced, a bucket ``step()`` already dropped). The walk is repeated, with a pause for that thread,
    until two agree; what K-FAC itself keeps alive does not change between them."""
    now = _walk()
    for _ in range(100):
        time.sleep(0.01)
        now, before = _walk(), now
        if now == before:
            break
    return now


def _walk() -> int:
    """Bytes of the storages of every tensor a Python object refers to (each storage once)."""
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on some modules' lazy attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                s = obj.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


class AfterEachHook:
    """Calls ``fn`` right after each K-FAC layer's gradient hook: a prehook on the node that produced the
    layer's output, registered after the preconditioner's (hooks of a node run in registration order)."""

    def __init__(self, modules: list[nn.Module], fn: Any) -> None:
        self.fn = fn
        for m in modules:
            m.register_forward_hook(self._forward_hook)

    def _forward_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.grad_fn is not None:
            output.grad_fn.register_prehook(lambda _: self.fn())


def run_arm(
    rank: int, options: dict[str, Any], kfac: bool
) -> tuple[list[int], list[dict[str, int]]]:
    """Train ``STEPS`` steps, with K-FAC (``options``) or without; at every moment ``memory_usage()`` can
    be read, the live tensor bytes above those at the start, and ``memory_usage()``. A function of its
    own, so that nothing of one arm outlives it into the other."""
    start = live_tensor_bytes()
    model = make_model()
    p = KFACPreconditioner(model, **options) if kfac else None
    micro = options.get("accumulation_steps", 1)
    live: list[int] = []
    usage: list[dict[str, int]] = []

    def moment() -> None:
        live.append(live_tensor_bytes() - start)
        if p is not None:
            usage.append(p.memory_usage())

    AfterEachHook([m for m in model if isinstance(m, (nn.Linear, nn.Conv2d))], moment)
    for step in range(STEPS):
        model.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        for _ in range(micro):
            x = torch.randn(LOCAL, 3, 8, 8, generator=g)
            y = torch.randint(0, 5, (LOCAL,), generator=g)
            loss = F.cross_entropy(model(x), y) / micro
            moment()
            loss.backward()
            moment()  # the loss, and with it the graph and its hooks, still alive
        for prm in model.parameters():
            torch.distributed.all_reduce(prm.grad)
        if p is not None:
            p.step()
        moment()
    return live, usage


def accounting_worker(rank: int, world: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """The K-FAC arm's extra live bytes over the same loop without K-FAC, at every moment, next to its
    ``memory_usage()``. The heap this forked rank inherited (every module and object of the pytest worker
    it was forked from) is frozen first: ``gc.get_objects()`` skips frozen objects, so each heap walk sees
    only what this rank created, and costs as much as that."""
    gc.collect()
    gc.freeze()
    sgd, _ = run_arm(rank, options, kfac=False)
    kfac, usage = run_arm(rank, options, kfac=True)
    return [
        {"kfac_live": k - s, "memory_usage": u} for k, s, u in zip(kfac, sgd, usage, strict=True)
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"grad_worker_fraction": "mem_opt", "factor_reduction": "reduce"},
        {
            "accumulation_steps": 2,
            "allreduce_bucket_cap_mb": 0.002,
            "symmetry_aware": True,
            "comm_dtype": torch.bfloat16,
        },
    ],
)
def test_memory_usage_counts_exactly_the_tensors_kfac_keeps_alive(options: dict[str, Any]) -> None:
    micro = options.get("accumulation_steps", 1)
    for rank_moments in run_distributed(accounting_worker, 2, options):
        # After every forward, gradient hook (4 layers) and backward pass, and after every step().
        assert len(rank_moments) == STEPS * (micro * (1 + 4 + 1) + 1)
        for i, m in enumerate(rank_moments):
            assert m["kfac_live"] == m["memory_usage"]["total"], (i, m)
        assert max(m["memory_usage"]["comm_buffers"] for m in rank_moments) > 0


def release_worker(rank: int, world: int) -> list[dict[str, Any]]:
    model = make_model()
    # Buckets of 2621 float32 elements: the last layer's factors (5², 31²) wait for the next layer's G.
    p = KFACPreconditioner(model, allreduce_bucket_cap_mb=0.01)
    handed: dict[str, weakref.ref[torch.Tensor]] = {}
    grams: list[weakref.ref[torch.Tensor]] = []
    original = StepReduction.add

    def add(self: StepReduction, key: str, tensor: torch.Tensor, count: int = 1) -> None:
        handed[key] = weakref.ref(tensor)
        original(self, key, tensor, count)

    checks: list[dict[str, Any]] = []

    def check() -> None:
        r = p.curvature._step_reduction
        launched = {k for f in r.pending for k in f.bucket.keys} if r is not None else set()
        checks.append(
            {
                "launched": sorted(launched),
                "launched_alive": sorted(k for k in launched if handed[k]() is not None),
                "waiting_alive": sorted(
                    k for k in handed if k not in launched and handed[k]() is not None
                ),
                "waiting": sorted(r.tensors) if r is not None else [],
            }
        )

    AfterEachHook([s.module for s in p.layers.values()], check)
    x = torch.randn(LOCAL, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 5, (LOCAL,))
    with mock.patch.object(StepReduction, "add", add):
        loss = F.cross_entropy(model(x), y)
        # A call holds its input gram, or (batched with same-shaped calls) the input held for its batch.
        grams += [
            weakref.ref(c.a.sum if c.a is not None else c.held.x)
            for s in p.layers.values()
            for c in s.calls
        ]
        loss.backward()
    end = {
        "handed_alive": sorted(k for k, ref in handed.items() if ref() is not None),
        "grams_alive": sum(ref() is not None for ref in grams),
        "grams": len(grams),
        "buckets": len(p.comm.buckets),
    }
    del loss
    p.step()
    return [checks, end]


def test_a_launched_bucket_no_longer_holds_its_batch_factors() -> None:
    for checks, end in run_distributed(release_worker, 2):
        # After each gradient hook: a launched bucket's factors are gone, the waiting ones are alive.
        for c in checks:
            assert c["launched_alive"] == [], c
            assert c["waiting_alive"] == c["waiting"], c
        assert checks[-1]["waiting"] == [] and len(checks[-1]["launched"]) == 8
        assert any(c["waiting"] for c in checks) and end["buckets"] > 1
        # With the loss (and so the graph and its hooks) alive: no batch factor, no input gram survives.
        assert end["handed_alive"] == []
        assert end["grams"] == 4 and end["grams_alive"] == 0
