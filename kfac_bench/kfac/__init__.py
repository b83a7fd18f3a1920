"""The kfac-bench K-FAC engine: torch and the standard library only.

precond = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
loss.backward(); precond.step(); optimizer.step()
"""

from .options import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScaling,
    Placement,
)
from .preconditioner import KFACPreconditioner
from .timing import STAGES

__all__ = [
    "STAGES",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "FactorReduction",
    "FactorScaling",
    "KFACPreconditioner",
    "Placement",
]
