"""Per-layer state of the preconditioner: accumulators, running factors, second-order parts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .assignment import LayerWork
from .factors import contribution_count, contribution_weight, normalise
from .layers import Gram, LayerHandler
from .options import FactorScaling
from .second_order import Parts, Result


@dataclass
class Accumulator:
    """The weighted sum of a factor's micro-batch contributions since the last factor update."""

    total: torch.Tensor | None = None
    count: int = 0

    def add(self, gram: Gram, scaling: FactorScaling, is_g: bool, spatial: bool) -> None:
        w = contribution_weight(scaling, is_g, spatial, gram.positions)
        contrib = gram.sum if w == 1.0 else gram.sum * w
        self.total = contrib if self.total is None else self.total.add_(contrib)
        self.count += contribution_count(scaling, gram.examples, gram.positions)

    def pop(self, scaling: FactorScaling, is_g: bool) -> torch.Tensor | None:
        """The normalised batch factor (None if nothing was accumulated); resets the accumulator."""
        if self.total is None:
            return None
        out = normalise(self.total, self.count, scaling, is_g)
        self.total, self.count = None, 0
        return out


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer."""

    name: str
    module: nn.Module
    handler: LayerHandler
    a_dim: int
    g_dim: int
    work: LayerWork | None = None
    a_batch: Accumulator = field(default_factory=Accumulator)
    g_batch: Accumulator = field(default_factory=Accumulator)
    a_factor: torch.Tensor | None = None
    g_factor: torch.Tensor | None = None
    # Second-order parts held on this rank ("a", "g" and the method's derived parts), see second_order.method.
    parts: Parts = field(default_factory=dict)
    # Device-side flag: a non-finite batch factor was skipped since the last check (no host sync to set).
    nonfinite: torch.Tensor | None = None
    # Gradient hooks registered in this micro-batch's forward that have not fired yet.
    pending_g: int = 0
    seen_a: bool = False
    seen_g: bool = False
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def a_decomp(self) -> Result | None:
        return self.parts.get("a")

    @property
    def g_decomp(self) -> Result | None:
        return self.parts.get("g")

    @property
    def outer(self) -> torch.Tensor | None:
        part = self.parts.get("outer")
        return None if part is None else part["outer"]

    @property
    def device(self) -> torch.device:
        w = self.module.weight
        assert isinstance(w, torch.Tensor)
        return w.device

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def result_bytes(r: Result | None) -> int:
    return 0 if r is None else tensor_bytes(*r.values())
