"""The explicit-inverse method: ``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` (TPDS eq. 9-10).

Note that (A+γI)⁻¹ ⊗ (G+γI)⁻¹ = (A⊗G + γ(A⊗I + I⊗G) + γ²I)⁻¹: for the same γ it damps more than the eigen
method, which inverts A⊗G + γI exactly (mixed-product property of ⊗; see :mod:`.eigen`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._robust import Parts, Result, compute_dtype, run_all


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


@dataclass(frozen=True)
class InverseMethod:
    """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` from the explicit damped inverses ``{"inverse"}`` of A and G."""

    dtype: torch.dtype

    @property
    def derived(self) -> tuple[str, ...]:
        return ()

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        damping: float,
        batch_equal_sizes: bool = False,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        """``{"inverse": (F + γI)⁻¹}`` for each factor; None where it failed even in float64."""
        return run_all(_damped_inverse(damping), factors, self.dtype, batch_equal_sizes)

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        dim = a_dim if part == "a" else g_dim
        return {"inverse": torch.empty(dim, dim, dtype=self.dtype, device=device)}

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return float(n) ** 3

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` in the inverses' dtype (float32 for 16-bit ones), returned in
        ``grad``'s dtype (γ was applied by :meth:`decompose`)."""
        a, g = parts["a"]["inverse"], parts["g"]["inverse"]
        dt = compute_dtype(a.dtype)
        return (g.to(dt) @ grad.to(dt) @ a.to(dt)).to(grad.dtype)
