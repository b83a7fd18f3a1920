"""WHAT each layer type contributes to K-FAC: a plain registry from module type to handler.

``nn.Linear`` and ``nn.Conv2d`` are registered here, the layer types of the papers (SC20 §V); every other
module keeps its plain gradient. Other code registers more types the same way, e.g. a Linear-equivalent layer
that stores its weight transposed::

    register_layer_type(Conv1D, LinearHandler(transposed=True))

Lookup follows the module class's MRO, so a subclass of a registered type uses the handler of its nearest
registered ancestor unless it is registered itself.
"""

from __future__ import annotations

from torch import nn

from .base import Gram, LayerHandler, WeightBiasHandler
from .conv2d import Conv2dHandler
from .linear import LinearHandler

_HANDLERS: dict[type[nn.Module], LayerHandler] = {}


def register_layer_type(cls: type[nn.Module], handler: LayerHandler) -> None:
    """Precondition modules of type ``cls`` (and its subclasses) with ``handler``; replaces an earlier
    registration of ``cls``. Affects preconditioners constructed afterwards."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_layer_type: {cls!r} is not an nn.Module subclass")
    missing = [
        m
        for m in (
            "parameters",
            "unsupported_reason",
            "dims",
            "a_gram",
            "g_gram",
            "grad",
            "set_grad",
        )
        if not callable(getattr(handler, m, None))
    ] + ([] if hasattr(handler, "spatial") else ["spatial"])
    if missing:
        raise TypeError(f"register_layer_type: handler {handler!r} lacks {', '.join(missing)}")
    _HANDLERS[cls] = handler


def unregister_layer_type(cls: type[nn.Module]) -> None:
    """Undo :func:`register_layer_type` for ``cls`` (no error if it was not registered)."""
    _HANDLERS.pop(cls, None)


def layer_types() -> dict[type[nn.Module], LayerHandler]:
    """A copy of the registry: module type -> handler."""
    return dict(_HANDLERS)


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The handler for ``module``'s type (nearest registered class in its MRO), or None."""
    for cls in type(module).__mro__:
        handler = _HANDLERS.get(cls)
        if handler is not None:
            return handler
    return None


register_layer_type(nn.Linear, LinearHandler())
register_layer_type(nn.Conv2d, Conv2dHandler())

__all__ = [
    "Conv2dHandler",
    "Gram",
    "LayerHandler",
    "LinearHandler",
    "WeightBiasHandler",
    "handler_for",
    "layer_types",
    "register_layer_type",
    "unregister_layer_type",
]
