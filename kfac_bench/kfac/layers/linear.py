"""nn.Linear and Linear-equivalent layers: factors over every row of the input, any leading dimensions."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Gram, WeightBiasHandler, gram_with_ones


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

    def weight_matrix(self, w: torch.Tensor) -> torch.Tensor:
        return w.t() if self.transposed else w

    def weight_from_matrix(self, m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return m.t() if self.transposed else m


def _examples_positions(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() <= 1:
        return 1, 1
    return x.shape[0], math.prod(x.shape[1:-1])
