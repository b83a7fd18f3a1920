"""``factor_position_fraction``: conv factors from a random subset of the rows of output positions.

Exact at 1; each drawn subset's factors are those of its positions scaled by ``H_out / k``, so the average
over every possible draw is the exact factor; A and G of a call use the same rows; the same on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.layers.conv2d import Conv2dHandler
from kfac_bench.kfac.subsample import PositionSubset

from .test_distributed import make_model  # the same small conv + linear net in float64
from .test_subsample import batch, factors, run

D = torch.float64
HANDLER = Conv2dHandler()


def patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Every patch of ``x`` under ``conv`` as (N, H_out, W_out, D): im2col written out, padding included."""
    left, right, top, bottom = conv._reversed_padding_repeated_twice
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, (left, right, top, bottom), mode=mode)
    cols = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    out = conv(x)
    return cols.transpose(1, 2).reshape(x.shape[0], out.shape[2], out.shape[3], -1)


CONVS = {
    "3x3 pad 1": lambda: nn.Conv2d(3, 4, 3, padding=1),
    "stride 2": lambda: nn.Conv2d(3, 4, 3, stride=2, bias=False),
    "dilation 2": lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2),
    "same, even kernel": lambda: nn.Conv2d(3, 4, (4, 2), padding="same"),
    "reflect": lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
    "1x1 stride 2": lambda: nn.Conv2d(3, 4, 1, stride=2),
}


@pytest.mark.parametrize("name", CONVS)
def test_rows_gram_is_the_gram_of_the_patches_of_those_rows(name: str) -> None:
    conv = CONVS[name]().to(D)
    x = torch.randn(5, 3, 9, 8, dtype=D)
    p = patches(conv, x)
    bias = conv.bias is not None
    if bias:
        p = torch.cat([p, torch.ones(*p.shape[:3], 1, dtype=D)], dim=3)
    last = p.shape[1] - 1
    for rows in ([0, 2, last], [1, 2, 3], [0, 1, last - 1, last], list(range(last + 1))):
        sel = p[:, rows].reshape(-1, p.shape[3])
        gram = HANDLER.a_gram_rows(conv, x, D, bias, torch.tensor(rows))
        torch.testing.assert_close(gram.sum, sel.t() @ sel, rtol=1e-12, atol=1e-10)
        assert (gram.examples, gram.positions) == (5, len(rows) * p.shape[2])


@pytest.mark.parametrize("name", ["3x3 pad 1", "stride 2", "same, even kernel"])
def test_the_average_over_every_draw_is_the_exact_factor(name: str) -> None:
    """The rule draws a cyclic block of k rows from a uniform start row: averaged over the H_out starts,
    the scaled factors of the blocks are the exact factors, for every k."""
    conv = CONVS[name]().to(D)
    x = torch.randn(4, 3, 8, 8, dtype=D)
    out = conv(x)
    g = torch.randn_like(out)
    out_h, bias = out.shape[2], conv.bias is not None
    exact_a = HANDLER.a_gram(conv, x, D, bias)
    exact_g = HANDLER.g_gram(conv, g, D)
    for k in range(1, out_h):
        draws = [PositionSubset.block(out_h, k, start) for start in range(out_h)]
        a = [PositionSubset.a_gram(HANDLER, conv, x, D, bias, r, out_h) for r in draws]
        gg = [PositionSubset.g_gram(HANDLER, conv, g, D, r) for r in draws]
        assert {(q.examples, q.positions) for q in a + gg} == {(4, exact_a.positions)}
        mean_a = torch.stack([q.sum for q in a]).mean(0)
        mean_g = torch.stack([q.sum for q in gg]).mean(0)
        torch.testing.assert_close(mean_a, exact_a.sum, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(mean_g, exact_g.sum, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(a[0].sum, exact_a.sum)  # one draw is an estimate, not the factor


def test_fraction_one_is_the_exact_path_bit_for_bit() -> None:
    default, _ = run(4, inv_update_steps=2)
    one, _ = run(4, inv_update_steps=2, factor_position_fraction=1.0)
    for a, b in zip(default, one):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_and_g_of_a_call_use_the_same_drawn_rows() -> None:
    """With factor_decay=0 the running factors are the batch factors ('per_example': A = (1/N) Σ p pᵀ,
    G = (N/T) Σ g gᵀ over every position); below 1 both sums run over the drawn rows, times H_out / k."""
    model = make_model()
    conv = model[0]
    seen: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["x"] = args[0].detach()
        out.retain_grad()
        seen["out"] = out

    conv.register_forward_hook(keep)
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, factor_position_fraction=0.5)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    p.step()
    out = seen["out"]
    n, _, out_h, out_w = out.shape
    rows = PositionSubset(0.5, lambda: 0).rows("0", 0, out_h, out.device)
    assert rows is not None and rows.numel() == 4
    pt = patches(conv, seen["x"])[:, rows].reshape(-1, 27)
    pt = torch.cat([pt, torch.ones(pt.shape[0], 1, dtype=D)], dim=1)
    gt = out.grad[:, :, rows].transpose(0, 1).reshape(conv.out_channels, -1)
    scale = out_h / rows.numel()
    torch.testing.assert_close(p.layers["0"].a_factor, scale * pt.t() @ pt / n)
    torch.testing.assert_close(p.layers["0"].g_factor, scale * (n / (out_h * out_w)) * gt @ gt.t())
    # the Linear layers keep every position (they have none): their factors are the exact ones
    model2 = make_model()
    exact = KFACPreconditioner(model2, factor_decay=0.0, kl_clip=None)
    F.cross_entropy(model2(x), y).backward()
    exact.step()
    for key in ("5", "7"):
        assert torch.equal(p.layers[key].a_factor, exact.layers[key].a_factor)
        assert torch.equal(p.layers[key].g_factor, exact.layers[key].g_factor)


@pytest.mark.parametrize("scaling", ["per_example", "kaisa"])
def test_factors_over_many_steps_approach_the_exact_factors(scaling: str) -> None:
    """The same batch and weights for many steps: every step draws anew, and the mean of the batch
    factors approaches the exact ones (the draws are seeded by the step: deterministic)."""
    kw: dict[str, Any] = dict(factor_decay=0.0, kl_clip=None, factor_scaling=scaling)
    x, y = batch(0)
    model = make_model()
    exact = KFACPreconditioner(model, **kw)
    F.cross_entropy(model(x), y).backward()
    exact.step()
    want = factors(exact)
    model = make_model()
    sub = KFACPreconditioner(model, inv_update_steps=10_000, factor_position_fraction=0.5, **kw)
    loss = F.cross_entropy(model(x), y)
    sums: dict[str, torch.Tensor] = {}
    steps = 100
    for s in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sub.step()
        got = factors(sub)
        if s == 0:
            first = {k: v.clone() for k, v in got.items()}
        for k, v in got.items():
            sums[k] = sums.get(k, 0) + v
    del loss
    for key in ("0/a", "0/g", "2/a", "2/g"):
        one = (first[key] - want[key]).norm() / want[key].norm()
        mean = (sums[key] / steps - want[key]).norm() / want[key].norm()
        assert one > 0.02, key  # a single draw is noticeably off ...
        assert mean < one / 5, (key, float(one), float(mean))  # ... the mean of 100 is not
    for key in ("5/a", "5/g", "7/a", "7/g"):
        torch.testing.assert_close(sums[key] / steps, want[key], msg=key)


# Resume with positions drawn: tests/kfac/test_subsample.py::test_resume_continues_identically.


def test_draws_differ_by_step_layer_and_micro_batch() -> None:
    step = [0]
    s = PositionSubset(0.25, lambda: step[0])
    first = s.rows("conv1", 0, 32, torch.device("cpu"))
    assert first is not None and first.numel() == 8 and first.unique().numel() == 8
    assert torch.equal(s.rows("conv1", 0, 32, torch.device("cpu")), first)
    others = [
        s.rows("conv2", 0, 32, torch.device("cpu")),
        s.rows("conv1", 1, 32, torch.device("cpu")),
    ]
    step[0] = 1
    others.append(s.rows("conv1", 0, 32, torch.device("cpu")))
    assert all(o is not None and not torch.equal(o, first) for o in others)
    assert s.rows("conv1", 0, 2, torch.device("cpu")) is not None  # round(0.5) -> at least one row
    assert PositionSubset(0.9, lambda: 0).rows("c", 0, 4, torch.device("cpu")) is None


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_fraction_outside_zero_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="factor_position_fraction"):
        KFACPreconditioner(make_model(), factor_position_fraction=fraction)


# Two ranks drawing positions: tests/kfac/test_subsample.py::test_ranks_agree_and_average_their_drawn_subsets.
