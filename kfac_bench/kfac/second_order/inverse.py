"""The explicit-inverse method: ``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` (TPDS eq. 9-10).

Note that (A+γI)⁻¹ ⊗ (G+γI)⁻¹ = (A⊗G + γ(A⊗I + I⊗G) + γ²I)⁻¹: for the same γ it damps more than the eigen
method, which inverts A⊗G + γI exactly (mixed-product property of ⊗; see :mod:`.eigen`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._robust import Result, compute_dtype, run_all


def _damped_inverse(damping: float):  # type: ignore[no-untyped-def]
    def fn(factor: torch.Tensor) -> Result:
        eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
        damped = factor + damping * eye
        chol, info = torch.linalg.cholesky_ex(damped)
        # cholesky_ex reports failure in `info` instead of raising (no host sync here); a failed factor
        # becomes NaN, which the caller detects with its one sync and retries in float64.
        inv = torch.cholesky_inverse(chol)
        failed = (info != 0).reshape(*info.shape, 1, 1)
        return {"inverse": inv.masked_fill(failed, float("nan"))}

    return fn


def decompose(
    factors: Sequence[torch.Tensor],
    dtype: torch.dtype,
    damping: float,
    batch_equal_sizes: bool = False,
) -> list[Result | None]:
    """``{"inverse": (F + γI)⁻¹}`` for each factor; None where it failed even in float64."""
    return run_all(_damped_inverse(damping), factors, dtype, batch_equal_sizes)


def precondition(grad: torch.Tensor, a: Result, g: Result) -> torch.Tensor:
    """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` in the inverses' dtype (float32 for 16-bit ones), returned in ``grad``'s
    dtype."""
    dt = compute_dtype(a["inverse"].dtype)
    return (g["inverse"].to(dt) @ grad.to(dt) @ a["inverse"].to(dt)).to(grad.dtype)
