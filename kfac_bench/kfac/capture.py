"""Capture: the forward and backward hooks that accumulate each layer's batch factors.

A forward hook computes the input factor's contribution of one call from the layer input and registers a
hook on the autograd node that produced the layer output; when backward reaches that node, the hook computes
the output-gradient factor's contribution of the same call. A call's two contributions are added to the
layer's sums together, once its backward pass is known (see :func:`kfac_bench.kfac.factors.fold`).

Contract (what a training loop may do):

* **A micro-batch is one backward pass** that reaches the registered layers. ``step()`` expects
  ``accumulation_steps`` of them; any number of forwards may feed one backward (two views, a siamese pair,
  a layer applied several times): the calls of a layer in one backward are position sets of the same
  examples. Counting backward passes (with a callback queued on autograd's engine from the first gradient
  hook of each pass) cannot be fooled by extra forwards, unlike counting forwards of the root module.
* A forward counts only while factors are due, with gradients enabled, in training mode (``module.training``
  of the layer) and outside a backward pass: validation in ``eval()`` mode, forwards under ``no_grad`` and
  the recomputation of non-reentrant activation checkpointing leave factors and counters untouched.
* A forward whose output is not backpropagated before ``step()`` contributes nothing (not even to A).
* Not supported: ``torch.autograd.grad`` through registered layers while factors are due (it is taken for a
  backward pass), and reentrant activation checkpointing (layers inside it get no factors and keep plain
  gradients, see ``coverage()``).

Every factor is computed outside autocast, from the input upcast to the factor dtype, so AMP neither lowers
its precision nor lets its sums overflow; with a loss scaler G is divided by the scale squared (exact for the
power-of-two scales of ``GradScaler``).

In a distributed run the last backward pass of a step hands each layer to ``on_final`` as soon as all its
calls have their gradient, so that the reduction of its factors overlaps the rest of the backward pass.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .factors import fold
from .options import FactorScaling
from .state import Call, LayerState
from .subsample import ExampleSubset, PositionSubset
from .timing import StageTimer


def _graph_task_id() -> int:
    """Id of the backward pass running in this thread, -1 outside one."""
    return int(torch._C._current_graph_task_id())


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    """Disable autocast for ``device_type`` if it is on (factor products run in the factor dtype)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (e.g. meta)
        enabled = False
    if enabled:
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


class Capture:
    """The hooks of one preconditioner on its registered ``layers`` (module docstring: the contract)."""

    def __init__(
        self,
        layers: dict[str, LayerState],
        *,
        factor_dtype: torch.dtype,
        scaling: FactorScaling,
        accumulation_steps: int,
        grad_scaler: Any,
        on_final: Callable[[LayerState], None],
        timer: StageTimer,
        subset: ExampleSubset | None = None,
        positions: PositionSubset | None = None,
    ) -> None:
        self.layers = layers
        self.factor_dtype = factor_dtype
        self.scaling = scaling
        self.accumulation_steps = accumulation_steps
        self.grad_scaler = grad_scaler
        self.on_final = on_final
        self.timer = timer
        #: Factors from part of each batch (``factor_batch_fraction`` < 1); None: every example.
        self.subset = subset
        #: Conv factors from part of the output positions (``factor_position_fraction`` < 1); None: all.
        self.positions = positions
        self.collecting = False
        #: Backward passes that reached the layers since the last ``step()`` (while collecting).
        self.backwards = 0
        #: Whether any backward pass ever reached the layers (or factors were restored).
        self.ever = False
        self._task = -2  # graph task whose end-of-backward callback is queued
        self._touched: list[LayerState] = []
        for layer in layers.values():
            layer.handles.append(layer.module.register_forward_hook(self._forward_hook(layer)))

    def start_step(self, collect: bool) -> None:
        """A new optimizer step begins; ``collect``: whether its factors are due. Calls whose output was
        never backpropagated are dropped."""
        for layer in self.layers.values():
            layer.calls.clear()
            self._close(layer)
        self.collecting = collect
        self.backwards = 0

    def remove(self) -> None:
        """Detach every hook."""
        for layer in self.layers.values():
            layer.remove_hooks()
        self.collecting = False

    def _forward_hook(self, layer: LayerState) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not (
                self.collecting
                and module.training
                and torch.is_grad_enabled()
                and isinstance(output, torch.Tensor)
                and output.grad_fn is not None
                and _graph_task_id() == -1
            ):
                return
            x = args[0].detach()
            rows = None
            if self.subset is not None:
                rows = self.subset.rows(x, self.backwards, layer.handler.spatial)
                x = x if rows is None else x.index_select(0, rows)
            pos = self._position_rows(layer, output)
            with self.timer("factor", sync=False), _no_autocast(x.device.type):
                if pos is None:
                    a = layer.handler.a_gram(module, x, self.factor_dtype, layer.bias)
                else:
                    a = PositionSubset.a_gram(
                        layer.handler,
                        module,
                        x,
                        self.factor_dtype,
                        layer.bias,
                        pos,
                        output.shape[-2],
                    )
                call = Call(a, rows=rows, positions=pos)
            layer.calls.append(call)
            # A prehook on the node that produced the output sees dL/d(output) even when the output
            # is later modified in place (e.g. an inplace ReLU), unlike a tensor hook. It refers to the
            # call weakly: the graph (and its hooks) outlives the backward pass while the loss is alive,
            # and must not keep the call's input gram alive after it is folded in or dropped.
            output.grad_fn.register_prehook(
                self._grad_hook(layer, weakref.ref(call), output.output_nr)
            )

        return hook

    def _position_rows(self, layer: LayerState, output: torch.Tensor) -> torch.Tensor | None:
        """The output rows a conv call's factors use (``factor_position_fraction``); None: all."""
        if self.positions is None or output.dim() < 3 or not self.positions.applies(layer.handler):
            return None
        return self.positions.rows(layer.name, self.backwards, output.shape[-2], output.device)

    def _grad_hook(
        self, layer: LayerState, ref: weakref.ref[Call], index: int
    ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            call = ref()
            # Gone or done: dropped by start_step(), or a second backward through a retained graph.
            if call is None or call.done or call not in layer.calls:
                return
            call.done = True
            layer.calls.remove(call)
            self._enter_backward()
            g = grad_outputs[index]
            if g is not None:
                g = g.detach()
                weight = 1.0
                if call.rows is not None and self.subset is not None and g.shape[0] > 1:
                    weight = self.subset.g_weight(g.shape[0], call.rows.numel())
                    g = g.index_select(0, call.rows)
                with self.timer("factor", sync=False), _no_autocast(g.device.type):
                    if call.positions is None:
                        gram = layer.handler.g_gram(layer.module, g, self.factor_dtype)
                    else:
                        gram = PositionSubset.g_gram(
                            layer.handler, layer.module, g, self.factor_dtype, call.positions
                        )
                    scale = self._loss_scale()
                    if scale is not None:
                        gram = gram._replace(sum=gram.sum / scale**2)
                    if weight != 1.0:
                        gram = gram._replace(sum=gram.sum.mul_(weight))
                if not layer.group:
                    self._touched.append(layer)
                layer.group.append((call.a, gram))
            if not layer.calls and layer.group:
                self._close(layer)
                if self.backwards == self.accumulation_steps - 1:
                    self.on_final(layer)

        return hook

    def _enter_backward(self) -> None:
        """Queue the end-of-backward callback once per backward pass."""
        task = _graph_task_id()
        if task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        for layer in self._touched:
            self._close(layer)
        self._touched.clear()
        self.backwards += 1
        self.ever = True
        self._task = -2

    def _close(self, layer: LayerState) -> None:
        """Fold the calls of the running backward pass into the layer's factor sums."""
        if not layer.group:
            return
        with self.timer("factor", sync=False):
            (a_sum, a_n), (g_sum, g_n) = fold(self.scaling, layer.handler.spatial, layer.group)
            layer.a_batch.add(a_sum, a_n)
            layer.g_batch.add(g_sum, g_n)
        layer.group.clear()

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
