"""nn.Linear and Linear-equivalent layers: factors over every row of the input, any leading dimensions."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from .base import Gram, WeightBiasHandler, gram_with_ones, grams_with_ones, stacked


class LinearHandler(WeightBiasHandler):
    """K-FAC contribution of ``nn.Linear``, or of any module computing ``y = x Wᵀ + b`` over the last dim.

    An input of shape ``(N, *S, in_features)`` gives ``N·prod(S)`` rows: every token of a sequence is a row
    sharing the weight (the reference's "expand" treatment): ``N`` examples, ``T = prod(S)`` positions.
    A 1-D input is one example.

    Args:
        transposed: the module stores its weight as ``(in_features, out_features)`` (``y = x W + b``), like
            ``transformers.pytorch_utils.Conv1D``; gradients are transposed on the way in and out.
    """

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed

    def __repr__(self) -> str:
        return f"LinearHandler(transposed={self.transposed})"

    def dims(self, module: nn.Module, bias: bool) -> tuple[int, int]:
        w, _ = self.parameters(module)
        d_in, d_out = (w.shape[0], w.shape[1]) if self.transposed else (w.shape[1], w.shape[0])
        return d_in + int(bias), d_out

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype, bias: bool) -> Gram:
        n, t = _examples_positions(x)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        return Gram(gram_with_ones(rows, bias), n, t)

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        n, t = _examples_positions(g)
        rows = g.reshape(-1, g.shape[-1]).to(dtype)
        return Gram(rows.t() @ rows, n, t)

    def batch_key(self, module: nn.Module, x: torch.Tensor, bias: bool) -> Hashable | None:
        """Calls with the same number of rows of the same width, on one device, go together."""
        if x.dim() == 0:
            return None
        return ("linear", x.numel() // max(1, x.shape[-1]), x.shape[-1], bias, x.device)

    def a_grams(
        self,
        modules: Sequence[nn.Module],
        xs: Sequence[torch.Tensor],
        dtype: torch.dtype,
        bias: bool,
    ) -> list[Gram]:
        rows = stacked([x.reshape(-1, x.shape[-1]) for x in xs], dtype)
        grams = grams_with_ones(rows, bias)
        return [Gram(grams[i], *_examples_positions(x)) for i, x in enumerate(xs)]

    def g_grams(
        self, modules: Sequence[nn.Module], gs: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> list[Gram]:
        rows = stacked([g.reshape(-1, g.shape[-1]) for g in gs], dtype)
        grams = torch.bmm(rows.transpose(1, 2), rows)
        return [Gram(grams[i], *_examples_positions(g)) for i, g in enumerate(gs)]

    def weight_matrix(self, w: torch.Tensor) -> torch.Tensor:
        return w.t() if self.transposed else w

    def weight_from_matrix(self, m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return m.t() if self.transposed else m


def _examples_positions(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() <= 1:
        return 1, 1
    return x.shape[0], math.prod(x.shape[1:-1])
