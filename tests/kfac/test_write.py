"""Writing preconditioned gradients back: the scaled write through the weight's matrix view equals
``scale · grad`` in every layout (bias column, conv kernels, channels_last, transposed Linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_bench.kfac.layers.conv2d import Conv2dHandler
from kfac_bench.kfac.layers.linear import LinearHandler


def _module(kind: str) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(5, 3), LinearHandler()
    if kind == "linear_transposed":
        m = nn.Linear(5, 3)
        m.weight = nn.Parameter(m.weight.detach().t().contiguous())  # stored (in, out)
        return m, LinearHandler(transposed=True)
    conv = nn.Conv2d(2, 4, 3)
    if kind == "conv_channels_last":
        conv = conv.to(memory_format=torch.channels_last)
    return conv, Conv2dHandler()


@pytest.mark.parametrize("kind", ["linear", "linear_transposed", "conv", "conv_channels_last"])
@pytest.mark.parametrize("scaled", [False, True])
def test_set_grad_writes_scale_times_grad(kind: str, scaled: bool) -> None:
    module, handler = _module(kind)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    keep = module.weight.grad
    a_dim, g_dim = handler.dims(module, True)  # type: ignore[attr-defined]
    grad = torch.randn(g_dim, a_dim)
    scale = torch.tensor(0.25, dtype=torch.float64) if scaled else None
    handler.set_grad(module, grad, True, scale=scale)  # type: ignore[attr-defined]
    want = grad * (0.25 if scaled else 1.0)
    assert (
        module.weight.grad is keep
    )  # written in place (optimizers and DDP buckets keep references)
    got = handler.grad(module, True)  # type: ignore[attr-defined]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
