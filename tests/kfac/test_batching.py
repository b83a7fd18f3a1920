"""Same-shaped calls computed together (:mod:`kfac_bench.kfac.batching`) give the per-call factors.

The CPU computes each call on arrival (:data:`~kfac_bench.kfac.batching.HOLD`); the tests here hold calls
on the CPU as a GPU does, so the batched path is the one they compare.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_bench.kfac import KFACPreconditioner, batching
from kfac_bench.kfac.batching import PendingGrams
from kfac_bench.kfac.layers import Gram


@pytest.fixture(autouse=True)
def _hold_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(batching.HOLD, "cpu", True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def _factors(
    batched: bool, monkeypatch: pytest.MonkeyPatch, twice: bool
) -> dict[str, torch.Tensor]:
    """Running factors after two steps of two micro-batches (each micro-batch two forwards if ``twice``)."""
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(PendingGrams, "key", staticmethod(lambda layer, x: None))
        model = _model()
        p = KFACPreconditioner(model, accumulation_steps=2, factor_scaling="per_example")
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                x = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
                loss = model(x).square().sum()
                if twice:
                    loss = loss + model(x.flip(0) * 0.5).sum()
                loss.backward()
            p.step()
        return {f"{n}/{k}": getattr(s, f"{k}_factor") for n, s in p.layers.items() for k in "ag"}


@pytest.mark.parametrize("twice", [False, True])
def test_batched_factors_equal_the_per_call_ones(
    monkeypatch: pytest.MonkeyPatch, twice: bool
) -> None:
    want = _factors(False, monkeypatch, twice)
    got = _factors(True, monkeypatch, twice)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)


def test_the_cpu_computes_each_call_on_arrival_a_gpu_holds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default (the CPU's rule) no call waits for its key; under a holding device's rule they do, and
    both give the same factors."""
    factors = {}
    for hold in (False, True):
        monkeypatch.setitem(batching.HOLD, "cpu", hold)
        model = _model()
        p = KFACPreconditioner(model, factor_scaling="per_example")
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        loss = model(x).square().sum()
        assert bool(p.capture.batch.keys) == hold
        assert all((c.held is not None) == hold for s in p.layers.values() for c in s.calls)
        loss.backward()
        p.step()
        factors[hold] = [t for s in p.layers.values() for t in (s.a_factor, s.g_factor)]
    for a, b in zip(*factors.values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    monkeypatch.delitem(batching.HOLD, "cpu")
    assert PendingGrams.key(next(iter(p.layers.values())), x) is not None  # unlisted devices hold


def test_checkpointed_forwards_hold_no_input() -> None:
    """Under non-reentrant checkpointing autograd keeps no input: neither does the batch."""
    model = _model()
    p = KFACPreconditioner(model)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    out = checkpoint(model, x, use_reentrant=False)
    assert not p.capture.batch.keys
    assert all(c.a is not None for s in p.layers.values() for c in s.calls)
    out.sum().backward()
    p.step()
    assert all(s.ready for s in p.layers.values())


@pytest.mark.parametrize("shape", [(3, 2, 8, 8), (3, 4, 2, 2)])  # many / few positions per channel
def test_conv_output_grams_together_equal_each_calls(shape: tuple[int, ...]) -> None:
    from kfac_bench.kfac.layers.conv2d import Conv2dHandler

    handler, conv = Conv2dHandler(), nn.Conv2d(2, shape[1], 3)
    gs = [torch.randn(*shape, dtype=torch.float64) for _ in range(3)]
    together = handler.g_grams([conv] * 3, gs, torch.float64)
    for got, g in zip(together, gs):
        want = handler.g_gram(conv, g, torch.float64)
        torch.testing.assert_close(got.sum, want.sum, rtol=1e-12, atol=1e-12)
        assert (got.examples, got.positions) == (want.examples, want.positions)


@pytest.mark.parametrize(
    "conv", [dict(kernel_size=3, padding=1), dict(kernel_size=2, stride=2, dilation=2, bias=False)]
)
def test_conv1d_grams_together_equal_each_calls(conv: dict) -> None:
    from kfac_bench.kfac.layers.conv1d import Conv1dHandler

    handler, layer = Conv1dHandler(), nn.Conv1d(3, 5, **conv)
    bias = layer.bias is not None
    xs = [torch.randn(4, 3, 9, dtype=torch.float64) for _ in range(3)]
    gs = [layer.double()(x).detach().normal_() for x in xs]
    key = handler.batch_key(layer, xs[0], bias)
    assert key is not None and key == handler.batch_key(layer, xs[1], bias)
    a = handler.a_grams([layer] * 3, xs, torch.float64, bias)
    g = handler.g_grams([layer] * 3, gs, torch.float64)
    for got_a, got_g, x, gi in zip(a, g, xs, gs):
        for got, want in (
            (got_a, handler.a_gram(layer, x, torch.float64, bias)),
            (got_g, handler.g_gram(layer, gi, torch.float64)),
        ):
            torch.testing.assert_close(got.sum, want.sum, rtol=1e-12, atol=1e-12)
            assert (got.examples, got.positions) == (want.examples, want.positions)


class _ConvAttention(nn.Module):
    """Two same-shaped Conv1d, self-attention (q/k/v and out_proj: one shape group) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv1d(6, 6, 3, padding=1), nn.Conv1d(6, 6, 3, padding=1)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c2(torch.tanh(self.c1(x))).transpose(1, 2)
        return self.head(self.attn(h, h, h, need_weights=False)[0]).mean(1)


def _expand_factors(batched: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Running factors under ``'expand'`` after two steps of two micro-batches, each beside a forward on
    other rows whose output is kept alive but never backpropagated (it must count nowhere)."""
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(PendingGrams, "key", staticmethod(lambda layer, x: None))
        model = _ConvAttention().double()
        p = KFACPreconditioner(model, accumulation_steps=2, factor_scaling="expand")
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                spare = model(torch.randn(7, 6, 5, generator=g, dtype=torch.float64))
                assert bool(p.capture.batch.keys) == batched
                model(
                    torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
                ).square().sum().backward()
                del spare
            p.step()
        assert all(s.ready for s in p.layers.values())
        return {f"{n}/{k}": getattr(s, f"{k}_factor") for n, s in p.layers.items() for k in "ag"}


def test_batched_attention_and_conv1d_factors_equal_the_per_call_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _expand_factors(False, monkeypatch)
    got = _expand_factors(True, monkeypatch)
    assert set(got) == set(want) and len(want) == 2 * 7  # c1, c2, q, k, v, out_proj, head
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)


def test_a_subclass_with_its_own_per_call_gram_is_not_batched() -> None:
    from kfac_bench.kfac.batching import batches
    from kfac_bench.kfac.layers.attention import AttentionProjectionHandler
    from kfac_bench.kfac.layers.conv1d import Conv1dHandler
    from kfac_bench.kfac.layers.conv2d import Conv2dHandler
    from kfac_bench.kfac.layers.linear import LinearHandler

    class OwnG(LinearHandler):
        def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
            return super().g_gram(module, 2 * g, dtype)

    class Both(OwnG):
        def g_grams(self, modules: Any, gs: Any, dtype: torch.dtype) -> list[Gram]:
            return super().g_grams(modules, [2 * g for g in gs], dtype)

    for handler in (
        LinearHandler(),
        AttentionProjectionHandler(),
        Conv2dHandler(),
        Conv1dHandler(),
    ):
        assert batches(handler), handler
    assert not batches(OwnG()) and batches(Both())
