"""WHAT each layer type contributes to K-FAC: a plain registry from module type to handler.

``nn.Linear`` and ``nn.Conv2d`` are registered here, the layer types of the papers (SC20 §V), with
``nn.Conv1d`` (:mod:`.conv1d`) and the q/k/v projections of ``nn.MultiheadAttention`` (:mod:`.attention`);
every other module keeps its plain gradient. Other code registers more types the same way, e.g. a
Linear-equivalent layer that stores its weight transposed::

    register_layer_type(Conv1D, LinearHandler(transposed=True))

Lookup follows the module class's MRO, so a subclass of a registered type uses the handler of its nearest
registered ancestor unless it is registered itself, but only if it keeps that ancestor's ``forward``: a
subclass that computes something else in its own ``forward`` (timm's ``Conv2dSame`` pads inside it,
``StdConv2d`` standardises its weight) is not its base class, so it has no handler until one is registered
for it (:func:`overrides_forward` tells the scan why).
"""

from __future__ import annotations

from torch import nn

from .attention import AttentionProjection, AttentionProjectionHandler
from .base import Gram, LayerHandler, WeightBiasHandler
from .conv1d import Conv1dHandler
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


def _registered_ancestor(module: nn.Module) -> type[nn.Module] | None:
    for cls in type(module).__mro__:
        if cls in _HANDLERS:
            return cls
    return None


def overrides_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class, or a class between it and its nearest registered ancestor, defines its
    own ``forward`` (then :func:`handler_for` returns None for it)."""
    base = _registered_ancestor(module)
    if base is None:
        return False
    mro = type(module).__mro__
    return any("forward" in vars(cls) for cls in mro[: mro.index(base)])


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The handler for ``module``'s type (nearest registered class in its MRO), or None (also for a subclass
    with its own ``forward``, see :func:`overrides_forward`)."""
    base = _registered_ancestor(module)
    if base is None or overrides_forward(module):
        return None
    return _HANDLERS[base]


register_layer_type(nn.Linear, LinearHandler())
register_layer_type(nn.Conv2d, Conv2dHandler())
register_layer_type(nn.Conv1d, Conv1dHandler())
register_layer_type(AttentionProjection, AttentionProjectionHandler())

__all__ = [
    "AttentionProjection",
    "AttentionProjectionHandler",
    "Conv1dHandler",
    "Conv2dHandler",
    "Gram",
    "LayerHandler",
    "LinearHandler",
    "WeightBiasHandler",
    "handler_for",
    "layer_types",
    "overrides_forward",
    "register_layer_type",
    "unregister_layer_type",
]
