"""Factor grams of same-shaped calls computed together: a few batched ops per shape group, not per layer.

On a GPU every op is a kernel launch of several microseconds, however small its tensors; a ResNet's dozens of
same-shaped convolutions each running their own factor GEMMs spend more time launching than computing.
When a layer's handler implements :class:`~.layers.base.BatchedGrams` and its device holds calls
(:data:`HOLD`: a GPU does, the CPU does not), the capture hands each call's input and output gradient here
instead of computing its grams on arrival. Calls are keyed by the handler's ``batch_key`` (one shape, one
geometry); a key's calls are computed together when the last call of the key recorded in the running
forward has its gradient (or when what they hold passes :data:`MAX_HELD_BYTES`, or at the end of the
backward pass: a recorded call that the pass does not reach keeps its key waiting until then), and each
call's grams then go where the per-call path puts them. The grams are the same sums as the per-call path's,
computed by batched kernels.

The inputs held are the ones autograd holds for the layers' own backward anyway until their gradient
arrives; what the batching adds is the output gradients (and inputs) of a key's calls from their arrival to
the key's completion, bounded by :data:`MAX_HELD_BYTES` per key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from .layers import Gram
from .layers.base import BatchedGrams
from .state import Call, LayerState

#: Bytes of inputs and gradients one key may hold before its calls are computed (then it starts again).
MAX_HELD_BYTES = 1 << 28

#: Device type -> whether same-shaped calls are held and computed together (device types not listed: held).
#: The CPU computes each call's grams on its gradient's arrival: it launches nothing, so a batched op saves
#: no host time there, while a held call's input and gradient have left the cache by the time its key
#: completes. ResNet-32's factor stage (batch 128, 2 threads, side by side) took 303 ms held against 282 ms
#: on arrival; the BERT-like encoder's and the digits CNN's were faster on arrival too.
HOLD: dict[str, bool] = {"cpu": False}


@dataclass
class _Held:
    """One call waiting for its key's batch: its layer, input, and (once arrived) output gradient."""

    layer: LayerState
    call: Call
    x: torch.Tensor
    g: torch.Tensor | None = None
    scale: Any = None


@dataclass
class _Key:
    recorded: int = 0  # calls recorded in the forward whose gradient has not arrived
    ready: list[_Held] = field(default_factory=list)
    held_bytes: int = 0


class PendingGrams:
    """The held calls of one capture, by key; ``deliver(layer, a_gram, g_gram, scale)`` receives each
    call's grams once computed."""

    def __init__(
        self, dtype: torch.dtype, deliver: Callable[[LayerState, Gram, Gram, Any], None]
    ) -> None:
        self.dtype = dtype
        self.deliver = deliver
        self.keys: dict[Hashable, _Key] = {}

    @staticmethod
    def key(layer: LayerState, x: torch.Tensor) -> Hashable | None:
        """The batch key of a call of ``layer`` on ``x``; None when the call is computed on its own, on
        arrival: its device does not hold calls (:data:`HOLD`) or its handler computes calls one by one."""
        handler = layer.handler
        if not HOLD.get(x.device.type, True) or not batches(handler):
            return None
        assert isinstance(handler, BatchedGrams)
        key = handler.batch_key(layer.module, x, layer.bias)
        return None if key is None else (id(handler), layer.a_dim, layer.g_dim, key)

    def record(self, key: Hashable, layer: LayerState, call: Call, x: torch.Tensor) -> None:
        """A forward call whose grams wait for its gradient (``call.a`` is then the key)."""
        call.held = _Held(layer, call, x)
        self.keys.setdefault(key, _Key()).recorded += 1

    def arrive(self, key: Hashable, call: Call, g: torch.Tensor | None, scale: Any) -> None:
        """The call's output gradient (None: no gradient reached it); computes the key's calls when it was
        the last one recorded, or when the key holds too much."""
        entry = self.keys[key]
        entry.recorded -= 1
        held = call.held
        call.held = None
        if g is not None and held is not None:
            held.g, held.scale = g, scale
            entry.ready.append(held)
            entry.held_bytes += _nbytes(held.x) + _nbytes(g)
        if entry.recorded <= 0 or entry.held_bytes >= MAX_HELD_BYTES:
            self._compute(key, entry)

    def drop(self, key: Hashable) -> None:
        """A recorded call that will never get its gradient (dropped at ``start_step``)."""
        entry = self.keys.get(key)
        if entry is not None:
            entry.recorded -= 1

    def flush(self) -> None:
        """Compute every key's arrived calls (end of a backward pass)."""
        for key, entry in list(self.keys.items()):
            self._compute(key, entry)

    def held_bytes(self) -> int:
        """Bytes of the inputs and output gradients held for calls whose gradient has arrived (before
        it, the input is the one autograd holds for the layer's own backward)."""
        return sum(entry.held_bytes for entry in self.keys.values())

    def clear(self) -> None:
        self.keys.clear()

    def _compute(self, key: Hashable, entry: _Key) -> None:
        ready, entry.ready, entry.held_bytes = entry.ready, [], 0
        if entry.recorded <= 0:
            self.keys.pop(key, None)
        if not ready:
            return
        handler = ready[0].layer.handler
        assert isinstance(handler, BatchedGrams)
        modules = [h.layer.module for h in ready]
        a = handler.a_grams(modules, [h.x for h in ready], self.dtype, ready[0].layer.bias)
        gs = [h.g for h in ready]
        g = handler.g_grams(modules, gs, self.dtype)  # type: ignore[arg-type]
        for h, ag, gg in zip(ready, a, g):
            self.deliver(h.layer, ag, gg, h.scale)


def batches(handler: object) -> bool:
    """Whether ``handler`` computes its layers' grams in batches: it implements :class:`BatchedGrams`, and
    its per-call ``a_gram``/``g_gram`` are those of the class that gives it ``a_grams``/``g_grams`` (a
    subclass that overrides a per-call gram but not its batched form, e.g. a scaled ``LinearHandler``,
    is computed call by call, with its own grams)."""
    return isinstance(handler, BatchedGrams) and _own_batched_grams(type(handler))


@functools.cache
def _own_batched_grams(cls: type) -> bool:
    for one, many in (("a_gram", "a_grams"), ("g_gram", "g_grams")):
        owner = next(c for c in cls.__mro__ if many in vars(c))
        if getattr(cls, one) is not getattr(owner, one):
            return False
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
