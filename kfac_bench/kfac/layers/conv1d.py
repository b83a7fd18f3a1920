"""nn.Conv1d: the Conv2d factors of the same layer seen as a ``(1, k)`` kernel on a ``(1, L)`` map.

A Conv1d of kernel ``k``, stride ``s``, dilation ``d`` and padding ``(left, right)`` computes, on an input
``(N, C, L)``, exactly what a Conv2d of kernel ``(1, k)``, stride ``(1, s)``, dilation ``(1, d)`` and padding
``(0, 0, left, right)`` computes on ``(N, C, 1, L)``; its weight ``(out, C, k)`` flattens in the same order
as ``(out, C, 1, k)``. So its factors are that Conv2d's, computed by the same exact kernels
(:func:`~.conv_unfold.conv2d_a_factor`), with ``T = L_out`` positions (KFC, as for Conv2d); same-shaped
calls are batched as Conv2d's are (:func:`~.conv_batched.conv2d_a_factors`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Gram, WeightBiasHandler
from .conv2d import Conv2dHandler, conv_batch_key
from .conv_batched import conv2d_a_factors
from .conv_unfold import conv2d_a_factor


class Conv1dHandler(WeightBiasHandler):
    """K-FAC contribution of ``nn.Conv1d``: ``N`` examples, ``T = L_out`` positions; grouped convolutions are
    left out (block-diagonal per group, not modelled), as for Conv2d."""

    spatial = True

    def __repr__(self) -> str:
        return "Conv1dHandler()"

    def unsupported_reason(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.Conv1d)
        if module.groups != 1:
            return f"grouped conv (groups={module.groups})"
        return None

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype, bias: bool) -> Gram:
        assert isinstance(module, nn.Conv1d)
        if x.dim() == 2:
            x = x.unsqueeze(0)
        x = x.to(dtype)
        left, right = module._reversed_padding_repeated_twice
        if module.padding_mode != "zeros":
            x = F.pad(x, (left, right), mode=module.padding_mode)
            left = right = 0
        (k,), (s,), (d,) = module.kernel_size, module.stride, module.dilation
        out_len = (x.shape[2] + left + right - d * (k - 1) - 1) // s + 1
        a = conv2d_a_factor(
            x.unsqueeze(2),
            kernel_size=(1, k),
            stride=(1, s),
            padding=(0, 0, left, right),
            dilation=(1, d),
            bias=bias,
        )
        return Gram(a, x.shape[0], out_len)

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        if g.dim() == 2:
            g = g.unsqueeze(0)
        return _CONV2D.g_gram(module, g.unsqueeze(2), dtype)

    def batch_key(self, module: nn.Module, x: torch.Tensor, bias: bool) -> Hashable | None:
        assert isinstance(module, nn.Conv1d)
        return conv_batch_key(module, x, bias)

    def a_grams(
        self,
        modules: Sequence[nn.Module],
        xs: Sequence[torch.Tensor],
        dtype: torch.dtype,
        bias: bool,
    ) -> list[Gram]:
        m = modules[0]
        assert isinstance(m, nn.Conv1d)
        left, right = m._reversed_padding_repeated_twice
        (k,), (s,), (d,) = m.kernel_size, m.stride, m.dilation
        n, _, length = xs[0].shape
        out_len = (length + left + right - d * (k - 1) - 1) // s + 1
        maps = [x.unsqueeze(2) for x in xs]
        a = conv2d_a_factors(maps, (1, k), (1, s), (0, 0, left, right), (1, d), bias, dtype)
        return [Gram(a[i], n, out_len) for i in range(len(xs))]

    def g_grams(
        self, modules: Sequence[nn.Module], gs: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> list[Gram]:
        return _CONV2D.g_grams(modules, [g.unsqueeze(2) for g in gs], dtype)


_CONV2D = Conv2dHandler()
