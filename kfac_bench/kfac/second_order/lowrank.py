"""The low-rank eigen method (``compute_method='eigen_lowrank'``): the top-k eigenpairs of a large factor and
one scalar for the rest of its spectrum, an opt-in approximation of :mod:`.eigen`.

A factor ``F`` (n×n) is kept as ``F ≈ U diag(λ) Uᵀ + c (I − U Uᵀ)`` with ``U`` its top-k eigenvectors (n×k),
``λ`` their eigenvalues and ``c = (tr F − Σλ) / (n − k)`` the mean of the remaining eigenvalues, so the
trace is kept and the complement is damped like an isotropic block. Its eigenbasis is ``[U, U⊥]`` with
eigenvalues ``[λ, c…c]``, so ``(A ⊗ G + γI)⁻¹`` stays exact for this model of the factors, and it is applied
without ever forming ``U⊥`` (:meth:`EigenLowRankMethod.precondition`).

Which factors: ``k = rank(n)`` is ``ceil(fraction · n)`` for factors of at least ``min_dim`` rows of a layer
whose positions are not spatial, and ``n`` (exact ``eigh``) otherwise: below the size threshold ``eigh`` is
cheap, and convolution factors have flat spectra (no rank low enough to save time keeps their
preconditioned gradient close), so they stay exact. ``k`` depends only on the shape, so every rank knows the
shapes of the parts it receives.

How: the first decomposition of a factor (or one without a previous basis) is an exact ``eigh`` truncated
to the top k; later ones warm-start from the previous basis (the running average moves slowly): with
``B = [U_prev, Ω]`` (``p`` random columns ``Ω``), Rayleigh-Ritz (``eigh`` of the small ``Qᵀ F Q``) on the
block Krylov space ``Q = qr([B, F B, …, F^q B])`` (``q = iterations``, default 1). Plain subspace iteration
(``Q = qr(F^q B)``) converges at the rate ``λ_{k+p}/λ_k``, close to 1 on the factors the engine
accumulates (a running average that starts from the identity is nearly flat past its first eigenvalues):
after 10 decompositions its preconditioned gradient was 5-20× further from the exact one than the exact
rank-k truncation's, against ≤ 1.2× for the Krylov space (``python -m benchmarks.lowrank``). Cost
``≈ 2n²(k+p)(2q+1)`` FLOPs of GEMM and an ``eigh`` of order ``(q+1)(k+p)``, against ``eigh``'s ``O(n³)``
at a much lower FLOP rate (:meth:`RankRule.decomposition_cost`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._robust import Parts, Result, compute_dtype, run_all
from .eigen import inverse_outer

#: Random columns added to the warm-start basis (oversampling of the range finder).
OVERSAMPLE = 8
#: The Krylov blocks continue the warm-start basis past its first ``EXPAND_FROM/8·k`` columns (the largest
#: eigenvalues, which converge first) only: a smaller Rayleigh-Ritz problem for the same accuracy.
EXPAND_FROM = 6
#: ``eigh`` time over the time of ``n³`` FLOPs of GEMM, for the placement cost model: ``eigh`` runs at a far
#: lower FLOP rate than GEMM.
EIGH_COST_IN_GEMM_FLOPS = 10.0


@dataclass(frozen=True)
class RankRule:
    """``k`` of an n×n factor: ``ceil(fraction · n)`` from ``min_dim`` rows on, for non-spatial layers."""

    fraction: float = 0.25
    min_dim: int = 1024
    iterations: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"lowrank_fraction must be in (0, 1], got {self.fraction}")
        if self.min_dim < 1:
            raise ValueError(f"lowrank_min_dim must be >= 1, got {self.min_dim}")
        if self.iterations < 1:
            raise ValueError(f"lowrank_iterations must be >= 1, got {self.iterations}")

    def rank(self, n: int, spatial: bool = False) -> int:
        if spatial or n < self.min_dim:
            return n
        return min(n, max(1, math.ceil(self.fraction * n)))

    def krylov(self, n: int, k: int) -> bool:
        """Whether a warm-started rank-``k`` decomposition of an n×n factor uses the Krylov space (else an
        exact ``eigh``: the space would be the whole factor)."""
        return k < n and (self.iterations + 1) * (k + min(n - k, OVERSAMPLE)) < n

    def decomposition_cost(self, n: int, spatial: bool = False) -> float:
        """Relative cost of decomposing an n×n factor (``n³`` units of ``eigh``), for placement."""
        k = self.rank(n, spatial)
        if not self.krylov(n, k):
            return float(n) ** 3
        cols = k + OVERSAMPLE
        space = (self.iterations + 1) * cols
        gemm = 2.0 * n * n * cols * (2 * self.iterations + 1) + 2.0 * n * space * space
        return gemm / EIGH_COST_IN_GEMM_FLOPS + float(space) ** 3


def _exact(k: int):  # type: ignore[no-untyped-def]
    """Exact ``eigh``, the top ``k`` pairs (descending) and the mean of the other eigenvalues."""

    def fn(factor: torch.Tensor) -> Result:
        eigenvalues, q = torch.linalg.eigh(factor)
        eigenvalues = eigenvalues.clamp_(min=0.0)
        n = factor.shape[-1]
        if k == n:
            rest = torch.zeros(*eigenvalues.shape[:-1], 1, dtype=eigenvalues.dtype)
            return {"q": q, "eigenvalues": eigenvalues, "rest": rest.to(eigenvalues.device)}
        top = eigenvalues[..., n - k :].flip(-1)
        rest = eigenvalues[..., : n - k].mean(-1, keepdim=True)
        return {"q": q[..., n - k :].flip(-1), "eigenvalues": top, "rest": rest}

    return fn


def _subspace(k: int, previous: torch.Tensor, iterations: int, seed: int):  # type: ignore[no-untyped-def]
    """Top ``k`` pairs by Rayleigh-Ritz on the block Krylov space of ``previous`` (n×k) plus random
    columns (module docstring), built block by block: each new block is ``F`` times the last, made
    orthogonal to the space so far (twice, for rounding) and orthonormalised, so ``F`` times every block
    is computed once and ``Qᵀ F Q`` needs no other product with ``F``."""

    def fn(factor: torch.Tensor) -> Result:
        n = factor.shape[-1]
        cols = min(n - k, OVERSAMPLE)
        g = torch.Generator(device=factor.device).manual_seed(seed)
        extra = torch.randn(n, cols, generator=g, dtype=factor.dtype, device=factor.device)
        first = _orthonormal(torch.cat([previous.to(factor.dtype), extra], dim=1), [])
        blocks, products = [first], [factor @ first]
        for _ in range(iterations):  # RankRule.krylov: the space stays smaller than the factor
            blocks.append(_orthonormal(products[-1], blocks))
            products.append(factor @ blocks[-1])
        basis, image = torch.cat(blocks, dim=1), torch.cat(products, dim=1)
        small = basis.t() @ image
        w, v = torch.linalg.eigh((small + small.t()) * 0.5)
        w, v = w[-k:].flip(0).clamp_(min=0.0), v[:, -k:].flip(1)
        trace = torch.diagonal(factor).sum()
        rest = ((trace - w.sum()) / (n - k)).clamp(min=0.0).reshape(1)
        return {"q": basis @ v, "eigenvalues": w, "rest": rest}

    return fn


def _orthonormal(y: torch.Tensor, against: list[torch.Tensor]) -> torch.Tensor:
    """An orthonormal basis of ``y``'s columns made orthogonal to the orthonormal ``against`` blocks:
    block Gram-Schmidt and Cholesky QR, each twice (CholeskyQR2: GEMMs only, as accurate as Householder QR
    for a block whose condition number stays below ``1/√eps``); Householder QR, with Gram-Schmidt again,
    where the first Cholesky factor shows a worse one (a block nearly inside the space so far: the Krylov
    block of a converged basis) or fails."""
    start, q = y, y
    for attempt in range(2):
        for b in against:
            q = q - b @ (b.t() @ q)
        r, info = torch.linalg.cholesky_ex(q.t() @ q, upper=True)
        diag = torch.diagonal(r).abs()
        if bool(info.item()) or (attempt == 0 and bool(diag.min() < _MAX_CONDITION * diag.max())):
            break
        q = torch.linalg.solve_triangular(r, q, upper=True, left=False)
    else:
        return q
    q = start
    for _ in range(2):
        for b in against:
            q = q - b @ (b.t() @ q)
        q, _ = torch.linalg.qr(q)
    return q


#: Smallest ratio of the first Cholesky factor's diagonal entries (≈ 1/condition number of the block) at
#: which Cholesky QR twice stays orthonormal in float32 (``√eps ≈ 3e-4``, with a margin).
_MAX_CONDITION = 1e-3


@dataclass(frozen=True)
class EigenLowRankMethod:
    """``(Â ⊗ Ĝ + γI)⁻¹ vec(∇W)`` with large non-spatial factors kept as their top-k eigenpairs plus one
    scalar (module docstring); ``k = rule.rank(n, spatial)``, exact ``eigh`` where ``k = n``."""

    dtype: torch.dtype
    rule: RankRule = RankRule()
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
        """``{"q": n×k, "eigenvalues": k, "rest": 1}`` for each factor (descending eigenvalues for k < n;
        exact factors keep ``eigh``'s order with ``rest`` 0); None where it failed even in float64.
        ``previous``: each factor's last result (warm start), ``spatial``: whether its layer is spatial."""
        previous = previous if previous is not None else [None] * len(factors)
        spatial = spatial if spatial is not None else [False] * len(factors)
        results: list[Result | None] = [None] * len(factors)
        exact: dict[int, list[int]] = {}
        for i, (f, s) in enumerate(zip(factors, spatial)):
            n = f.shape[-1]
            k = self.rule.rank(n, s)
            prev = previous[i]
            if self.rule.krylov(n, k) and prev is not None and prev["q"].shape == (n, k):
                fn = _subspace(k, prev["q"], self.rule.iterations, seed=n * 7919 + k)
                results[i] = run_all(fn, [f], self.dtype, False)[0]
            else:
                exact.setdefault(k, []).append(i)
        for k, idx in exact.items():
            done = run_all(_exact(k), [factors[i] for i in idx], self.dtype, batch_equal_sizes)
            for i, r in zip(idx, done):
                results[i] = r
        return results

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {"outer": {"outer": inverse_outer(a, g, damping)}} if self.outer else {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        ka, kg = self.rule.rank(a_dim, spatial), self.rule.rank(g_dim, spatial)
        if part == "outer":
            return {"outer": torch.empty(kg, ka, dtype=compute_dtype(self.dtype), device=device)}
        n, k = (a_dim, ka) if part == "a" else (g_dim, kg)
        return {
            "q": torch.empty(n, k, dtype=self.dtype, device=device),
            "eigenvalues": torch.empty(k, dtype=self.dtype, device=device),
            "rest": torch.empty(1, dtype=self.dtype, device=device),
        }

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return self.rule.decomposition_cost(n, spatial)

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        """``(Â ⊗ Ĝ + γI)⁻¹ vec(∇W)`` for the low-rank-plus-scalar factors ``Â``, ``Ĝ``, returned in
        ``grad``'s dtype.

        With ``M = U_Gᵀ X``, ``R = X U_A``, ``N = M U_A``, ``D = 1/(λ_G λ_Aᵀ + γ)``,
        ``d_G = 1/(λ_G c_A + γ)``, ``d_A = 1/(c_G λ_A + γ)``, ``s = 1/(c_G c_A + γ)``, summing the four
        blocks of ``[U, U⊥]`` on each side:

            s X + U_G [diag(d_G − s) M + (N ⊙ (D − d_G 1ᵀ − 1 d_Aᵀ + s)) U_Aᵀ] + R diag(d_A − s) U_Aᵀ

        When both factors are kept whole (k = n) this is :meth:`.EigenMethod.precondition` itself.
        """
        a, g = parts["a"], parts["g"]
        dt = compute_dtype(a["q"].dtype)
        qa, qg = a["q"].to(dt), g["q"].to(dt)
        outer = (parts["outer"]["outer"] if self.outer else inverse_outer(a, g, damping)).to(dt)
        x = grad.to(dt)
        if qa.shape[0] == qa.shape[1] and qg.shape[0] == qg.shape[1]:
            return (qg @ ((qg.t() @ x @ qa) * outer) @ qa.t()).to(grad.dtype)
        la, lg = a["eigenvalues"].to(dt), g["eigenvalues"].to(dt)
        ca, cg = a["rest"].to(dt), g["rest"].to(dt)
        s = 1.0 / (cg * ca + damping)
        dg = 1.0 / (lg * ca + damping) - s
        da = 1.0 / (cg * la + damping) - s
        m = qg.t() @ x
        r = x @ qa
        core = (m @ qa) * (outer - dg[:, None] - da[None, :] - s)
        t = torch.addmm(m * dg[:, None], core, qa.t())
        out = torch.addmm(x * s, qg, t)
        out.addmm_(r * da, qa.t())
        return out.to(grad.dtype)
