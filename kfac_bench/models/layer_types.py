"""Layer types of third-party model libraries that K-FAC can precondition, registered with the engine.

The engine (``kfac_bench.kfac``) imports only torch, so it cannot know ``transformers``' or ``timm``'s
classes; the harness registers them here, before building a preconditioner
(``kfac_bench/config/kfac_adapter.py``).

* ``transformers.pytorch_utils.Conv1D`` (GPT-2's attention and MLP projections): ``y = x W + b`` with the
  weight stored as ``(in_features, out_features)``, i.e. a Linear layer with a transposed weight.
* ``timm.layers.Linear`` (heads of timm models): an ``nn.Linear`` subclass whose own ``forward`` only casts
  the weight under TorchScript, so it computes exactly what ``nn.Linear`` does; the engine leaves out a
  subclass with its own forward unless its type is registered.
"""

from __future__ import annotations

import sys

from kfac_bench.kfac import LinearHandler, register_layer_type

__all__ = ["register_harness_layer_types"]


def register_harness_layer_types() -> list[str]:
    """Register the layer types above whose library is loaded; returns their qualified class names.

    A model built with ``transformers`` has imported it, so a library that is not loaded has no layers in
    any model yet: it is not imported here (importing ``transformers`` takes seconds).
    """
    registered = []
    if "transformers" in sys.modules:
        from transformers.pytorch_utils import Conv1D

        register_layer_type(Conv1D, LinearHandler(transposed=True))
        registered.append(f"{Conv1D.__module__}.{Conv1D.__qualname__}")
    if "timm" in sys.modules:
        from timm.layers import Linear

        register_layer_type(Linear, LinearHandler())
        registered.append(f"{Linear.__module__}.{Linear.__qualname__}")
    return registered
