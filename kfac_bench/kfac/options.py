"""Closed choices of the engine, as enums that also accept their string values."""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound="StrEnum")


class StrEnum(str, Enum):
    """An enum whose members compare equal to, and parse from, their string values."""

    @classmethod
    def parse(cls: type[E], value: object) -> E:
        """The member for ``value`` (a member or its string); a ValueError names the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"invalid {cls.__name__} {value!r}: choose one of {choices}") from None

    def __str__(self) -> str:
        return str(self.value)


class Factor(StrEnum):
    """The two Kronecker factors of a layer, and the keys of their parts: A (from the layer's inputs) and G
    (from the gradients of its outputs)."""

    A = "a"
    G = "g"


class ComputeMethod(StrEnum):
    """How factors become a preconditioner: eigendecompositions (TPDS eq. 11-13), inverses (eq. 9-10), or
    the opt-in low-rank eigendecomposition of large Linear-layer factors (:mod:`.second_order.lowrank`)."""

    EIGEN = "eigen"
    INVERSE = "inverse"
    EIGEN_LOWRANK = "eigen_lowrank"


class FactorScaling(StrEnum):
    """The normalisation of A and G; see :mod:`kfac_bench.kfac.factors`.

    ``expand`` (default): K-FAC-expand (Eschenhagen et al., NeurIPS 2023) for Linear-type layers, every row
    one term of the loss's mean, so the step does not depend on the input's layout; KFC for convolutions.
    ``per_example``: the SC20/TPDS ResNet code (gpauloski/kfac-pytorch, branch ``kfac-opt``); ``kaisa``: the
    KAISA-era code (branch ``hybrid-opt``, ``get_cov``), which produced the Mask R-CNN and BERT results.
    """

    EXPAND = "expand"
    PER_EXAMPLE = "per_example"
    KAISA = "kaisa"


class DistributedStrategy(StrEnum):
    """KAISA's named points on the grad-worker-fraction axis (KAISA §2.2, §3.1)."""

    COMM_OPT = "comm_opt"
    MEM_OPT = "mem_opt"
    HYBRID_OPT = "hybrid_opt"

    def fraction(self, world_size: int) -> float:
        """The grad-worker fraction this strategy names on ``world_size`` ranks (HYBRID-OPT: 1/2)."""
        if self is DistributedStrategy.COMM_OPT:
            return 1.0
        if self is DistributedStrategy.MEM_OPT:
            return 1.0 / world_size
        return 0.5 if world_size > 1 else 1.0


def parse_grad_worker_fraction(value: object) -> float | DistributedStrategy:
    """The one parser of ``grad_worker_fraction``: a number in (0, 1] (also as a string, e.g. ``"0.5"``)
    or a strategy name (``comm_opt``, ``mem_opt``, ``hybrid_opt``, any case).

    Returns the number as a float, or the :class:`DistributedStrategy` (resolved against the world size by
    :meth:`DistributedStrategy.fraction`).

    Raises:
        ValueError: one line naming the value and the valid choices.
    """
    if isinstance(value, DistributedStrategy):
        return value
    choices = ", ".join(s.value for s in DistributedStrategy)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in {s.value for s in DistributedStrategy}:
            return DistributedStrategy(text)
        try:
            number = float(text)
        except ValueError:
            raise ValueError(
                f"grad_worker_fraction={value!r}: give a number in (0, 1] or one of {choices}"
            ) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(
            f"grad_worker_fraction={value!r}: give a number in (0, 1] or one of {choices}"
        )
    if not 0.0 < number <= 1.0:
        raise ValueError(f"grad_worker_fraction={value!r} must be in (0, 1] (or one of {choices})")
    return number


class AssignmentStrategy(StrEnum):
    """Cost model of a factor for load balancing: n³ (decomposition time) or n² (memory)."""

    COMPUTE = "compute"
    MEMORY = "memory"


class Placement(StrEnum):
    """How factors are placed on ranks: KAISA's greedy LPT, or SC20's round robin."""

    LPT = "lpt"
    ROUND_ROBIN = "round_robin"


class FactorReduction(StrEnum):
    """How batch factors are combined across ranks: everyone keeps them, or only their owner."""

    ALLREDUCE = "allreduce"
    REDUCE = "reduce"
