"""HOW factors become a preconditioner: the eigen-decomposition and the explicit-inverse methods."""

from . import eigen, inverse
from ._robust import Result

__all__ = ["Result", "eigen", "inverse"]
