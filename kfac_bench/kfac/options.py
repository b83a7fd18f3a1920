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


class ComputeMethod(StrEnum):
    """How factors become a preconditioner (PAPER.md §1.1)."""

    EIGEN = "eigen"
    INVERSE = "inverse"


class FactorScaling(StrEnum):
    """Which code version's normalisation of A and G (PAPER.md §1.1 "G scaling"); see ``layers``."""

    PER_EXAMPLE = "per_example"
    KAISA = "kaisa"


class DistributedStrategy(StrEnum):
    """KAISA's named points on the grad-worker-fraction axis (PAPER.md §2.2)."""

    COMM_OPT = "comm_opt"
    MEM_OPT = "mem_opt"
    HYBRID_OPT = "hybrid_opt"


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
