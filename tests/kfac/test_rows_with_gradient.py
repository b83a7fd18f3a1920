"""Rows count only when their gradient arrives (default ``'expand'`` scaling): forwards under ``no_grad``,
grad-enabled forwards whose output is never backpropagated, extra forwards between accumulated
micro-batches and reentrant checkpointing's recomputation leave L and every factor as the dense float64
factors of the forwards that were backpropagated (hooks of the test's own, never the engine's output)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_bench.kfac import KFACPreconditioner

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

D = torch.float64
N, T, D_IN = 4, 3, 5
NAMES = ("embed", "block.0", "block.2", "head")


class Net(nn.Module):
    """Token layers (N·T rows each: L = N·T), a block that may run under reentrant checkpointing, and a
    head on the pooled sequence (N rows, fewer than L)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D_IN, 6)
        self.block = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6))
        self.head = nn.Linear(6, 2)
        self.reentrant = reentrant
        self.to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = h + (checkpoint(self.block, h, use_reentrant=True) if self.reentrant else self.block(h))
        return self.head(h.mean(1))


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, D_IN, dtype=D, generator=g), torch.randn(n, 2, dtype=D, generator=g)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int = 1) -> torch.Tensor:
    return F.mse_loss(model(x), y) / k


def dense_factors(
    model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``'expand'`` A and G of every layer from its inputs and output gradients in plain backward passes
    of ``micro_batches`` (each loss divided by their number): A = Σ a aᵀ / R, G = (Σ L) · Σ g gᵀ, with L
    the rows of the token layers (N·T) of each micro-batch."""
    twin = Net()
    twin.load_state_dict(model.state_dict())
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in NAMES}
    k = len(micro_batches)

    def capture(name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            out.retain_grad()
            seen[name].append((args[0].detach(), out))

        return hook

    handles = [twin.get_submodule(n).register_forward_hook(capture(n)) for n in NAMES]
    terms = 0
    for x, y in micro_batches:
        loss(twin, x, y, k).backward()
        terms += x.shape[0] * T
    for h in handles:
        h.remove()
    out = {}
    for name, calls in seen.items():
        a = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in calls])
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
        g = torch.cat([o.grad.reshape(-1, o.shape[-1]) for _, o in calls])
        out[name] = (a.t() @ a / a.shape[0], terms * (g.t() @ g))
    return out


def assert_factors(
    p: KFACPreconditioner, want: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    for name, (a, g) in want.items():
        state = p.layers[name]
        torch.testing.assert_close(state.a_factor, a, rtol=1e-10, atol=1e-13, msg=f"{name} A")
        torch.testing.assert_close(state.g_factor, g, rtol=1e-10, atol=1e-13, msg=f"{name} G")


def engine(model: nn.Module, k: int = 1) -> KFACPreconditioner:
    return KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, accumulation_steps=k)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_no_grad_forward_on_a_larger_batch_before_the_step_counts_nowhere(
    reentrant: bool,
) -> None:
    model = Net(reentrant)
    p = engine(model)
    real, other = batch(N, 1), batch(8 * N, 2)
    with torch.no_grad():  # train-mode metrics, pseudo-labels: 32 examples, never backpropagated
        model(other[0])
    loss(model, *real).backward()
    p.step()
    assert_factors(p, dense_factors(model, [real]))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_discarded_grad_enabled_forward_counts_nowhere(reentrant: bool) -> None:
    model = Net(reentrant)
    p = engine(model)
    real, other = batch(N, 1), batch(3 * N, 2)
    kept = model(other[0])  # its graph is alive during the backward pass, but never reached by it
    loss(model, *real).backward()
    p.step()
    assert_factors(p, dense_factors(model, [real]))
    del kept


@pytest.mark.parametrize("reentrant", [False, True])
def test_extra_forwards_between_accumulated_micro_batches_count_nowhere(reentrant: bool) -> None:
    model = Net(reentrant)
    p = engine(model, k=2)
    first, second = batch(N, 1), batch(N + 2, 3)
    loss(model, *first, k=2).backward()
    with torch.no_grad():
        model(batch(5 * N, 4)[0])
    discarded = model(batch(2 * N, 5)[0])
    loss(model, *second, k=2).backward()
    p.step()
    assert p.capture.terms() == 0
    assert_factors(p, dense_factors(model, [first, second]))
    del discarded


def test_two_forwards_then_two_backward_passes_count_each_in_its_own_pass() -> None:
    # The forward of the second micro-batch runs before the first backward: it counts in the second.
    model = Net()
    p = engine(model, k=2)
    first, second = batch(N, 1), batch(2 * N, 3)
    l1, l2 = loss(model, *first, k=2), loss(model, *second, k=2)
    l1.backward()
    l2.backward()
    p.step()
    assert_factors(p, dense_factors(model, [first, second]))
