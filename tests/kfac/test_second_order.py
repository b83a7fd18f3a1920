"""The preconditioned gradient equals dense linear algebra on the Kronecker product."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.second_order import EigenMethod, InverseMethod, _robust

from .reference import eigen_dense, inverse_dense, kfac_factors, per_example_output_grads
from .test_factors import CASES, Probe

D = torch.float64


def spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * n, generator=g, dtype=D)
    return x @ x.t() / (2 * n)


@pytest.mark.parametrize("damping", [1e-3, 0.1])
def test_eigen_method_is_the_exact_damped_kronecker_inverse(damping: float) -> None:
    A, G = spd(5, 0), spd(3, 1)
    grad = torch.randn(3, 5, dtype=D)
    a, g = EigenMethod(D).decompose([A, G], damping)
    assert a is not None and g is not None
    out = EigenMethod(D, outer=False).precondition(grad, {"a": a, "g": g}, damping)
    torch.testing.assert_close(out, eigen_dense(A, G, grad, damping))
    # The precomputed eigenvalue outer product gives the same result.
    method = EigenMethod(D)
    parts = {"a": a, "g": g, **method.derive(a, g, damping)}
    torch.testing.assert_close(method.precondition(grad, parts, damping), out)


def test_inverse_method_damps_each_factor() -> None:
    A, G, damping = spd(4, 2), spd(6, 3), 0.01
    grad = torch.randn(6, 4, dtype=D)
    a, g = InverseMethod(D).decompose([A, G], damping)
    assert a is not None and g is not None
    out = InverseMethod(D).precondition(grad, {"a": a, "g": g}, damping)
    torch.testing.assert_close(out, inverse_dense(A, G, grad, damping))
    # ... which is *not* the eigen method's exact (A⊗G + γI)⁻¹ for the same γ (see the docstring of
    # kfac_bench/kfac/second_order/inverse.py).
    assert not torch.allclose(out, eigen_dense(A, G, grad, damping), rtol=1e-3)


def test_eigenvalues_are_clamped_at_zero() -> None:
    v = torch.randn(4, 1, dtype=D)
    (res,) = EigenMethod(D).decompose(
        [v @ v.t()], 0.0
    )  # rank one: three eigenvalues are ~0, maybe negative
    assert res is not None and (res["eigenvalues"] >= 0).all()


def test_failed_decomposition_is_retried_in_float64_then_reported() -> None:
    calls: list[torch.dtype] = []

    def flaky(f: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(f.dtype)
        if f.dtype != torch.float64:
            return {"q": torch.full_like(f, float("nan"))}
        return {"q": f * 2}

    f = spd(3, 4).float()
    (res,) = _robust.run_all(flaky, [f], torch.float32, batch_equal_sizes=False)
    assert calls == [torch.float32, torch.float64]
    assert res is not None and res["q"].dtype == torch.float32
    torch.testing.assert_close(res["q"], f * 2)

    def broken(f: torch.Tensor) -> dict[str, torch.Tensor]:
        raise torch.linalg.LinAlgError("did not converge")

    assert _robust.run_all(broken, [f], torch.float32, batch_equal_sizes=False) == [None]


def test_step_reaches_eigh_within_four_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """``step()`` -> second order -> the method -> its batched, retried call of ``torch.linalg.eigh``: a
    debugger steps from the algorithm to the linear algebra in four frames."""
    step = inspect.unwrap(KFACPreconditioner.step).__code__
    real, depths = torch.linalg.eigh, []

    def spy(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frame, depth = sys._getframe(1), 1
        while frame.f_code is not step:
            frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
        depths.append(depth)
        return real(f)

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    p = KFACPreconditioner(model)
    monkeypatch.setattr(torch.linalg, "eigh", spy)
    model(torch.randn(5, 4)).sum().backward()
    p.step()
    assert depths and max(depths) <= 4, depths


def test_batched_equal_sizes_match_one_by_one() -> None:
    factors = [spd(4, s) for s in range(3)] + [spd(2, 9)]
    one = EigenMethod(D).decompose(factors, 0.0, batch_equal_sizes=False)
    many = EigenMethod(D).decompose(factors, 0.0, batch_equal_sizes=True)
    for r1, r2 in zip(one, many):
        assert r1 is not None and r2 is not None
        torch.testing.assert_close(r1["eigenvalues"], r2["eigenvalues"])
        torch.testing.assert_close(r1["q"].abs(), r2["q"].abs())


@pytest.mark.parametrize(
    ("method", "outer"), [("eigen", True), ("eigen", False), ("inverse", False)]
)
@pytest.mark.parametrize("case", ["linear", "linear_seq", "conv_stride_pad", "conv_dilation"])
def test_engine_gradient_equals_dense_solve_from_independent_factors(
    case: str, method: str, outer: bool
) -> None:
    """The whole pipeline (hooks -> factors -> decomposition -> precondition -> write) against
    dense algebra on factors computed independently from per-example gradients."""
    make, shape, out_features = CASES[case]
    model = Probe(make(), out_features)
    x = torch.randn(*shape, dtype=D)
    y = torch.randint(0, 5, (shape[0],))
    damping = 0.01
    p = KFACPreconditioner(
        model,
        factor_decay=0.0,
        damping=damping,
        kl_clip=None,
        compute_method=method,
        compute_eigenvalue_outer_product=outer,
    )
    F.cross_entropy(model(x), y).backward()
    layer = model.layer
    grad = torch.cat(
        [layer.weight.grad.reshape(layer.weight.shape[0], -1), layer.bias.grad[:, None]], 1
    )
    p.step()
    got = torch.cat(
        [layer.weight.grad.reshape(layer.weight.shape[0], -1), layer.bias.grad[:, None]], 1
    )

    clone = Probe(make(), out_features)
    clone.load_state_dict(model.state_dict())
    delta = per_example_output_grads(clone.layer, x, clone.head, y)
    A, G = kfac_factors(clone.layer, x, delta, "expand")  # the default convention
    dense = eigen_dense if method == "eigen" else inverse_dense
    torch.testing.assert_close(got, dense(A, G, grad, damping), rtol=1e-7, atol=1e-10)
    # Parameters K-FAC does not precondition keep their plain gradient.
    assert model.head_w.grad is not None and not torch.isnan(model.head_w.grad).any()


def test_float32_engine_is_close_to_float64_dense() -> None:
    """The default float32 eigen path: relative error of the preconditioned gradient ≲ 1e-4."""
    layer = nn.Conv2d(3, 8, 3, padding=1)
    model = nn.Sequential(layer, nn.Flatten(), nn.ReLU())
    x = torch.randn(16, 3, 8, 8)
    p = KFACPreconditioner(model, factor_decay=0.0, damping=0.01, kl_clip=None)
    model(x).pow(2).mean().backward()
    grad = torch.cat([layer.weight.grad.reshape(8, -1), layer.bias.grad[:, None]], 1).double()
    p.step()
    got = torch.cat([layer.weight.grad.reshape(8, -1), layer.bias.grad[:, None]], 1).double()
    A, G = p.layers["0"].a_factor.double(), p.layers["0"].g_factor.double()
    ref = eigen_dense(A, G, grad, 0.01)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4
