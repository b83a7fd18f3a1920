"""Same-shaped calls computed together (:mod:`kfac_bench.kfac.batching`) give the per-call factors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.batching import PendingGrams


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
