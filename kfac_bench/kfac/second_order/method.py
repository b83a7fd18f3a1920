"""One interface for the second-order methods, so the preconditioner chooses once, at construction.

A layer's second-order state is a set of named *parts*, each a :data:`Result` (a dict of tensors):

* ``"a"`` and ``"g"``: the decompositions of the A and G factors, computed by the rank that owns the factor;
* derived parts (``method.derived``), computed from both decompositions by the rank that owns G, e.g. the
  eigen method's precomputed ``1/(λ_G λ_Aᵀ + γ)`` (KAISA §4.4).

The preconditioner moves parts between ranks by name without knowing what they hold; only the method knows
how to compute them, allocate receive buffers for them and apply them to a gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..options import ComputeMethod
from . import eigen, inverse, lowrank
from ._robust import Result, compute_dtype
from .lowrank import RankRule

Parts = dict[str, Result]


class SecondOrderMethod(Protocol):
    """HOW factors become a preconditioner. Stateless; one instance serves every layer."""

    @property
    def derived(self) -> tuple[str, ...]:
        """Names of the parts computed by :meth:`derive` (besides ``"a"`` and ``"g"``)."""
        ...

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        damping: float,
        batch_equal_sizes: bool,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        """The ``"a"``/``"g"`` part of each factor; None where it failed even in float64. ``previous``: each
        factor's last part on this rank (a warm start), ``spatial``: whether its layer's positions are
        spatial (a convolution); only methods that use them read them."""
        ...

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        """The derived parts of a layer from its two decompositions (``{}`` if the method has none)."""
        ...

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        """Uninitialised tensors shaped like ``part`` of an ``(a_dim, g_dim)`` layer, to receive into."""
        ...

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        """Relative time of decomposing an n×n factor (``n³`` for a dense one), for placement."""
        ...

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        """The preconditioned ``(g_dim, a_dim)`` gradient, in ``grad``'s dtype."""
        ...


@dataclass(frozen=True)
class EigenMethod:
    """``(A ⊗ G + γI)⁻¹ vec(∇W)`` from eigendecompositions (see :mod:`.eigen`).

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
        batch_equal_sizes: bool,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        return eigen.decompose(factors, self.dtype, batch_equal_sizes)

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {"outer": {"outer": eigen.inverse_outer(a, g, damping)}} if self.outer else {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        if part == "outer":
            dt = compute_dtype(self.dtype)  # see eigen.inverse_outer
            return {"outer": torch.empty(g_dim, a_dim, dtype=dt, device=device)}
        dim = a_dim if part == "a" else g_dim
        return {
            "q": torch.empty(dim, dim, dtype=self.dtype, device=device),
            "eigenvalues": torch.empty(dim, dtype=self.dtype, device=device),
        }

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        outer = parts["outer"]["outer"] if self.outer else None
        return eigen.precondition(grad, parts["a"], parts["g"], damping, outer)

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return float(n) ** 3


@dataclass(frozen=True)
class InverseMethod:
    """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` from explicit damped inverses (see :mod:`.inverse`)."""

    dtype: torch.dtype

    @property
    def derived(self) -> tuple[str, ...]:
        return ()

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        damping: float,
        batch_equal_sizes: bool,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        return inverse.decompose(factors, self.dtype, damping, batch_equal_sizes)

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        dim = a_dim if part == "a" else g_dim
        return {"inverse": torch.empty(dim, dim, dtype=self.dtype, device=device)}

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        return inverse.precondition(grad, parts["a"], parts["g"])

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return float(n) ** 3


@dataclass(frozen=True)
class EigenLowRankMethod:
    """``(Â ⊗ Ĝ + γI)⁻¹ vec(∇W)`` with large non-spatial factors kept as their top-k eigenpairs plus one
    scalar (see :mod:`.lowrank`); ``k = rule.rank(n, spatial)``, exact ``eigh`` where ``k = n``."""

    dtype: torch.dtype
    rule: RankRule
    outer: bool = True

    @property
    def derived(self) -> tuple[str, ...]:
        return ("outer",) if self.outer else ()

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        damping: float,
        batch_equal_sizes: bool,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        return lowrank.decompose(
            factors,
            self.dtype,
            self.rule,
            previous if previous is not None else [None] * len(factors),
            spatial if spatial is not None else [False] * len(factors),
            batch_equal_sizes,
        )

    def derive(self, a: Result, g: Result, damping: float) -> Parts:
        return {"outer": {"outer": lowrank.inverse_outer(a, g, damping)}} if self.outer else {}

    def empty(
        self, part: str, a_dim: int, g_dim: int, device: torch.device, spatial: bool = False
    ) -> Result:
        ka, kg = self.rule.rank(a_dim, spatial), self.rule.rank(g_dim, spatial)
        if part == "outer":
            return {"outer": torch.empty(kg, ka, dtype=compute_dtype(self.dtype), device=device)}
        dim, k = (a_dim, ka) if part == "a" else (g_dim, kg)
        return lowrank.empty(dim, k, self.dtype, device)

    def precondition(
        self, grad: torch.Tensor, parts: Mapping[str, Result], damping: float
    ) -> torch.Tensor:
        outer = parts["outer"]["outer"] if self.outer else None
        return lowrank.precondition(grad, parts["a"], parts["g"], damping, outer)

    def decomposition_cost(self, n: int, spatial: bool) -> float:
        return self.rule.decomposition_cost(n, spatial)


def second_order_method(
    method: ComputeMethod | str,
    dtype: torch.dtype,
    eigenvalue_outer_product: bool,
    rule: RankRule | None = None,
) -> SecondOrderMethod:
    """The method object for a :class:`ComputeMethod` (chosen once, at construction); ``rule``: the rank
    rule of ``eigen_lowrank`` (default :class:`RankRule`)."""
    parsed = ComputeMethod.parse(method)
    if parsed is ComputeMethod.EIGEN:
        return EigenMethod(dtype, eigenvalue_outer_product)
    if parsed is ComputeMethod.EIGEN_LOWRANK:
        return EigenLowRankMethod(dtype, rule or RankRule(), eigenvalue_outer_product)
    return InverseMethod(dtype)
