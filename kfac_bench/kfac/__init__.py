"""The kfac-bench K-FAC engine: torch and the standard library only.

precond = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
loss.backward(); precond.step(); optimizer.step()

Extension and inspection: :func:`register_layer_type` (precondition another module type with a
:class:`LayerHandler`, e.g. ``LinearHandler(transposed=True)``), :func:`scan_model` (the layers K-FAC would
precondition, with their factor sizes, without attaching anything; works on the meta device) and
:class:`Coverage` (``precond.coverage()``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coverage import Coverage
    from .layers import (
        Conv1dHandler,
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
    "Conv1dHandler",
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

#: Where each public name lives. The engine loads its modules on first use (PEP 562), so the harness can read
#: the option enums (:mod:`.options`, standard library only) without importing torch: `kfac-bench --help` and
#: config errors answer in a fraction of a second.
_EXPORTS = {
    "Coverage": ".coverage",
    "Conv1dHandler": ".layers",
    "Conv2dHandler": ".layers",
    "Gram": ".layers",
    "LayerHandler": ".layers",
    "LinearHandler": ".layers",
    "WeightBiasHandler": ".layers",
    "layer_types": ".layers",
    "register_layer_type": ".layers",
    "unregister_layer_type": ".layers",
    "AssignmentStrategy": ".options",
    "ComputeMethod": ".options",
    "DistributedStrategy": ".options",
    "FactorReduction": ".options",
    "FactorScaling": ".options",
    "Placement": ".options",
    "parse_grad_worker_fraction": ".options",
    "KFACPreconditioner": ".preconditioner",
    "LayerSpec": ".registration",
    "ModelScan": ".registration",
    "scan_model": ".registration",
    "STAGES": ".timing",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
