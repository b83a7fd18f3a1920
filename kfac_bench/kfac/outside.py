"""A registered weight that also receives gradient from outside its module's call.

A tied autoencoder decodes with ``F.linear(h, enc.weight.t())``: ``enc.weight.grad`` then holds the
gradient of the module call *and* of the functional use, but the K-FAC block ``A ⊗ G`` models the module
call only, so preconditioning the sum would be wrong. (Weights held by two *modules* are found by the scan,
:mod:`.registration`.) The check compares, in one backward pass, the gradient the module's own calls
contribute to the weight (read on the autograd node that feeds the weight's accumulator, below the layer's
output) with everything the accumulator receives (a pre-hook on it, before DDP or ``.grad`` see it). A
difference above ``TOLERANCE`` of the total leaves the layer out, with its reason.

It runs in the first factor step after the layers are registered (construction, or registration again):
a functional use present in every step (a tied decoder) is found there; one that starts later is not.
Its cost in that step: a few node lookups per call and one subtraction per weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .state import LayerState

#: Relative difference (Frobenius) between the weight's total gradient and its module calls' share above
#: which the weight counts as also used outside its module (rounding of the two sums stays far below).
TOLERANCE = 1e-3
_DEPTH = 6  # nodes searched below a layer output for the edge into its weight's accumulator


class OutsideGradients:
    """The check of the module docstring; ``active`` while it runs."""

    def __init__(self) -> None:
        self.active = False
        #: Layer name -> share of its weight's gradient that came from outside its calls (flagged only).
        self.flagged: dict[str, float] = {}
        self._own: dict[str, torch.Tensor] = {}
        self._watched: dict[str, tuple[Any, Any]] = {}  # name -> (accumulator node, prehook handle)
        self._nodes: list[tuple[Any, int]] = []  # (node, edge) already hooked in this step

    def start(self) -> None:
        self.active, self.flagged = True, {}

    def stop(self) -> None:
        """End the check: detach its hooks (the flags stay readable in :attr:`flagged`)."""
        self.active = False
        for _, handle in self._watched.values():
            handle.remove()
        self._watched.clear()
        self._own.clear()
        self._nodes.clear()

    def watch(self, layer: LayerState, output: torch.Tensor, x: torch.Tensor) -> None:
        """From the forward hook of a recorded call: hook the node through which this call's gradient
        reaches the weight, and (once) the weight's accumulator."""
        weight, _ = layer.handler.parameters(layer.module)
        if not weight.requires_grad or not weight.is_leaf:
            return
        if getattr(layer.handler, "shares_parameter", False):
            return  # its parameter also feeds sibling layers by design (attention's packed projections)
        acc = torch.autograd.graph.get_gradient_edge(weight).node
        if layer.name not in self._watched:
            self._watched[layer.name] = (acc, acc.register_prehook(self._total(layer.name)))
        found = _edge_into(output.grad_fn, acc, x.grad_fn)
        if found is None:
            return
        node, edge = found
        if any(n is node and e == edge for n, e in self._nodes):
            return  # one node may carry several calls' gradient at once (a compiled region)
        self._nodes.append((node, edge))
        node.register_hook(self._own_part(layer.name, edge))

    def _own_part(self, name: str, edge: int) -> Callable[..., None]:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> None:
            g = grad_inputs[edge]
            if g is not None:
                prev = self._own.get(name)
                self._own[name] = g.detach().clone() if prev is None else prev + g.detach()

        return hook

    def _total(self, name: str) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            total, own = grad_outputs[0], self._own.pop(name, None)
            if total is None or own is None:
                return  # no call of the module reached this backward: the run-time coverage check's case
            norm = float(total.detach().norm())
            share = float((total.detach() - own.to(total.dtype)).norm()) / norm if norm > 0 else 0.0
            if share > TOLERANCE:
                self.flagged[name] = max(share, self.flagged.get(name, 0.0))

        return hook


def _edge_into(root: Any, acc: Any, stop: Any) -> tuple[Any, int] | None:
    """The node below ``root`` (not below ``stop``, the layer input's node) with an edge into ``acc``, and
    that edge's index: breadth first, at most ``_DEPTH`` levels."""
    frontier: list[Any] = [root]
    seen: list[Any] = []
    for _ in range(_DEPTH):
        nxt = []
        for node in frontier:
            if node is None or node is stop or any(node is s for s in seen):
                continue
            seen.append(node)
            for i, (child, _) in enumerate(node.next_functions):
                if child is acc:
                    return node, i
                nxt.append(child)
        frontier = nxt
    return None
