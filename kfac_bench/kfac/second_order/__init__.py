"""HOW factors become a preconditioner: the eigen-decomposition and the explicit-inverse methods."""

from . import eigen, inverse, lowrank
from ._robust import Result
from .lowrank import RankRule
from .method import (
    EigenLowRankMethod,
    EigenMethod,
    InverseMethod,
    Parts,
    SecondOrderMethod,
    second_order_method,
)

__all__ = [
    "EigenLowRankMethod",
    "EigenMethod",
    "InverseMethod",
    "Parts",
    "RankRule",
    "Result",
    "SecondOrderMethod",
    "eigen",
    "inverse",
    "lowrank",
    "second_order_method",
]
