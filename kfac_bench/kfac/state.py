"""Per-layer state of the preconditioner: accumulators, running factors, second-order parts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .assignment import LayerWork
from .factors import normalise, normaliser
from .layers import Gram, LayerHandler
from .options import Factor, FactorScaling
from .second_order import Parts, Result


class Removable(Protocol):
    """A handle with ``remove()`` (a hook's, or the attention forward's, :mod:`.layers.attention`)."""

    def remove(self) -> None: ...


@dataclass
class Accumulator:
    """The weighted sum of a factor's contributions since the last factor update (``weight · total``: a
    lone contribution's weight is applied with the normalisation, not in an op of its own), and its count."""

    total: torch.Tensor | None = None
    count: int = 0
    weight: float = 1.0

    def add(self, weighted_sum: torch.Tensor, count: int, weight: float = 1.0) -> None:
        if self.total is None:
            self.total, self.weight = weighted_sum, weight
        else:
            if self.weight != 1.0:
                self.total.mul_(self.weight)
                self.weight = 1.0
            self.total.add_(weighted_sum, alpha=weight)
        self.count += count

    def pop(
        self, scaling: FactorScaling, is_g: bool, count: int | None = None
    ) -> torch.Tensor | None:
        """The normalised batch factor, in the accumulated sum's own buffer (None if nothing was
        accumulated), normalised with ``count`` in place of the accumulated one when given; resets the
        accumulator."""
        if self.total is None:
            return None
        out = normalise(
            self.total, self.count if count is None else count, scaling, is_g, self.weight
        )
        self.total, self.count, self.weight = None, 0, 1.0
        return out

    def pop_unscaled(
        self, scaling: FactorScaling, is_g: bool, count: int | None = None
    ) -> tuple[torch.Tensor, float] | None:
        """``(sum, scale)`` whose product is :meth:`pop`'s batch factor (``count`` as there), left for the
        caller to apply (to many factors in one op); resets the accumulator."""
        if self.total is None:
            return None
        n = self.count if count is None else count
        out = (self.total, self.weight * normaliser(n, scaling, is_g))
        self.total, self.count, self.weight = None, 0, 1.0
        return out


@dataclass(eq=False)
class Call:
    """One forward call of a layer whose output gradient has not arrived yet: its input-factor gram, or
    (batched, :mod:`.batching`) its key, the gram computed with its key's other calls."""

    a: Gram | None
    done: bool = False
    # The examples its factors use (``factor_batch_fraction`` < 1, see :mod:`.subsample`); None: all.
    rows: torch.Tensor | None = None
    # Recomputed by reentrant activation checkpointing: its gradient arrives in a nested backward pass.
    nested: bool = False
    # The rows of output positions its factors use (``factor_position_fraction`` < 1); None: all.
    positions: torch.Tensor | None = None
    # Batched calls: the batch key and what the batch holds for the call until its key is computed.
    key: Any = None
    held: Any = None
    # The autograd node whose gradient is the call's output gradient: a backward pass counts the call
    # (rows in L, its G) only if it executes this node. Dropped once the gradient arrived.
    node: Any = None
    # Rows of a Linear-type call, for L (0 for convolutions).
    row_count: int = 0
    # The backward pass that delivers its gradient (-2: not known yet).
    task: int = -2


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer."""

    name: str
    module: nn.Module
    handler: LayerHandler
    a_dim: int
    g_dim: int
    bias: bool = False  # the block includes a (trainable) bias column
    batch_dim: int = (
        0  # the examples' dimension of the layer's input and output (1: sequence-first)
    )
    work: LayerWork | None = None
    a_batch: Accumulator = field(default_factory=Accumulator)
    g_batch: Accumulator = field(default_factory=Accumulator)
    # Forward calls waiting for their output gradient, and the calls of the running backward pass.
    calls: list[Call] = field(default_factory=list)
    group: list[tuple[Gram, Gram]] = field(default_factory=list)
    a_factor: torch.Tensor | None = None
    g_factor: torch.Tensor | None = None
    # Second-order parts held on this rank ("a", "g" and the method's derived parts), see .second_order.
    parts: Parts = field(default_factory=dict)
    # Whether every gradient worker of the layer holds valid parts (host state, the same on every rank).
    ready: bool = False
    # Why the layer is not ready after a decomposition step: "did_not_run" or "decomposition_failed".
    not_ready_reason: str | None = None
    handles: list[RemovableHandle | Removable] = field(default_factory=list)
    # Whether an output gradient ever reached the layer's hooks (run-time coverage).
    received: bool = False
    # A run-time reason to leave the layer out for good (a ``Coverage`` key, e.g. "read_outside_call").
    left_out: str | None = None
    # ``id`` of the weight parameter it was registered with (a pruned or replaced weight differs).
    param_id: int = 0
    # The attention module that runs the engine's forward while this layer is registered (its q/k/v
    # projections and out_proj, see :mod:`.layers.attention`); None for other layers.
    attention: nn.Module | None = None
    # In eval() mode while its weight had a gradient at the last step() (kept its plain gradient).
    eval_mode: bool = False

    @property
    def spatial(self) -> bool:
        """Whether the layer's positions are spatial (a convolution), see :class:`LayerHandler`."""
        return self.handler.spatial

    @property
    def device(self) -> torch.device:
        return self.handler.parameters(self.module)[0].device

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def result_bytes(r: Result | None) -> int:
    return 0 if r is None else tensor_bytes(*r.values())


def memory_by_category(
    layers: Iterable[LayerState], handed_bytes: int, comm_bytes: int
) -> dict[str, int]:
    """Bytes held per category (see ``KFACPreconditioner.memory_usage`` for what each counts);
    ``handed_bytes``: batch factors handed to the reduction, not yet packed; ``comm_bytes``: buckets in
    flight."""
    out = dict.fromkeys(("factors", "decompositions", "outer_products", "batch_buffers"), 0)
    for s in layers:
        out["factors"] += tensor_bytes(s.a_factor, s.g_factor)
        out["decompositions"] += sum(result_bytes(r) for r in s.parts.values())
        out["outer_products"] += sum(
            result_bytes(r) for k, r in s.parts.items() if k not in tuple(Factor)
        )
        out["batch_buffers"] += tensor_bytes(
            s.a_batch.total, s.g_batch.total, *(c.a.sum for c in s.calls if c.a is not None)
        )
        out["batch_buffers"] += sum(tensor_bytes(a.sum, g.sum) for a, g in s.group)
    out["batch_buffers"] += handed_bytes
    out["comm_buffers"] = comm_bytes
    out["buffers"] = out["batch_buffers"] + comm_bytes
    out["total"] = out["factors"] + out["decompositions"] + out["buffers"]
    return out
