"""The contract of a layer handler: what one layer type contributes to K-FAC.

A handler knows the shapes of a layer's Kronecker factors and how to compute their *unnormalised* sums from
the layer's input and output gradient. Normalisation (which depends on the factor-scaling convention, the
number of examples and output positions) is applied by :mod:`kfac_bench.kfac.factors`, once, for every layer
type alike.

Conventions shared by every handler:
    * The gradient of a layer is one matrix ``[W b]`` of shape ``(g_dim, a_dim)``: the weight as an
      ``(out_features, -1)`` matrix with the bias (if any) as the last column. Correspondingly the layer's
      input rows get a constant 1 appended, so ``a_dim = in_features (+1)``.
    * ``bias`` is decided once per layer at registration: the layer has a bias *and* it is trainable. A frozen
      bias is left out of the block altogether (no column of ones in A, no ``.grad`` written into it).
    * ``N`` is the number of examples (the leading dimension of the input) and ``T`` the number of positions
      that share the weight within one example (output pixels of a convolution, tokens of a sequence).
    * Handlers are stateless: one instance serves every layer of its type. They are called outside autocast,
      with ``dtype`` the factor dtype; they upcast inputs themselves (``x.to(dtype)``) before any product.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn


class Gram(NamedTuple):
    """An unnormalised factor contribution: ``sum`` = Σ over all ``N·T`` rows of ``r rᵀ``."""

    sum: torch.Tensor
    examples: int
    positions: int


class LayerHandler(Protocol):
    """What one module type contributes (register one with :func:`kfac_bench.kfac.register_layer_type`).

    Attributes:
        spatial: whether positions are spatial (the KAISA-era code divides such rows by the spatial size).
    """

    spatial: bool

    def parameters(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and the bias (None without one) that the layer's K-FAC block covers."""
        ...

    def unsupported_reason(self, module: nn.Module) -> str | None:
        """Why ``module`` cannot be preconditioned correctly, as a short phrase with optional detail in
        parentheses (e.g. ``"grouped conv (groups=8)"``); it is then left out and reported. None if it can."""
        ...

    def dims(self, module: nn.Module, bias: bool) -> tuple[int, int]:
        """``(a_dim, g_dim)`` from the parameter shapes alone (works on the meta device)."""
        ...

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype, bias: bool) -> Gram:
        """Σ over rows of ``a aᵀ`` (a 1 appended when ``bias``) from the layer input ``x``, in ``dtype``."""
        ...

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Σ over rows of ``g gᵀ`` from ``g``, the gradient w.r.t. the layer output, computed in ``dtype``."""
        ...

    def grad(self, module: nn.Module, bias: bool) -> torch.Tensor | None:
        """The current gradient as one ``(g_dim, a_dim)`` matrix, or None if the weight has no gradient."""
        ...

    def set_grad(self, module: nn.Module, grad: torch.Tensor, bias: bool) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the weight (and bias) ``.grad``."""
        ...


@runtime_checkable
class BatchedGrams(Protocol):
    """Optional part of a handler: the grams of several calls of its layers computed together.

    Calls (of any layers of the handler's type) whose :meth:`batch_key` is equal and not None have inputs
    (and output gradients) of one shape and one geometry; the capture keeps them until every call of the
    key in the running backward pass has its gradient, then computes all their grams in a few batched ops
    (:mod:`kfac_bench.kfac.batching`) instead of a few ops per call. Handlers without these methods are
    computed call by call, as they arrive.
    """

    def batch_key(self, module: nn.Module, x: torch.Tensor, bias: bool) -> Hashable | None:
        """Which calls' grams can be computed together with this one's (None: not batched)."""
        ...

    def a_grams(
        self,
        modules: Sequence[nn.Module],
        xs: Sequence[torch.Tensor],
        dtype: torch.dtype,
        bias: bool,
    ) -> list[Gram]:
        """:meth:`LayerHandler.a_gram` of each call, computed together (views of one stacked tensor)."""
        ...

    def g_grams(
        self, modules: Sequence[nn.Module], gs: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> list[Gram]:
        """:meth:`LayerHandler.g_gram` of each call, computed together (views of one stacked tensor)."""
        ...


def stacked(rows: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``torch.stack(rows)`` in ``dtype`` in one multi-tensor copy (the cast included)."""
    out = torch.empty((len(rows), *rows[0].shape), dtype=dtype, device=rows[0].device)
    try:
        torch._foreach_copy_(list(out.unbind(0)), list(rows))
    except RuntimeError:  # tensors without a multi-tensor kernel (e.g. functorch's under vmap)
        return torch.stack([r.to(dtype) for r in rows])
    return out


def grams_with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    """:func:`gram_with_ones` of each of the ``B`` row matrices of ``rows`` ``(B, R, D)``: ``(B, D', D')``."""
    gram = torch.bmm(rows.transpose(1, 2), rows)
    if not bias:
        return gram
    b, r, d = rows.shape
    out = gram.new_empty(b, d + 1, d + 1)
    out[:, :d, :d] = gram
    s = rows.sum(dim=1)
    out[:, :d, d] = s
    out[:, d, :d] = s
    out[:, d, d] = r
    return out


class WeightBiasHandler:
    """Shared parts of handlers whose module holds ``weight`` (output dimension first) and ``bias``."""

    spatial = False

    def parameters(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = module.weight
        assert isinstance(w, torch.Tensor)
        b = getattr(module, "bias", None)
        return w, b if isinstance(b, torch.Tensor) else None

    def unsupported_reason(self, module: nn.Module) -> str | None:
        return None

    def dims(self, module: nn.Module, bias: bool) -> tuple[int, int]:
        w, _ = self.parameters(module)
        return math.prod(w.shape[1:]) + int(bias), w.shape[0]

    def weight_matrix(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` (the weight or its gradient) as the ``(g_dim, a_dim - bias)`` matrix of the layer's block."""
        return w.reshape(w.shape[0], -1)

    def weight_from_matrix(self, m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`weight_matrix`: ``m`` in the shape of ``w``."""
        return m.reshape(w.shape)

    def grad_blocks(
        self, module: nn.Module, bias: bool, create: bool = False
    ) -> list[tuple[torch.Tensor | None, int, int]] | None:
        """The column blocks of the ``[W b]`` gradient matrix as tensors of the parameters' ``.grad`` (no
        copy): ``(matrix, first column, end column)``, the matrix None for a bias without a gradient.
        None when the weight has no gradient, or (``create``: for writing, a missing bias gradient is
        made) when its matrix form is not a view of it (e.g. a channels_last kernel). Gathering and writing
        many layers' gradients then takes one multi-tensor copy (:mod:`kfac_bench.kfac.gradients`)."""
        w, b = self.parameters(module)
        if w.grad is None:
            return None
        m = self.weight_matrix(w.grad)
        if m.untyped_storage().data_ptr() != w.grad.untyped_storage().data_ptr():
            return None
        n_w = m.shape[1]
        blocks: list[tuple[torch.Tensor | None, int, int]] = [(m, 0, n_w)]
        if bias:
            assert b is not None
            if b.grad is None and create:
                b.grad = torch.empty_like(b)
            blocks.append((None if b.grad is None else b.grad.view(-1, 1), n_w, n_w + 1))
        return blocks

    def grad(self, module: nn.Module, bias: bool) -> torch.Tensor | None:
        w, b = self.parameters(module)
        if w.grad is None:
            return None
        g = self.weight_matrix(w.grad)
        if bias:
            assert b is not None
            bg = b.grad if b.grad is not None else torch.zeros_like(b)
            g = torch.cat([g, bg.reshape(-1, 1).to(g.dtype)], dim=1)
        return g

    def set_grad(
        self, module: nn.Module, grad: torch.Tensor, bias: bool, scale: torch.Tensor | None = None
    ) -> None:
        """Write ``grad`` (times the device scalar ``scale``, in the same pass, when given) into the
        weight and bias ``.grad``: straight into the matrix view of the weight gradient when it has one,
        so a block with a bias column costs one strided pass, not a reshape copy and a copy."""
        w, b = self.parameters(module)
        n_w = grad.shape[1] - int(bias)
        assert w.grad is not None
        src, dst = grad[:, :n_w], self.weight_matrix(w.grad)
        if dst.untyped_storage().data_ptr() != w.grad.untyped_storage().data_ptr():
            # The matrix view had to copy (e.g. a channels_last weight): write in the weight's shape.
            src, dst = self.weight_from_matrix(src, w), w.grad
        _write(dst, src, scale)
        if bias:
            assert b is not None
            if b.grad is None:
                b.grad = torch.empty_like(b)
            _write(b.grad, grad[:, n_w], scale)


def _write(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is None:
        dst.copy_(src)
    else:
        torch.mul(src, scale.to(src.dtype), out=dst)


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
