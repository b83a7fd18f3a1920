"""HOW factors become a preconditioner: the eigen-decomposition and the explicit-inverse methods."""

from . import eigen, inverse
from ._robust import Result
from .method import EigenMethod, InverseMethod, Parts, SecondOrderMethod, second_order_method

__all__ = [
    "EigenMethod",
    "InverseMethod",
    "Parts",
    "Result",
    "SecondOrderMethod",
    "eigen",
    "inverse",
    "second_order_method",
]
