"""WHAT each layer type contributes to K-FAC: a plain registry from module type to handler.

Only ``nn.Linear`` and ``nn.Conv2d`` are preconditioned (SC20 §V); every other module
keeps its plain gradient. Subclasses of a registered type are matched by ``isinstance``.
"""

from __future__ import annotations

from torch import nn

from .base import Gram, LayerHandler
from .conv2d import Conv2dHandler
from .linear import LinearHandler

HANDLERS: dict[type[nn.Module], LayerHandler] = {
    nn.Linear: LinearHandler(),
    nn.Conv2d: Conv2dHandler(),
}

# Parameterised layer types that look like candidates but are not preconditioned: named in the log once.
NOT_SUPPORTED: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Embedding,
    nn.Bilinear,
)


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The handler for ``module``'s type, or None if K-FAC does not precondition it."""
    for cls, handler in HANDLERS.items():
        if isinstance(module, cls):
            return handler
    return None


__all__ = ["HANDLERS", "NOT_SUPPORTED", "Gram", "LayerHandler", "handler_for"]
