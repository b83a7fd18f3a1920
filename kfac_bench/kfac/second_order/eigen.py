"""The eigen-decomposition ("inverse-free") method: TPDS eq. 11-13, SC20 eq. 13-15 (Grosse & Martens).

With A = Q_A diag(λ_A) Q_Aᵀ and G = Q_G diag(λ_G) Q_Gᵀ, and the layer gradient ∇W of shape (g_dim, a_dim):

    V₁ = Q_Gᵀ ∇W Q_A
    V₂ = V₁ / (λ_G λ_Aᵀ + γ)              (elementwise)
    (A ⊗ G + γI)⁻¹ vec(∇W) = vec(Q_G V₂ Q_Aᵀ)

This is *exactly* the damped inverse of the Kronecker product, because the eigenvalues of A ⊗ G are the
products λ_A·λ_G; the explicit-inverse method damps each factor instead (see ``inverse``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._robust import Parts, Result, compute_dtype, run_all


def _named(pair: tuple[torch.Tensor, torch.Tensor]) -> Result:
    """``torch.linalg.eigh``'s ``(eigenvalues, eigenvectors)`` as ``{"q", "eigenvalues"}``."""
    eigenvalues, q = pair
    # Factors are PSD; rounding can produce tiny negative eigenvalues (the reference clamps at 0 too).
    return {"q": q, "eigenvalues": eigenvalues.clamp_(min=0.0)}


def inverse_outer(a: Result, g: Result, damping: float) -> torch.Tensor:
    """``1 / (λ_G λ_Aᵀ + γ)``, shape (g_dim, a_dim) (the kept eigenvalues' for low-rank parts): KAISA's
    precomputed eigenvalue outer product.

    Computed and kept in at least float32: in float16 a small damping would overflow ``1/γ``.
    """
    dt = compute_dtype(a["eigenvalues"].dtype)
    return 1.0 / (torch.outer(g["eigenvalues"].to(dt), a["eigenvalues"].to(dt)) + damping)


def _outer_stacked(a: Result, g: Result, damping: float) -> torch.Tensor:
    """:func:`inverse_outer` of stacked parts: ``(B, g_dim, a_dim)``."""
    dt = compute_dtype(a["eigenvalues"].dtype)
    la, lg = a["eigenvalues"].to(dt), g["eigenvalues"].to(dt)
    return torch.mul(lg.unsqueeze(2), la.unsqueeze(1)).add_(damping).reciprocal_()


@dataclass(frozen=True)
class EigenMethod:
    """``(A ⊗ G + γI)⁻¹ vec(∇W)`` from eigendecompositions ``{"q", "eigenvalues"}`` of A and G.

    With ``outer`` the G owner precomputes ``1/(λ_G λ_Aᵀ + γ)`` on decomposition steps (part ``"outer"``),
    which needs A and G decomposed on the same rank.
    """

    dtype: torch.dtype
    outer: bool = True

    @property
    def derived(self) -> tuple[str, ...]:
        return ("outer",) if self.outer else ()

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        damping: float,
        batch_equal_sizes: bool = False,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        """Eigendecompositions of symmetric factors (``damping`` is applied later, in
        :meth:`precondition`); None where they failed even in float64."""
        return run_all(torch.linalg.eigh, factors, self.dtype, batch_equal_sizes, _named)

    def decompose_stacked(self, factors: torch.Tensor) -> Result | None:
        """:meth:`decompose` of a ``(B, n, n)`` stack of factors as one batched ``eigh``, stacked results
        (None where it raised: the caller decomposes them one by one). Non-finite results are the
        caller's to check (:func:`finite_rows`)."""
        try:
            eigenvalues, q = torch.linalg.eigh(factors.to(compute_dtype(self.dtype)))
        except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
            return None
        return {"q": q.to(self.dtype), "eigenvalues": eigenvalues.clamp_(min=0.0).to(self.dtype)}

    def derive_stacked(self, a: Result, g: Result, damping: float) -> Parts:
        """:meth:`derive` of stacked parts (``(B, …)`` tensors of layers of one shape)."""
        return {"outer": {"outer": _outer_stacked(a, g, damping)}} if self.outer else {}

    def precondition_stacked(
        self, grads: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        """:meth:`precondition` of a ``(B, g_dim, a_dim)`` stack of gradients with stacked parts: four
        batched GEMMs and one product, whatever ``B``."""
        a, g = parts["a"], parts["g"]
        dt = compute_dtype(a["q"].dtype)
        qa, qg = a["q"].to(dt), g["q"].to(dt)
        v1 = torch.bmm(torch.bmm(qg.transpose(1, 2), grads.to(dt)), qa)
        outer = parts["outer"]["outer"] if self.outer else _outer_stacked(a, g, damping)
        v1.mul_(outer.to(dt))
        return torch.bmm(torch.bmm(qg, v1), qa.transpose(1, 2)).to(grads.dtype)

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {"outer": {"outer": inverse_outer(a, g, damping)}} if self.outer else {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        if part == "outer":
            dt = compute_dtype(self.dtype)  # see inverse_outer
            return {"outer": torch.empty(g_dim, a_dim, dtype=dt, device=device)}
        dim = a_dim if part == "a" else g_dim
        return {
            "q": torch.empty(dim, dim, dtype=self.dtype, device=device),
            "eigenvalues": torch.empty(dim, dtype=self.dtype, device=device),
        }

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return float(n) ** 3

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        """``Q_G [(Q_Gᵀ ∇W Q_A) ⊙ outer] Q_Aᵀ`` in the decomposition's dtype, or float32 if that is a 16-bit
        type (which could overflow), returned in ``grad``'s dtype; ``outer`` is the precomputed part, or
        :func:`inverse_outer` computed now."""
        a, g = parts["a"], parts["g"]
        dt = compute_dtype(a["q"].dtype)
        qa, qg = a["q"].to(dt), g["q"].to(dt)
        v1 = qg.t() @ grad.to(dt) @ qa
        outer = parts["outer"]["outer"] if self.outer else inverse_outer(a, g, damping)
        v2 = v1 * outer.to(dt)
        return (qg @ v2 @ qa.t()).to(grad.dtype)
