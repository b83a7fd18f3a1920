"""The kfac-bench K-FAC engine: torch and the standard library only.

precond = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
loss.backward(); precond.step(); optimizer.step()

Extension and inspection: :func:`register_layer_type` (precondition another module type with a
:class:`LayerHandler`, e.g. ``LinearHandler(transposed=True)``), :func:`scan_model` (the layers K-FAC would
precondition, with their factor sizes, without attaching anything; works on the meta device) and
:class:`Coverage` (``precond.coverage()``).
"""

from .coverage import Coverage
from .layers import (
    Conv2dHandler,
    Gram,
    LayerHandler,
    LinearHandler,
    WeightBiasHandler,
    layer_types,
    register_layer_type,
    unregister_layer_type,
)
from .options import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScaling,
    Placement,
    parse_grad_worker_fraction,
)
from .preconditioner import KFACPreconditioner
from .registration import LayerSpec, ModelScan, scan_model
from .timing import STAGES

__all__ = [
    "STAGES",
    "AssignmentStrategy",
    "ComputeMethod",
    "Conv2dHandler",
    "Coverage",
    "DistributedStrategy",
    "FactorReduction",
    "FactorScaling",
    "Gram",
    "KFACPreconditioner",
    "LayerHandler",
    "LayerSpec",
    "LinearHandler",
    "ModelScan",
    "Placement",
    "WeightBiasHandler",
    "layer_types",
    "parse_grad_worker_fraction",
    "register_layer_type",
    "scan_model",
    "unregister_layer_type",
]
