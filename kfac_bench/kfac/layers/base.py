"""The contract of a layer handler: what one layer type contributes to K-FAC.

A handler knows the shapes of a layer's Kronecker factors and how to compute their *unnormalised* sums from
the layer's input and output gradient. Normalisation (which depends on the factor-scaling convention, the
number of examples and output positions) is applied by :mod:`kfac_bench.kfac.factors`, once, for every layer
type alike.

Conventions shared by every handler:
    * The gradient of a layer is one matrix ``[W b]`` of shape ``(g_dim, a_dim)``: the weight reshaped to
      ``(out_features, -1)`` with the bias (if any) as the last column. Correspondingly the layer's input rows
      get a constant 1 appended, so ``a_dim = in_features (+1)``.
    * ``N`` is the number of examples (the leading dimension of the input) and ``T`` the number of positions
      that share the weight within one example (output pixels of a convolution, tokens of a sequence).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import nn


class Gram(NamedTuple):
    """An unnormalised factor contribution: ``sum`` = Σ over all ``N·T`` rows of ``r rᵀ``."""

    sum: torch.Tensor
    examples: int
    positions: int


class LayerHandler(Protocol):
    """What one module type contributes. Handlers are stateless; one instance serves every layer of its type.

    Attributes:
        spatial: whether positions are spatial (the KAISA-era code divides such rows by the spatial size).
    """

    spatial: bool

    def unsupported_reason(self, module: nn.Module) -> str | None:
        """Why ``module`` cannot be preconditioned correctly (it is then skipped and logged), else None."""
        ...

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Σ over rows of ``a aᵀ`` (bias 1 appended) from the layer input ``x``, computed in ``dtype``."""
        ...

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Σ over rows of ``g gᵀ`` from ``g``, the gradient w.r.t. the layer output, computed in ``dtype``."""
        ...

    def grad(self, module: nn.Module) -> torch.Tensor | None:
        """The current gradient as one ``(g_dim, a_dim)`` matrix, or None if the weight has no gradient."""
        ...

    def set_grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the weight and bias ``.grad``."""
        ...


def gram_with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    """``rowsᵀ rows`` for ``rows`` of shape (R, D), as if a column of ones were appended when ``bias``.

    The bias blocks are column sums and the row count, so the (R, D+1) matrix is never built.
    """
    gram = rows.t() @ rows
    if not bias:
        return gram
    d = rows.shape[1]
    out = gram.new_empty(d + 1, d + 1)
    out[:d, :d] = gram
    s = rows.sum(dim=0)
    out[:d, d] = s
    out[d, :d] = s
    out[d, d] = rows.shape[0]
    return out


def weight_bias_grad(module: nn.Module) -> torch.Tensor | None:
    """``[W.grad.reshape(out, -1), b.grad]`` for a module with ``weight`` and optional ``bias``."""
    w = module.weight
    assert isinstance(w, torch.Tensor)
    if w.grad is None:
        return None
    g = w.grad.reshape(w.shape[0], -1)
    b = getattr(module, "bias", None)
    if b is not None:
        bg: torch.Tensor = b.grad if b.grad is not None else torch.zeros_like(b)
        g = torch.cat([g, bg.reshape(-1, 1)], dim=1)
    return g


def set_weight_bias_grad(module: nn.Module, grad: torch.Tensor) -> None:
    """Inverse of :func:`weight_bias_grad`: copy the matrix back into the parameters' ``.grad``."""
    w = module.weight
    assert isinstance(w, torch.Tensor)
    b = getattr(module, "bias", None)
    n_w = grad.shape[1] - (1 if b is not None else 0)
    assert w.grad is not None
    w.grad.copy_(grad[:, :n_w].reshape(w.shape))
    if b is not None:
        if b.grad is None:
            b.grad = torch.empty_like(b)
        b.grad.copy_(grad[:, n_w])
