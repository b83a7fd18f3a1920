"""nn.Linear: factors over every row of the input, any number of leading dimensions."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Gram, gram_with_ones, set_weight_bias_grad, weight_bias_grad


class LinearHandler:
    """K-FAC contribution of ``nn.Linear``.

    An input of shape ``(N, *S, in_features)`` gives ``N·prod(S)`` rows: every token of a sequence is a row
    sharing the weight (the reference's "expand" treatment): ``N`` examples, ``T = prod(S)`` positions.
    A 1-D input is one example.
    """

    spatial = False

    def unsupported_reason(self, module: nn.Module) -> str | None:
        return None

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        n, t = _examples_positions(x)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        return Gram(gram_with_ones(rows, module.bias is not None), n, t)

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        n, t = _examples_positions(g)
        rows = g.reshape(-1, g.shape[-1]).to(dtype)
        return Gram(rows.t() @ rows, n, t)

    def grad(self, module: nn.Module) -> torch.Tensor | None:
        return weight_bias_grad(module)

    def set_grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        set_weight_bias_grad(module, grad)


def _examples_positions(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() <= 1:
        return 1, 1
    return x.shape[0], math.prod(x.shape[1:-1])
