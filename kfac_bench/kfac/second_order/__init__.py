"""HOW factors become a preconditioner: one class per method (:mod:`.eigen`, :mod:`.inverse`,
:mod:`.lowrank`), chosen once, at construction (:func:`second_order_method`).

A layer's second-order state is a set of named *parts*, each a :data:`Result` (a dict of tensors):

* ``"a"`` and ``"g"``: the decompositions of the A and G factors, computed by the rank that owns the factor;
* derived parts (``method.derived``), computed from both decompositions by the rank that owns G, e.g. the
  eigen method's precomputed ``1/(λ_G λ_Aᵀ + γ)`` (KAISA §4.4).

The preconditioner moves parts between ranks by name without knowing what they hold; only the method knows
how to compute them, allocate receive buffers for them and apply them to a gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ..options import ComputeMethod
from ._robust import Parts, Result
from .eigen import EigenMethod
from .inverse import InverseMethod
from .lowrank import EigenLowRankMethod, RankRule

__all__ = [
    "EigenLowRankMethod",
    "EigenMethod",
    "InverseMethod",
    "Parts",
    "RankRule",
    "Result",
    "SecondOrderMethod",
    "expected_seconds",
    "second_order_method",
]


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
        batch_equal_sizes: bool = False,
        previous: Sequence[Result | None] | None = None,
        spatial: Sequence[bool] | None = None,
    ) -> list[Result | None]:
        """The ``"a"``/``"g"`` part of each factor; None where it failed even in float64. ``previous``: each
        factor's last part on this rank (a warm start), ``spatial``: whether its layer's positions are
        spatial (a convolution); only methods that use them read them. ``batch_equal_sizes``: stack
        equal-sized factors into one call (worth it on CUDA)."""
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


#: ``n³`` units (a dense ``eigh`` of an n×n factor, :meth:`SecondOrderMethod.decomposition_cost`) per second:
#: one CPU thread (a 4096² float32 ``eigh`` took 70 s on the project's shared 2-core machine), and a GPU.
N3_PER_SECOND_CPU_THREAD = 1e9
N3_PER_SECOND_CUDA = 5e10


def expected_seconds(cost: float, cuda: bool, threads: int = 1) -> float:
    """A rough wall time of decompositions of total ``cost`` (``n³`` units): for a log line before a long
    decomposition step, not for scheduling (CPU ``eigh`` scales poorly with threads: √threads assumed)."""
    rate = N3_PER_SECOND_CUDA if cuda else N3_PER_SECOND_CPU_THREAD * max(1, threads) ** 0.5
    return cost / rate


def second_order_method(
    method: ComputeMethod | str,
    dtype: torch.dtype,
    eigenvalue_outer_product: bool,
    rule: RankRule | None = None,
) -> SecondOrderMethod:
    """The method object for a :class:`ComputeMethod`; ``rule``: the rank rule of ``eigen_lowrank``
    (default :class:`RankRule`)."""
    parsed = ComputeMethod.parse(method)
    if parsed is ComputeMethod.EIGEN:
        return EigenMethod(dtype, eigenvalue_outer_product)
    if parsed is ComputeMethod.EIGEN_LOWRANK:
        return EigenLowRankMethod(dtype, rule or RankRule(), eigenvalue_outer_product)
    return InverseMethod(dtype)
