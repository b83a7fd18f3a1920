"""Mixed precision: factors from the tensors the layers actually received, computed outside autocast.

Every check compares the engine with dense float64 math on the inputs and output gradients captured from the
same forward and backward (independent hooks), so a factor computed in bf16/fp16, or one that overflowed,
fails. CPU autocast supports both bfloat16 and float16, so these run in CI; ``test_gpu.py`` runs the same
checks on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.layers.conv_unfold import fast_method

from .reference import eigen_dense, kfac_factors

LOW = [torch.bfloat16, torch.float16]


class Recorder:
    """Inputs and output gradients of every Linear/Conv2d call, captured by hooks of its own."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                m.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            self.inputs[name] = args[0].detach()
            out.retain_grad()
            self.outputs[name] = out

        return hook

    def dense(self, layer: nn.Module, name: str, n: int, scaling: str, scale: float = 1.0):  # type: ignore[no-untyped-def]
        """Float64 A and G from the captured tensors; ``n`` examples of a mean loss scaled by ``scale``."""
        x = self.inputs[name].double()
        g = self.outputs[name].grad.double() / scale
        return kfac_factors(layer, x, g * n, scaling)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def run_and_compare(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    scaling: str,
    device: str = "cpu",
    scaler_scale: float | None = None,
) -> Recorder:
    """One AMP step with K-FAC (factor_decay=0: the running factors are the batch factors); asserts every
    layer's A and G equal the dense float64 factors of the captured tensors."""
    model = model.to(device)
    rec = Recorder(model)
    scaler = (
        torch.amp.GradScaler(device, init_scale=scaler_scale) if scaler_scale is not None else None
    )
    p = KFACPreconditioner(
        model, factor_decay=0.0, kl_clip=None, factor_scaling=scaling, grad_scaler=scaler
    )
    with torch.autocast(device, dtype=dtype):
        loss = F.cross_entropy(model(x.to(device)).float().flatten(0, -2), y.to(device).flatten())
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    p.step()
    n = x.shape[0]
    for name, layer in p.layers.items():
        assert layer.a_factor is not None and layer.g_factor is not None
        assert layer.a_factor.dtype == torch.float32 and layer.g_factor.dtype == torch.float32
        a_ref, g_ref = rec.dense(layer.module, name, n, scaling, scaler_scale or 1.0)
        assert _rel(layer.a_factor, a_ref) < 1e-5, (name, "A", _rel(layer.a_factor, a_ref))
        assert _rel(layer.g_factor, g_ref) < 1e-5, (name, "G", _rel(layer.g_factor, g_ref))
    for q in model.parameters():
        assert q.grad is None or torch.isfinite(q.grad).all()
    return rec


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def shift_model() -> nn.Module:
    """A 1×1 conv on float32 inputs, then a 3×3 conv whose (low-precision) input takes the shift path."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4, 5),
    )


def unfold_model() -> nn.Module:
    """Many channels on a small map: the 3×3 conv takes unfold + GEMM."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 1),
        nn.Tanh(),
        nn.Conv2d(64, 8, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def check_linear_with_sequence_dims(dtype: torch.dtype, scaling: str, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(1)
    # Large inputs: in float16 the input factor's sums exceed 65504 (they overflowed before the fix).
    x = torch.randn(8, 7, 6, generator=g) * 300
    y = torch.randint(0, 5, (8, 7), generator=g)
    run_and_compare(linear_model(), x, y, dtype, scaling, device)


def check_conv(
    model: nn.Module, x: torch.Tensor, path: str, dtype: torch.dtype, device: str
) -> None:
    y = torch.randint(0, 5, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    rec = run_and_compare(model, x, y, dtype, "per_example", device)
    x2 = rec.inputs["2"]
    assert x2.dtype == dtype  # the k×k conv saw the low-precision activation of the 1×1 conv
    # On CPU the fitted cost model picks each path for these shapes; other devices use their own rule.
    assert device != "cpu" or fast_method(x2, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)) == path


@pytest.mark.parametrize("scaling", ["per_example", "kaisa"])
@pytest.mark.parametrize("dtype", LOW)
def test_linear_factors_under_cpu_autocast_equal_dense_float64(
    dtype: torch.dtype, scaling: str
) -> None:
    check_linear_with_sequence_dims(dtype, scaling)


@pytest.mark.parametrize("dtype", LOW)
def test_conv_shift_path_under_cpu_autocast_equals_dense_float64(dtype: torch.dtype) -> None:
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    check_conv(shift_model(), x, "shift", dtype, "cpu")


@pytest.mark.parametrize("dtype", LOW)
def test_conv_unfold_path_under_cpu_autocast_equals_dense_float64(dtype: torch.dtype) -> None:
    x = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(4))
    check_conv(unfold_model(), x, "unfold", dtype, "cpu")


def test_fp16_autocast_with_grad_scaler_unscales_g() -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 7, 6, generator=g), torch.randint(0, 5, (8, 7), generator=g)
    run_and_compare(linear_model(), x, y, torch.float16, "per_example", scaler_scale=2.0**12)


def test_grad_scaler_unscaling_is_exact() -> None:
    """Scaling the loss by a power of two scales every output gradient exactly, so G must come out
    bit-identical to an unscaled run's."""
    x = torch.randn(16, 3, 12, 12, generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 5, (16,))
    factors = []
    for scale in (None, 2.0**16):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 144, 5)
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, grad_scaler=scaler)
        loss = F.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
        p.step()
        factors.append([p.layers[n].g_factor for n in ("0", "3")])
    for plain, scaled in zip(*factors):
        assert torch.equal(plain, scaled)


def test_preconditioning_with_float16_decompositions_does_not_overflow() -> None:
    """1/(λ_G λ_A + γ) with γ = 1e-5 exceeds float16's range: the product is formed in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    p = KFACPreconditioner(
        model, factor_decay=0.0, kl_clip=None, damping=1e-5, inv_dtype=torch.float16
    )
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    F.cross_entropy(model(x), y).backward()
    raw = torch.cat([model[2].weight.grad, model[2].bias.grad[:, None]], 1).double()
    p.step()
    layer = p.layers["2"]
    assert (
        layer.parts["a"]["q"].dtype == torch.float16
        and layer.parts["outer"]["outer"].dtype == torch.float32
    )
    got = torch.cat([model[2].weight.grad, model[2].bias.grad[:, None]], 1).double()
    assert torch.isfinite(got).all()
    ref = eigen_dense(layer.a_factor.double(), layer.g_factor.double(), raw, 1e-5)
    assert _rel(got, ref) < 1e-2
