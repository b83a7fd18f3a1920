"""Hooks meeting real model code: in-place ops after a Linear on a 3-D input, reentrant and
non-reentrant activation checkpointing, two backward passes through one graph, keyword inputs, a deepcopy of
an attached model, handler failures.

Factors are compared with dense float64 sums over the tensors the layer received (captured from a twin
model without the pattern), or with a plain run of the same model, never with the engine's own output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_bench.kfac import (
    KFACPreconditioner,
    LinearHandler,
    register_layer_type,
    unregister_layer_type,
)

D = torch.float64


def one_step(model: nn.Module, loss_fn, **kwargs) -> KFACPreconditioner:  # type: ignore[no-untyped-def]
    """One factor step with ``factor_decay=0``: the running factors are this batch's factors, under the
    ``per_example`` convention :func:`dense_linear_factors` defines (unless ``kwargs`` set another)."""
    kwargs.setdefault("factor_scaling", "per_example")
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, **kwargs)
    loss_fn(model).backward()
    p.step()
    return p


def dense_linear_factors(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_example`` A (bias column included) and G of a Linear from its input ``x`` (N, *S, in) and the
    gradient ``g`` (N, *S, out) it received: A = Σ a aᵀ / N, G = (N / T) Σ g gᵀ."""
    n = x.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    grows = g.reshape(-1, g.shape[-1])
    t = rows.shape[0] // n
    return rows.t() @ rows / n, grows.t() @ grows * n / t


def received(
    model: nn.Module, names: list[str], loss_fn
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Input and output gradient each named Linear of ``model`` received in one forward/backward."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def hook(
            m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, name: str = name
        ) -> None:
            out.retain_grad()
            seen[name] = [args[0].detach(), out]

        handles.append(module.register_forward_hook(hook))
    loss_fn(model).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return {n: (x, out.grad) for n, (x, out) in seen.items()}


# ------------------------------------------------------------------ in-place op after a 3-D Linear
def test_linear_on_a_3d_input_followed_by_an_inplace_relu_gets_exact_factors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)).to(D)
    twin = copy.deepcopy(model)
    twin[1] = nn.ReLU()  # same numbers, no in-place op: its output gradient can be retained
    x = torch.randn(2, 4, 4, dtype=D)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum()

    got = received(twin, ["0", "2"], loss)
    p = one_step(model, loss)
    for name in ("0", "2"):
        a_ref, g_ref = dense_linear_factors(*got[name])
        torch.testing.assert_close(p.layers[name].a_factor, a_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(p.layers[name].g_factor, g_ref, rtol=1e-12, atol=1e-12)
    assert p.coverage().left_out == {}


def test_inplace_op_in_the_parent_forward_on_a_3d_linear_output_gets_exact_g() -> None:
    # The in-place op is the parent's code (``h.tanh_()``), not a module: G is the gradient w.r.t. the
    # Linear's output before the op.
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 6)
            self.head = nn.Linear(6, 1)

        def forward(self, x: torch.Tensor, inplace: bool = True) -> torch.Tensor:
            h = self.fc(x)
            if inplace:
                h.tanh_()
            else:
                h = h.tanh()
            return self.head(h)

    model = Net().to(D)
    x = torch.randn(3, 5, 3, dtype=D)
    got = received(model, ["fc"], lambda m: m(x, inplace=False).pow(2).sum())
    p = one_step(model, lambda m: m(x).pow(2).sum())
    a_ref, g_ref = dense_linear_factors(*got["fc"])
    torch.testing.assert_close(p.layers["fc"].a_factor, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.layers["fc"].g_factor, g_ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ activation checkpointing
class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.embed = nn.Linear(
            4, 6
        )  # before the checkpoint: its output requires grad (as hidden states do)
        self.block = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
        self.block2 = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in (self.block, self.block2):
            if self.reentrant is None:
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_gives_the_factors_of_the_plain_run(reentrant: bool) -> None:
    torch.manual_seed(2)
    plain = Checkpointed(None).to(D)
    ckpt = copy.deepcopy(plain)
    ckpt.reentrant = reentrant
    batches = [torch.randn(5, 2, 4, dtype=D) for _ in range(2)]

    def run(model: nn.Module) -> tuple[KFACPreconditioner, int]:
        p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, accumulation_steps=2)
        for x in batches:
            (model(x).pow(2).mean() / 2).backward()
        backwards = p.capture.backwards
        p.step()
        return p, backwards

    ref, _ = run(plain)
    got, backwards = run(ckpt)
    assert (
        backwards == 2
    )  # the nested backward passes of reentrant checkpointing are not micro-batches
    assert set(got.layers) == set(ref.layers)
    for name, layer in ref.layers.items():
        torch.testing.assert_close(
            got.layers[name].a_factor, layer.a_factor, rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            got.layers[name].g_factor, layer.g_factor, rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            got.layers[name].module.weight.grad, layer.module.weight.grad, rtol=1e-10, atol=1e-12
        )
    assert got.coverage().left_out == {}


def test_a_model_entirely_under_reentrant_checkpointing_steps() -> None:
    # GPT-2 style: every K-FAC layer inside a reentrant checkpoint; step() must not say "before any backward".
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(D)
    p = KFACPreconditioner(block, kl_clip=None)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    checkpoint(block, x, use_reentrant=True).pow(2).sum().backward()
    p.step()
    assert all(layer.ready for layer in p.layers.values())


# ------------------------------------------------------------------ semantics
def test_two_backward_passes_through_one_graph_raise_naming_the_layer() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    for accumulation_steps in (1, 2):
        p = KFACPreconditioner(model, accumulation_steps=accumulation_steps)
        out = model(torch.randn(5, 3, dtype=D))
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"K-FAC layer '\d': a second backward pass"):
            out.pow(2).sum().backward()
        p.remove()
        model.zero_grad()


def test_a_second_backward_after_step_when_factors_are_not_due_is_allowed() -> None:
    model = nn.Sequential(nn.Linear(3, 2)).to(D)
    p = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    out = model(torch.randn(4, 3, dtype=D))
    out.sum().backward(retain_graph=True)
    p.step()  # step 1 collects no factors
    out.pow(2).sum().backward()


def test_keyword_input_is_captured() -> None:
    torch.manual_seed(5)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(input=x)

    model = Net().to(D)
    x = torch.randn(6, 3, dtype=D)
    got = received(model, ["fc"], lambda m: m.fc(x).pow(2).sum())
    p = one_step(model, lambda m: m(x).pow(2).sum())
    a_ref, g_ref = dense_linear_factors(*got["fc"])
    torch.testing.assert_close(p.layers["fc"].a_factor, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.layers["fc"].g_factor, g_ref, rtol=1e-12, atol=1e-12)


def test_a_deepcopy_of_the_model_does_not_feed_the_original_factors() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x = torch.randn(5, 3, dtype=D)
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None)
    model(x).pow(2).sum().backward()
    clone = copy.deepcopy(model)
    for _ in range(3):
        clone(100 * torch.randn(5, 3, dtype=D)).pow(2).sum().backward()
    p.step()
    a_ref, _ = dense_linear_factors(x, torch.zeros(5, 4, dtype=D))
    torch.testing.assert_close(p.layers["0"].a_factor, a_ref, rtol=1e-12, atol=1e-12)
    assert p.capture.backwards == 0 and p.steps == 1


def test_step_after_remove_raises() -> None:
    model = nn.Sequential(nn.Linear(3, 2)).to(D)
    p = KFACPreconditioner(model)
    model(torch.randn(4, 3, dtype=D)).sum().backward()
    p.step()
    p.remove()
    model(torch.randn(4, 3, dtype=D)).sum().backward()
    grad = model[0].weight.grad.clone()
    with pytest.raises(RuntimeError, match="remove"):
        p.step()
    torch.testing.assert_close(model[0].weight.grad, grad, rtol=0, atol=0)


# ------------------------------------------------------------------ errors name the layer
class Doubling(nn.Module):
    """Registered below as a Linear, but its output is twice as wide as its weight says."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        return torch.cat([y, y], dim=-1)


def test_a_factor_of_the_wrong_size_names_the_layer() -> None:
    register_layer_type(Doubling, LinearHandler())
    try:
        model = nn.Sequential(Doubling(), nn.Linear(8, 2)).to(D)
        KFACPreconditioner(model)
        with pytest.raises(
            RuntimeError, match=r"K-FAC layer '0' \(Doubling\): its G factor is \(8, 8\)"
        ):
            model(torch.randn(5, 3, dtype=D)).sum().backward()
    finally:
        unregister_layer_type(Doubling)
