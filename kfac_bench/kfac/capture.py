"""Capture: the forward and backward hooks that accumulate each layer's batch factors.

A forward hook computes the input factor's contribution from the layer input; it registers a hook on the
autograd node that produced the layer output, which computes the output-gradient factor's contribution when
backward reaches it. Micro-batches are counted by forwards of the root module; once the last micro-batch's
gradient hooks of a layer have all fired, its batch factors are final and ``on_final(layer)`` is called, so
that their reduction can start while backward goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .options import FactorScaling
from .state import LayerState
from .timing import StageTimer


class Capture:
    """The hooks of one preconditioner on ``model`` and its registered ``layers``."""

    def __init__(
        self,
        model: nn.Module,
        layers: dict[str, LayerState],
        *,
        factor_dtype: torch.dtype,
        scaling: FactorScaling,
        accumulation_steps: int,
        grad_scaler: Any,
        on_final: Callable[[LayerState], None],
        timer: StageTimer,
    ) -> None:
        self.layers = layers
        self.factor_dtype = factor_dtype
        self.scaling = scaling
        self.accumulation_steps = accumulation_steps
        self.grad_scaler = grad_scaler
        self.on_final = on_final
        self.timer = timer
        self.collecting = False
        self.micro_batches = 0
        for layer in layers.values():
            layer.handles.append(layer.module.register_forward_hook(self._forward_hook(layer)))
        self._root_handle = model.register_forward_pre_hook(self._count_micro_batch)

    def start_step(self, collect: bool) -> None:
        """A new optimizer step begins; ``collect``: whether its factors are due."""
        self.collecting = collect
        self.micro_batches = 0

    def remove(self) -> None:
        """Detach every hook."""
        for layer in self.layers.values():
            layer.remove_hooks()
        self._root_handle.remove()
        self.collecting = False

    def _count_micro_batch(self, module: nn.Module, args: Any) -> None:
        if self.collecting and torch.is_grad_enabled():
            self.micro_batches += 1

    def _forward_hook(self, layer: LayerState) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not (
                self.collecting and torch.is_grad_enabled() and isinstance(output, torch.Tensor)
            ):
                return
            with self.timer("factor", sync=False):
                gram = layer.handler.a_gram(module, args[0].detach(), self.factor_dtype)
                layer.a_batch.add(gram, self.scaling, False, layer.handler.spatial)
            layer.seen_a = True
            node = output.grad_fn
            if node is not None:
                # A prehook on the node that produced the output sees dL/d(output) even when the output
                # is later modified in place (e.g. an inplace ReLU), unlike a tensor hook.
                node.register_prehook(self._grad_hook(layer, module, output.output_nr))
                layer.pending_g += 1

        return hook

    def _grad_hook(
        self, layer: LayerState, module: nn.Module, index: int
    ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            g = grad_outputs[index]
            if g is None:
                return
            with self.timer("factor", sync=False):
                gram = layer.handler.g_gram(module, g.detach(), self.factor_dtype)
                scale = self._loss_scale()
                if scale is not None:
                    gram = gram._replace(sum=gram.sum / scale**2)
                layer.g_batch.add(gram, self.scaling, True, layer.handler.spatial)
            layer.seen_g = True
            layer.pending_g -= 1
            if layer.pending_g == 0 and self.micro_batches >= self.accumulation_steps:
                self.on_final(layer)

        return hook

    def _loss_scale(self) -> torch.Tensor | float | None:
        s = self.grad_scaler
        if s is None:
            return None
        if hasattr(s, "is_enabled"):
            if not s.is_enabled():
                return None
            # The scale as a device tensor: reading it as a float would synchronise every backward hook.
            scale_async = getattr(s, "_get_scale_async", None)
            return scale_async() if scale_async is not None else float(s.get_scale())
        return s()
