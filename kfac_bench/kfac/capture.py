"""Capture: the forward and backward hooks that accumulate each layer's batch factors.

A forward hook computes the input factor's contribution of one call from the layer input and registers a
hook on the autograd node that produced the layer output; when backward reaches that node, the hook computes
the output-gradient factor's contribution of the same call. A call's two contributions are added to the
layer's sums together, once its backward pass is known (see :func:`kfac_bench.kfac.factors.fold`). For
handlers with batched grams (Linear-type, Conv2d, Conv1d) both contributions are computed together with
those of the same-shaped calls of other layers, once the last of them has its gradient
(:mod:`.batching`); the sums are the same.

Contract (what a training loop may do):

* **A micro-batch is one backward pass** that reaches the registered layers. ``step()`` expects
  ``accumulation_steps`` of them; any number of forwards may feed one backward (two views, a siamese pair,
  a layer applied several times): the calls of a layer in one backward are position sets of the same
  examples. Counting backward passes (with a callback queued on autograd's engine from the first gradient
  hook of each pass) cannot be fooled by extra forwards, unlike counting forwards of the root module.
* A forward counts only while factors are due, with gradients enabled, in training mode (``module.training``
  of the layer) and outside a backward pass: validation in ``eval()`` mode, forwards under ``no_grad`` and
  the recomputation of non-reentrant activation checkpointing leave factors and counters untouched.
* A call counts in the backward pass that reaches its output (autograd is asked, at the pass's first
  gradient hook, which nodes it will execute): a forward whose output is not backpropagated before
  ``step()`` contributes nothing, not to A, G or ``L``, even while its graph is alive; the engine holds
  the output's autograd node until its gradient arrives or ``step()``, so such a forward's graph lives
  until ``step()`` (run it under ``no_grad`` or in ``eval()`` mode to free it at once).
* Activation checkpointing: non-reentrant (``use_reentrant=False``) captures the original forward and skips
  the recomputation; reentrant (``use_reentrant=True``) runs the original forward without gradients, so the
  recomputed forward (inside the backward pass, backpropagated in a nested pass) is the one captured, and
  the micro-batch is still the outer backward pass. Factors are the same as without checkpointing.
* Two backward passes through one graph (``backward(retain_graph=True)`` then ``backward()``) while factors
  are due raise: ``.grad`` would hold the sum of both gradients and G only the first one's.
* A copy of the model (``copy.deepcopy``) carries the hooks but does not feed this preconditioner.
* Not supported: ``torch.autograd.grad`` through registered layers while factors are due (it is taken for a
  backward pass); a gradient penalty (``autograd.grad(..., create_graph=True)``, then ``backward``) raises,
  naming the two workarounds: its forward in ``eval()`` mode, or penalties on steps without factors.
* A call with no rows (an MoE expert no token was routed to) is no call: it updates neither factor.
* Under ``'expand'`` scaling ``L``, the terms of a backward pass (:mod:`.factors`), is the most rows a
  Linear-type layer processed in the calls that pass backpropagates; reentrant checkpointing's first
  forward (run without gradients) counts in the pass that reaches its checkpoint, any other forward without
  gradients nowhere.
* A layer's input is its first positional argument or its ``input`` keyword; its examples lie along
  ``batch_dim`` (0, or 1 for sequence-first layers, see ``KFACPreconditioner(batch_dim=...)``).

Every factor is computed outside autocast, from the input upcast to the factor dtype, so AMP neither lowers
its precision nor lets its sums overflow; with a loss scaler G is divided by the scale squared (exact for the
power-of-two scales of ``GradScaler``).

In a distributed run the last backward pass of a step hands each layer to ``on_final`` as soon as all its
calls that this pass backpropagates have their gradient, so that the reduction of its factors overlaps the
rest of the backward pass.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .batching import PendingGrams
from .factors import fold
from .layers import Gram
from .layers.attention import install_attention_forward
from .options import FactorScaling
from .outside import OutsideGradients
from .state import Call, LayerState
from .subsample import ExampleSubset, PositionSubset, subset_size
from .timing import Stage, StageTimer


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
        #: ``L`` of the running backward pass (:meth:`terms`), counted when it starts, and its sum over
        #: the step's backward passes (``'expand'`` normalises G of Linear-type layers with it).
        self._terms = 0
        self.step_terms = 0
        #: Rows of Linear-type calls in reentrant checkpoints' first forwards: (layer, the checkpoint's
        #: autograd node, weakly, rows), counted in the pass that reaches that node.
        self._unrecorded: list[tuple[str, weakref.ref[Any], int]] = []
        #: The check for weights that also receive gradient outside their module's call (:mod:`.outside`).
        self.outside = OutsideGradients()
        #: Calls whose grams are computed with their key's other calls (:mod:`.batching`), and how many
        #: calls of each layer wait for their key's batch with their gradient arrived.
        self.batch = PendingGrams(factor_dtype, self._deliver)
        self._held_layers: dict[str, int] = {}
        for layer in layers.values():
            self.attach(layer)

    def start_step(self, collect: bool) -> None:
        """A new optimizer step begins; ``collect``: whether its factors are due. Calls whose output was
        never backpropagated are dropped."""
        self.batch.clear()
        self._held_layers.clear()
        for layer in self.layers.values():
            layer.calls.clear()
            self._close(layer)
        self._unrecorded.clear()
        self.step_terms = 0
        self.collecting = collect
        self.backwards = 0

    def remove(self) -> None:
        """Detach every hook."""
        for layer in self.layers.values():
            layer.remove_hooks()
        self.collecting = False

    def attach(self, layer: LayerState) -> None:
        """Hook ``layer``'s module (keyword inputs included: ``m(input=x)``)."""
        hook = self._forward_hook(layer)
        layer.handles.append(layer.module.register_forward_hook(hook, with_kwargs=True))
        if layer.attention is not None:
            assert isinstance(layer.attention, torch.nn.MultiheadAttention)
            layer.handles.append(install_attention_forward(layer.attention))

    def _forward_hook(self, layer: LayerState) -> Callable[..., None]:
        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            # ``copy.deepcopy(model)`` copies the hook dicts with this very closure: a copy's module is
            # not the registered one and must not feed this preconditioner's factors.
            if module is not layer.module or not (self.collecting and module.training):
                return
            x = _layer_input(args, kwargs)
            if x is None or x.numel() == 0:
                return  # a call with no rows (an idle MoE expert) is no call: it updates no factor
            task = _graph_task_id()
            if not (
                torch.is_grad_enabled()
                and isinstance(output, torch.Tensor)
                and output.grad_fn is not None
            ):
                if task == -1 and not layer.handler.spatial:
                    # Reentrant checkpointing's first forward: its rows count in L of the backward pass
                    # that reaches the checkpoint (the recomputation is not tallied again). Any other
                    # forward without a graph (under no_grad) never receives a gradient: it counts nowhere.
                    ctx = _reentrant_checkpoint()
                    if ctx is not None:
                        self._unrecorded.append((layer.name, ctx, self._row_count(layer, x, True)))
                return
            if task != -1 and _recomputing_nonreentrant():
                return  # the original forward was captured; this recomputation is never backpropagated
            x_in, x = x, x.detach()
            if layer.batch_dim:
                x = x.movedim(layer.batch_dim, 0)
            rows = None
            if self.subset is not None:
                rows = self.subset.rows(x, self.backwards, layer.handler.spatial)
                x = x if rows is None else x.index_select(0, rows)
            pos = self._position_rows(layer, output)
            # Under saved-tensor hooks (activation checkpointing, offloading) autograd does not keep the
            # input: holding it for a batch would undo the memory they save, so the call goes alone.
            batched = rows is None and pos is None and not _saved_tensor_hooks()
            key = self.batch.key(layer, x) if batched else None
            if key is not None:  # computed with the key's other calls (:mod:`.batching`)
                call = Call(None, key=key)
                self.batch.record(key, layer, call, x)
            else:
                call = Call(self._a_gram(layer, module, x, pos, output), rows=rows, positions=pos)
            node, index, shape = _grad_node(output)
            call.node = node
            call.row_count = self._row_count(layer, x, False)
            layer.calls.append(call)
            if task != -1:
                # Reentrant activation checkpointing recomputes the forward inside the outer backward pass
                # and backpropagates it in a nested one: the micro-batch is the outer pass.
                call.nested = True
                self._enter_backward()
                call.task = self._task
            if self.outside.active:
                self.outside.watch(layer, output, x_in)
            # A prehook on the node that produced the output sees dL/d(output) even when the output is
            # later modified in place (e.g. an inplace ReLU), unlike a tensor hook. The output of a Linear on
            # a >= 3-D input is a view of the (N·T, out) product, and an in-place op on a view takes the
            # view's node out of the graph: hook the base's node then (same numbers, reshaped). The hook
            # refers to the call weakly: the graph (and its hooks) outlives the backward pass while the
            # loss is alive, and must not keep the call's input gram alive after it is folded in or dropped.
            node.register_prehook(self._grad_hook(layer, weakref.ref(call), index, shape))

        return hook

    def _a_gram(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        x: torch.Tensor,
        pos: torch.Tensor | None,
        output: torch.Tensor,
    ) -> Gram:
        """The input-factor gram of one call, computed now (handlers without batched grams)."""
        with (
            self.timer(Stage.FACTOR, sync=False),
            _no_autocast(x.device.type),
            _named(layer, "A"),
        ):
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
        _check_shape(layer, "A", a.sum, layer.a_dim)
        return a

    def _position_rows(self, layer: LayerState, output: torch.Tensor) -> torch.Tensor | None:
        """The output rows a conv call's factors use (``factor_position_fraction``); None: all."""
        if self.positions is None or output.dim() < 3 or not self.positions.applies(layer.handler):
            return None
        return self.positions.rows(layer.name, self.backwards, output.shape[-2], output.device)

    def _grad_hook(
        self, layer: LayerState, ref: weakref.ref[Call], index: int, shape: torch.Size | None
    ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        # The backward pass that delivered this call's gradient, and whether it built a graph of its own.
        first_task: list[int] = []

        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            task = _graph_task_id()
            if first_task and first_task[0] != task and self.collecting:
                raise RuntimeError(_second_pass_message(layer.name, bool(first_task[1])))
            # Inside a backward pass grad mode is on only with create_graph=True (double backward).
            first_task[:] = [task, int(torch.is_grad_enabled())]
            call = ref()
            # Gone or done: dropped by start_step().
            if call is None or call.done or call not in layer.calls:
                return
            call.done = True
            if not call.nested:
                self._enter_backward()  # first: L of this pass counts this call's rows too
            layer.calls.remove(call)
            call.node = None
            g = grad_outputs[index]
            if g is not None:
                g = g.detach()
                if shape is not None:
                    g = g.reshape(shape)
                if layer.batch_dim:
                    g = g.movedim(layer.batch_dim, 0)
            if call.key is not None:  # the grams wait for the key's other calls
                if g is not None:
                    self._held_layers[layer.name] = self._held_layers.get(layer.name, 0) + 1
                with self.timer(Stage.FACTOR, sync=False), _no_autocast(layer.device.type):
                    self.batch.arrive(call.key, call, g, self._loss_scale())
                self._settle(layer)
                return
            if g is not None:
                assert call.a is not None
                weight = 1.0
                if call.rows is not None and self.subset is not None and g.shape[0] > 1:
                    weight = self.subset.g_weight(g.shape[0], call.rows.numel())
                    g = g.index_select(0, call.rows)
                with (
                    self.timer(Stage.FACTOR, sync=False),
                    _no_autocast(g.device.type),
                    _named(layer, "G"),
                ):
                    if call.positions is None:
                        gram = layer.handler.g_gram(layer.module, g, self.factor_dtype)
                    else:
                        gram = PositionSubset.g_gram(
                            layer.handler, layer.module, g, self.factor_dtype, call.positions
                        )
                    if weight != 1.0:
                        gram = gram._replace(sum=gram.sum.mul_(weight))
                self._receive(layer, call.a, gram, self._loss_scale())
            self._settle(layer)

        return hook

    def _receive(self, layer: LayerState, a: Gram, g: Gram, scale: Any) -> None:
        """A call's two grams: into the running backward pass's group of the layer."""
        if scale is not None:
            g = g._replace(sum=g.sum / scale**2)
        _check_shape(layer, "A", a.sum, layer.a_dim)
        _check_shape(layer, "G", g.sum, layer.g_dim)
        if not layer.group:
            self._touched.append(layer)
        layer.group.append((a, g))
        layer.received = True

    def _settle(self, layer: LayerState) -> None:
        """Once none of the layer's calls that this pass backpropagates waits for a gradient or a batch:
        fold its group, and in the last backward pass of a step hand it over (the reduction overlaps the
        rest of the pass)."""
        if (
            layer.group
            and not any(c.task == self._task for c in layer.calls)
            and not self._waiting(layer)
        ):
            self._close(layer)
            if self.backwards == self.accumulation_steps - 1:
                self.on_final(layer)

    def _waiting(self, layer: LayerState) -> bool:
        """Whether a call of ``layer`` whose gradient arrived still waits for its key's batch."""
        return layer.name in self._held_layers

    def _deliver(self, layer: LayerState, a: Gram, g: Gram, scale: Any) -> None:
        """A batched call's grams (:mod:`.batching`)."""
        self._held_layers[layer.name] -= 1
        if not self._held_layers[layer.name]:
            del self._held_layers[layer.name]
        self._receive(layer, a, g, scale)
        self._settle(layer)

    def _row_count(self, layer: LayerState, x: torch.Tensor, unrecorded: bool) -> int:
        """Rows of a Linear-type call for ``L`` (``'expand'``, see :mod:`.factors`); 0 for convolutions.
        ``x``: the call's input as recorded (after ``factor_batch_fraction``'s draw), or, ``unrecorded``,
        the whole input of a forward run without gradients (the draw's share of it)."""
        if layer.handler.spatial:
            return 0
        n = 1 if x.dim() <= 1 else x.numel() // max(1, x.shape[-1])
        if unrecorded and self.subset is not None and x.dim() > 1:
            n = (
                n
                * subset_size(self.subset.fraction, x.shape[layer.batch_dim])
                // max(1, x.shape[layer.batch_dim])
            )
        return n

    def terms(self) -> int:
        """``L`` of the running backward pass: the most rows a Linear-type layer processed in the calls
        this pass backpropagates (0: none)."""
        return self._terms

    def _enter_backward(self) -> None:
        """At a backward pass's first gradient hook: find the calls it backpropagates (autograd knows
        which nodes it will execute), count ``L`` from them, and queue the end-of-backward callback."""
        task = _graph_task_id()
        if task == self._task:
            return
        self._task = task
        tally: dict[str, list[int]] = {}
        for layer in self.layers.values():
            for call in layer.calls:
                if call.task == -2 and not call.nested and _will_execute(call.node):
                    call.task = task
                if call.task == task and not call.nested and call.row_count:
                    tally.setdefault(layer.name, [0, 0])[0] += call.row_count
        waiting = []
        for name, ref, n in self._unrecorded:
            ctx = ref()
            if ctx is None:
                continue
            if _will_execute(ctx):
                t = tally.setdefault(name, [0, 0])
                t[1] = max(t[1], n)
            else:
                waiting.append((name, ref, n))
        self._unrecorded = waiting
        self._terms = max((max(t) for t in tally.values()), default=0)
        self.step_terms += self._terms
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        with self.timer(Stage.FACTOR, sync=False):
            self.batch.flush()
        for layer in self._touched:
            self._close(layer)
        self._touched.clear()
        self._terms = 0
        self.backwards += 1
        self.ever = True
        self._task = -2

    def _close(self, layer: LayerState) -> None:
        """Fold the calls of the running backward pass into the layer's factor sums."""
        if not layer.group:
            return
        with self.timer(Stage.FACTOR, sync=False):
            a, g = fold(self.scaling, layer.handler.spatial, layer.group, self.terms())
            layer.a_batch.add(*a)
            layer.g_batch.add(*g)
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


def _second_pass_message(name: str, create_graph: bool) -> str:
    """The error for a call's output differentiated twice while factors are due (one line, with the fix
    that applies to what the first pass was)."""
    if create_graph:
        return (
            f"K-FAC layer '{name}': its output was differentiated with create_graph=True (e.g. "
            "torch.autograd.grad for a gradient penalty) and then backpropagated again: K-FAC records a "
            "call's output gradient once per backward pass and cannot tell the penalty's from the loss's; "
            "run the penalty's forward with the model in eval() mode (K-FAC records training-mode forwards "
            "only), or add the penalty on steps where factors are not due (factor_update_steps > 1, "
            "as lazy R1 regularisation does)"
        )
    return (
        f"K-FAC layer '{name}': a second backward pass through the same graph "
        "(backward(retain_graph=True), then backward again): .grad holds the sum of both "
        "gradients but G only the first one's; add the losses and call backward() once"
    )


def _will_execute(node: Any) -> bool:
    """Whether the running backward pass will execute autograd ``node`` (reach it from its roots)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (
        AttributeError,
        RuntimeError,
    ):  # pragma: no cover - other torch versions: assume it does
        return True


def _checkpoint_forward_code() -> Any:
    from torch.utils import checkpoint

    fn = getattr(checkpoint, "CheckpointFunction", None)
    return getattr(getattr(fn, "forward", None), "__code__", None)


_CHECKPOINT_FORWARD = _checkpoint_forward_code()


def _reentrant_checkpoint() -> weakref.ref[Any] | None:
    """Inside reentrant activation checkpointing's first forward (``CheckpointFunction.forward``, run
    without gradients): a weak reference to its autograd node (the ``ctx`` of that frame), else None."""
    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < 64:
        if frame.f_code is _CHECKPOINT_FORWARD:
            ctx = frame.f_locals.get("ctx")
            return None if ctx is None else weakref.ref(ctx)
        frame = frame.f_back  # type: ignore[assignment]
        depth += 1
    return None


def _recomputing_nonreentrant() -> bool:
    """Whether this forward is non-reentrant activation checkpointing's recomputation (it runs under the
    checkpoint's own saved-tensor hooks); any other forward inside a backward pass with gradients enabled is
    reentrant checkpointing's (``use_reentrant=True``), whose output is what that backward differentiates."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - other torch versions
        return True
    if hooks is None:
        return False
    pack = hooks[0]
    return bool(getattr(pack, "_checkpoint_internal", False)) or "_recomputation_hook" in getattr(
        pack, "__qualname__", ""
    )


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (``torch.utils.checkpoint`` without reentrancy, offloading)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - other torch versions
        return False


def _layer_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's input: its first positional argument, else its ``input`` keyword (or first tensor)."""
    if args:
        x = args[0]
    else:
        x = kwargs.get(
            "input", next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        )
    return x if isinstance(x, torch.Tensor) else None


def _grad_node(output: torch.Tensor) -> tuple[Any, int, torch.Size | None]:
    """The autograd node (and its output index) whose incoming gradient is dL/d(output), and the shape to
    reshape it to when that node is the view base's: a view covering its whole base in the same order (the
    ``(N, T, out)`` view of ``F.linear``'s ``(N·T, out)`` product) has the same gradient, and its base's node
    stays in the graph when the view is later modified in place."""
    base = output._base if output._is_view() else None
    if (
        base is not None
        and base.grad_fn is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
        and base.storage_offset() == output.storage_offset()
    ):
        return base.grad_fn, base.output_nr, output.shape
    return output.grad_fn, output.output_nr, None


@contextlib.contextmanager
def _named(layer: LayerState, factor: str) -> Iterator[None]:
    """Re-raise a handler's failure with the layer's name (a bare shape error names no layer)."""
    try:
        yield
    except Exception as err:
        raise RuntimeError(
            f"K-FAC layer '{layer.name}' ({type(layer.module).__name__}): computing its {factor} factor "
            f"failed ({type(err).__name__}: {err}); register a handler for its type or skip it with "
            f"skip_layers"
        ) from err


def _check_shape(layer: LayerState, factor: str, gram: torch.Tensor, dim: int) -> None:
    if gram.shape != (dim, dim):
        raise RuntimeError(
            f"K-FAC layer '{layer.name}' ({type(layer.module).__name__}): its {factor} factor is "
            f"{tuple(gram.shape)}, expected ({dim}, {dim}) from its parameters (its forward does not "
            f"compute what its handler models); register a handler for its type or skip it with skip_layers"
        )
