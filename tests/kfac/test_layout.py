"""The default factor scaling ('expand') gives one step per layer whatever the layout of its input, and an
MoE expert the factors of its Fisher block, against dense float64 references (tests/kfac/reference.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

from .reference import eigen_dense

D = torch.float64
N, T, D_IN, D_OUT, CLASSES = 4, 6, 5, 3, 7
DAMPING = 1e-3


def _step(model: nn.Module, loss_fn, **kw) -> KFACPreconditioner:  # type: ignore[no-untyped-def]
    """One K-FAC step (batch factors: factor_decay=0, no KL clip) after one backward of ``loss_fn()``."""
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=DAMPING, **kw)
    loss_fn().backward()
    p.step()
    return p


class TokenModel(nn.Module):
    """A Linear on tokens, read out per token by a fixed functional head; ``layout`` says how its input is
    laid out: ``'nt'`` (N, T, d), ``'flat'`` (N·T, d) or ``'tn'`` (T, N, d)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(D_IN, D_OUT, dtype=D)
        self.head_w = nn.Parameter(torch.randn(CLASSES, D_OUT, dtype=D))
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, T, d) -> logits (N, T, classes)
        if self.layout == "flat":
            h = self.layer(x.reshape(N * T, D_IN)).reshape(N, T, D_OUT)
        elif self.layout == "tn":
            h = self.layer(x.transpose(0, 1)).transpose(0, 1)
        else:
            h = self.layer(x)
        return F.linear(torch.tanh(h), self.head_w)


def _token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, T, D_IN, dtype=D, generator=g), torch.randint(
        0, CLASSES, (N, T), generator=g
    )


def _token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1))


def test_three_layouts_of_one_linear_give_one_step_equal_to_the_dense_reference() -> None:
    x, y = _token_batch()
    steps = {}
    for layout in ("nt", "flat", "tn"):
        model = TokenModel(layout)
        _step(model, lambda m=model: _token_loss(m, x, y))
        steps[layout] = torch.cat([model.layer.weight.grad, model.layer.bias.grad[:, None]], 1)
    # Dense reference: rows a (bias 1 appended) and row gradients g of the mean token loss.
    model = TokenModel("nt")
    h = model.layer(x)
    h.retain_grad()
    logits = F.linear(torch.tanh(h), model.head_w)
    F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)).backward()
    a = torch.cat([x.reshape(-1, D_IN), torch.ones(N * T, 1, dtype=D)], 1)
    g = h.grad.reshape(-1, D_OUT)
    rows = N * T
    A, G = a.t() @ a / rows, (g.t() @ g) * rows
    grad = g.t() @ a
    ref = eigen_dense(A, G, grad, DAMPING)
    for layout, step in steps.items():
        assert (step - ref).abs().max() <= 1e-10 * ref.abs().max(), layout
    assert (steps["flat"] - steps["nt"]).abs().max() <= 1e-10 * ref.abs().max()


class Block(nn.Module):
    """Self-attention (``nn.MultiheadAttention``) and a Linear FFN on tokens, sequence-first or not; the
    same weights either way (seeded)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.attn = nn.MultiheadAttention(D_IN, 1, batch_first=batch_first, dtype=D)
        self.ffn = nn.Linear(D_IN, D_OUT, dtype=D)
        self.head_w = nn.Parameter(torch.randn(CLASSES, D_OUT, dtype=D))
        self.batch_first = batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, T, d) -> (N, T, classes)
        z = x if self.batch_first else x.transpose(0, 1)
        z = self.ffn(z + self.attn(z, z, z, need_weights=False)[0])
        z = z if self.batch_first else z.transpose(0, 1)
        return F.linear(torch.tanh(z), self.head_w)


def test_sequence_first_block_gives_the_step_of_the_batch_first_one() -> None:
    x, y = _token_batch()
    steps = []
    for batch_first in (True, False):
        model = Block(batch_first)
        _step(model, lambda m=model: _token_loss(m, x, y))
        steps.append(model.ffn.weight.grad.clone())
    scale = steps[0].abs().max()
    assert (steps[0] - steps[1]).abs().max() <= 1e-10 * scale


EXPERTS = 3


class MoE(nn.Module):
    """A top-1 router and ``EXPERTS`` Linear experts on flattened tokens (index dispatch: each expert sees
    only its own rows). ``call_idle``: an expert without tokens is called with 0 rows (else skipped)."""

    def __init__(self, call_idle: bool = True, idle: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.router = nn.Linear(D_IN, EXPERTS, dtype=D)
        self.experts = nn.ModuleList(nn.Linear(D_IN, D_OUT, dtype=D) for _ in range(EXPERTS))
        self.head_w = nn.Parameter(torch.randn(CLASSES, D_OUT, dtype=D))
        self.call_idle = call_idle
        self.idle = idle  # an expert the router never picks

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        if self.idle is not None:
            scores = scores.index_fill(1, torch.tensor([self.idle]), -1e9)
        return scores.argmax(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D_IN)
        scores = self.router(flat)
        choice = self.route(scores.detach())
        out = flat.new_zeros(flat.shape[0], D_OUT)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            if idx.numel() == 0 and not self.call_idle:
                continue
            gate = scores.softmax(1)[idx, e : e + 1]
            out = out.index_add(0, idx, expert(flat[idx]) * gate)
        return F.linear(torch.tanh(out), self.head_w).reshape(*x.shape[:-1], CLASSES)


def test_moe_expert_factors_are_its_fisher_block_linear_in_its_load() -> None:
    """An expert that received n of the L = N·T tokens: A = mean of its rows' a aᵀ, G = L·Σ g gᵀ (the
    router sees every token, so L = N·T), i.e. A ⊗ G = (n/L)·E[a aᵀ] ⊗ E[δ δᵀ] with δ = L·g."""
    x, y = _token_batch()
    model = MoE()
    p = _step(model, lambda: _token_loss(model, x, y))
    with torch.no_grad():
        choice = model.route(model.router(x.reshape(-1, D_IN)))
    # Row gradients of each expert's output, recomputed densely with hooks of the test's own.
    model.zero_grad()
    grads: dict[int, torch.Tensor] = {}
    handles = [
        e.register_full_backward_hook(lambda m, gi, go, i=i: grads.__setitem__(i, go[0].detach()))
        for i, e in enumerate(model.experts)
    ]
    _token_loss(model, x, y).backward()
    for h in handles:
        h.remove()
    L = N * T
    loads = []
    for e in range(EXPERTS):
        idx = (choice == e).nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        a = torch.cat([x.reshape(-1, D_IN)[idx], torch.ones(idx.numel(), 1, dtype=D)], 1)
        g = grads[e]
        A_ref, G_ref = a.t() @ a / idx.numel(), (g.t() @ g) * L
        state = p.layers[f"experts.{e}"]
        torch.testing.assert_close(state.a_factor, A_ref, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(state.g_factor, G_ref, rtol=1e-10, atol=1e-13)
        delta = g * L  # per-token loss gradients: G = (n/L)·mean δ δᵀ, linear in the load n
        torch.testing.assert_close(
            state.g_factor, idx.numel() / L * (delta.t() @ delta) / idx.numel(), rtol=1e-10, atol=0
        )
        loads.append(idx.numel())
    assert len(loads) >= 2 and len(set(loads)) >= 2  # experts with different loads were compared


def test_idle_moe_expert_called_with_zero_rows_is_as_if_not_called_for_60_steps() -> None:
    x, y = _token_batch()
    factors = []
    for call_idle in (True, False):
        model = MoE(call_idle=call_idle)
        p = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, lr=0.0)
        _token_loss(model, x, y).backward()  # every expert runs once
        p.step()
        model.zero_grad()
        first = p.layers["experts.0"].g_factor.clone()
        model.idle = 0
        for _ in range(60):
            _token_loss(model, x, y).backward()
            p.step()
            model.zero_grad()
        state = p.layers["experts.0"]
        torch.testing.assert_close(state.g_factor, first, rtol=0, atol=0)
        factors.append((state.a_factor.clone(), state.g_factor.clone()))
    for got, want in zip(factors[0], factors[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
