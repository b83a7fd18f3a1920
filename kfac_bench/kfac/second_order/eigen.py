"""The eigen-decomposition ("inverse-free") method: TPDS eq. 11-13, SC20 eq. 13-15 (Grosse & Martens).

With A = Q_A diag(λ_A) Q_Aᵀ and G = Q_G diag(λ_G) Q_Gᵀ, and the layer gradient ∇W of shape (g_dim, a_dim):

    V₁ = Q_Gᵀ ∇W Q_A
    V₂ = V₁ / (λ_G λ_Aᵀ + γ)              (elementwise)
    (A ⊗ G + γI)⁻¹ vec(∇W) = vec(Q_G V₂ Q_Aᵀ)

This is *exactly* the damped inverse of the Kronecker product, because the eigenvalues of A ⊗ G are the
products λ_A·λ_G; the explicit-inverse method damps each factor instead (see ``inverse``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._robust import Result, compute_dtype, run_all


def _eigh(factor: torch.Tensor) -> Result:
    eigenvalues, q = torch.linalg.eigh(factor)
    # Factors are PSD; rounding can produce tiny negative eigenvalues (the reference clamps at 0 too).
    return {"q": q, "eigenvalues": eigenvalues.clamp_(min=0.0)}


def decompose(
    factors: Sequence[torch.Tensor], dtype: torch.dtype, batch_equal_sizes: bool = False
) -> list[Result | None]:
    """Eigendecompositions ``{"q", "eigenvalues"}`` of symmetric factors; None where they failed."""
    return run_all(_eigh, factors, dtype, batch_equal_sizes)


def inverse_outer(a: Result, g: Result, damping: float) -> torch.Tensor:
    """``1 / (λ_G λ_Aᵀ + γ)``, shape (g_dim, a_dim): KAISA's precomputed eigenvalue outer product.

    Computed and kept in at least float32: in float16 a small damping would overflow ``1/γ``.
    """
    dt = compute_dtype(a["eigenvalues"].dtype)
    return 1.0 / (torch.outer(g["eigenvalues"].to(dt), a["eigenvalues"].to(dt)) + damping)


def precondition(
    grad: torch.Tensor,
    a: Result,
    g: Result,
    damping: float,
    outer: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Q_G [(Q_Gᵀ ∇W Q_A) ⊙ outer] Q_Aᵀ`` in the decomposition's dtype, or float32 if that is a 16-bit
    type (which could overflow), returned in ``grad``'s dtype.

    Args:
        grad: layer gradient, shape (g_dim, a_dim).
        a, g: decompositions of the A and G factors.
        damping: γ, used when ``outer`` is not given.
        outer: precomputed ``inverse_outer(a, g, damping)``.
    """
    dt = compute_dtype(a["q"].dtype)
    qa, qg = a["q"].to(dt), g["q"].to(dt)
    v1 = qg.t() @ grad.to(dt) @ qa
    if outer is None:
        outer = inverse_outer(a, g, damping)
    v2 = v1 * outer.to(dt)
    return (qg @ v2 @ qa.t()).to(grad.dtype)
