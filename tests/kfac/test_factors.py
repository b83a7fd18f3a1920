"""Factors computed by the engine's hooks equal the definitions computed from per-example quantities."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

from .reference import kfac_factors, per_example_output_grads, vec

D = torch.float64


class Probe(nn.Module):
    """``layer`` followed by a fixed linear read-out (used functionally, so it is not a K-FAC layer)."""

    def __init__(self, layer: nn.Module, out_features: int, classes: int = 5) -> None:
        super().__init__()
        self.layer = layer
        self.head_w = nn.Parameter(torch.randn(classes, out_features, dtype=D) * 0.3)

    def head(self, y: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(y).flatten(1), self.head_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def engine_factors(model: Probe, x: torch.Tensor, y: torch.Tensor, scaling: str, splits: int = 1):  # type: ignore[no-untyped-def]
    """Running factors after one step with factor_decay=0 (= the batch factors), over ``splits``
    micro-batches."""
    p = KFACPreconditioner(
        model, factor_decay=0.0, factor_scaling=scaling, accumulation_steps=splits, kl_clip=None
    )
    for xs, ys in zip(x.chunk(splits), y.chunk(splits)):
        (F.cross_entropy(model(xs), ys) / splits).backward()
    p.step()
    state = p.layers["layer"]
    return state.a_factor, state.g_factor


CASES = {
    "linear": (lambda: nn.Linear(6, 4, dtype=D), (8, 6), 4),
    "linear_nobias": (lambda: nn.Linear(6, 4, bias=False, dtype=D), (8, 6), 4),
    "linear_seq": (lambda: nn.Linear(6, 4, dtype=D), (8, 3, 6), 12),
    "linear_seq2": (lambda: nn.Linear(6, 4, dtype=D), (8, 2, 3, 6), 24),
    "conv": (lambda: nn.Conv2d(3, 4, 3, dtype=D), (8, 3, 7, 7), 4 * 25),
    "conv_stride_pad": (
        lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, dtype=D),
        (8, 3, 7, 7),
        4 * 16,
    ),
    "conv_dilation": (
        lambda: nn.Conv2d(2, 3, 3, dilation=2, padding=2, dtype=D),
        (8, 2, 7, 6),
        3 * 42,
    ),
    "conv_same_even": (
        lambda: nn.Conv2d(2, 3, 4, padding="same", bias=False, dtype=D),
        (8, 2, 6, 6),
        108,
    ),
    "conv_reflect": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect", dtype=D),
        (8, 2, 5, 5),
        75,
    ),
    "conv_1x1_stride": (lambda: nn.Conv2d(3, 5, 1, stride=2, dtype=D), (8, 3, 6, 6), 45),
}


@pytest.mark.parametrize("scaling", ["expand", "per_example", "kaisa"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_factors_match_per_example_definition(case: str, scaling: str) -> None:
    make, shape, out_features = CASES[case]
    model = Probe(make(), out_features)
    x = torch.randn(*shape, dtype=D)
    y = torch.randint(0, 5, (shape[0],))
    A, G = engine_factors(model, x, y, scaling)
    model.zero_grad()
    delta = per_example_output_grads(model.layer, x, model.head, y)
    A_ref, G_ref = kfac_factors(model.layer, x, delta, scaling)
    torch.testing.assert_close(A, A_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scaling", ["expand", "per_example", "kaisa"])
@pytest.mark.parametrize("case", ["linear", "linear_seq", "conv_stride_pad", "conv_same_even"])
def test_factors_do_not_depend_on_batch_split(case: str, scaling: str) -> None:
    """1 micro-batch of 64 and 4 accumulated micro-batches of 16 (loss / 4) give the same A and G."""
    make, shape, out_features = CASES[case]
    model = Probe(make(), out_features)
    x = torch.randn(64, *shape[1:], dtype=D)
    y = torch.randint(0, 5, (64,))
    A1, G1 = engine_factors(model, x, y, scaling, splits=1)
    model.zero_grad()
    A4, G4 = engine_factors(model, x, y, scaling, splits=4)
    torch.testing.assert_close(A1, A4, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(G1, G4, rtol=1e-10, atol=1e-13)


def test_single_example_kronecker_product_is_the_fisher_block() -> None:
    """For one example of a Linear layer, A ⊗ G is exactly vec(∇W) vec(∇W)ᵀ of the per-sample gradient
    (computed with torch.func), the empirical Fisher block K-FAC approximates."""
    model = Probe(nn.Linear(5, 3, dtype=D), 3)
    x = torch.randn(1, 5, dtype=D)
    y = torch.randint(0, 5, (1,))
    A, G = engine_factors(model, x, y, "per_example")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (xb.unsqueeze(0),))
        return F.cross_entropy(out, yb.unsqueeze(0))

    grads = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)
    gw = torch.cat([grads["layer.weight"][0], grads["layer.bias"][0].unsqueeze(1)], dim=1)
    fisher = torch.outer(vec(gw), vec(gw))
    torch.testing.assert_close(torch.kron(A, G), fisher, rtol=1e-10, atol=1e-12)


def test_first_update_starts_from_identity_and_keeps_decay_of_old() -> None:
    model = Probe(nn.Linear(4, 3, dtype=D), 3)
    p = KFACPreconditioner(model, factor_decay=0.9, kl_clip=None)
    batches = []
    for _ in range(2):
        x, y = torch.randn(6, 4, dtype=D), torch.randint(0, 5, (6,))
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        p.step()
        batches.append(kfac_factors(model.layer, x, torch.zeros(6, 3, dtype=D), "per_example")[0])
    eye = torch.eye(5, dtype=D)
    expected = 0.9 * (0.9 * eye + 0.1 * batches[0]) + 0.1 * batches[1]
    torch.testing.assert_close(p.layers["layer"].a_factor, expected)


def test_low_precision_activations_accumulate_into_float32_factors() -> None:
    layer = nn.Linear(8, 4).to(torch.bfloat16)
    p = KFACPreconditioner(nn.Sequential(layer), kl_clip=None)
    assert p.factor_dtype == torch.float32
    x = torch.randn(16, 8).to(torch.bfloat16)
    layer(x).float().pow(2).mean().backward()
    p.step()
    a = p.layers["0"].a_factor
    assert a is not None and a.dtype == torch.float32
    rows = torch.cat([x.float(), torch.ones(16, 1)], dim=1)
    torch.testing.assert_close(a, 0.95 * torch.eye(9) + 0.05 * rows.t() @ rows / 16)
