"""nn.Conv2d: the input factor from patches (KFC, Grosse & Martens 2016), without materialising them.

Stride, dilation, zero padding (including ``padding='same'`` with its asymmetric split for even kernels) and
the non-zero padding modes are handled exactly. Grouped and depthwise convolutions are skipped (their Fisher
block is block-diagonal per group, which this handler does not model) rather than preconditioned wrongly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Gram, WeightBiasHandler, stacked
from .conv_batched import conv2d_a_factors
from .conv_unfold import conv2d_a_factor


class Conv2dHandler(WeightBiasHandler):
    """K-FAC contribution of ``nn.Conv2d``: ``N`` examples, ``T = out_h·out_w`` positions.

    The input rows are the patches ``p`` (length ``C·kh·kw``, ordered like ``weight.reshape(out, -1)``),
    the output rows are the per-position output gradients (length ``out_channels``).
    """

    spatial = True

    def unsupported_reason(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.Conv2d)
        if module.groups != 1:
            return f"grouped conv (groups={module.groups})"
        return None

    def a_gram(self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype, bias: bool) -> Gram:
        assert isinstance(module, nn.Conv2d)
        x, (top, bottom, left, right) = self._padded(module, x, dtype)
        kh, kw = module.kernel_size
        sh, sw = module.stride
        dh, dw = module.dilation
        out_h = (x.shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
        out_w = (x.shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
        a = conv2d_a_factor(
            x,
            kernel_size=(kh, kw),
            stride=(sh, sw),
            padding=(top, bottom, left, right),
            dilation=(dh, dw),
            bias=bias,
        )
        return Gram(a, x.shape[0], out_h * out_w)

    def batch_key(self, module: nn.Module, x: torch.Tensor, bias: bool) -> Hashable | None:
        assert isinstance(module, nn.Conv2d)
        return conv_batch_key(module, x, bias)

    def a_grams(
        self,
        modules: Sequence[nn.Module],
        xs: Sequence[torch.Tensor],
        dtype: torch.dtype,
        bias: bool,
    ) -> list[Gram]:
        m = modules[0]
        assert isinstance(m, nn.Conv2d)
        left, right, top, bottom = m._reversed_padding_repeated_twice
        kh, kw = m.kernel_size
        (sh, sw), (dh, dw) = m.stride, m.dilation
        n, _, h, w = xs[0].shape
        out_h = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        out_w = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        a = conv2d_a_factors(
            xs, (kh, kw), (sh, sw), (top, bottom, left, right), (dh, dw), bias, dtype
        )
        return [Gram(a[i], n, out_h * out_w) for i in range(len(xs))]

    def g_grams(
        self, modules: Sequence[nn.Module], gs: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> list[Gram]:
        n, c, h, w = gs[0].shape
        b = len(gs)
        if h * w >= _BMM_POSITIONS_PER_CHANNEL * c:
            # As g_gram: per-example (C, T) products summed, on one stacked copy of the gradients.
            rows = stacked(list(gs), dtype).view(b * n, c, h * w)
            grams = torch.bmm(rows, rows.transpose(1, 2)).view(b, n, c, c).sum(dim=1)
        else:
            # One multi-tensor copy into (B, C, N, H, W): each call's rows as one (C, N·T) matrix.
            rows = stacked([g.transpose(0, 1) for g in gs], dtype).view(b, c, n * h * w)
            grams = torch.bmm(rows, rows.transpose(1, 2))
        return [Gram(grams[i], n, h * w) for i in range(b)]

    def a_gram_rows(
        self, module: nn.Module, x: torch.Tensor, dtype: torch.dtype, bias: bool, rows: torch.Tensor
    ) -> Gram:
        """Like :meth:`a_gram`, over the output positions of the output rows ``rows`` only (sorted
        indices; ``factor_position_fraction``, :mod:`kfac_bench.kfac.subsample`).

        A run of consecutive output rows reads one band of input rows (``dh·(kh-1)+1`` more than the
        run's stride-spaced rows): its factor is the same exact kernel's on that slice of the input, with
        the top/bottom zero padding the band actually touches. No copy of the input is made for a slice.
        """
        assert isinstance(module, nn.Conv2d)
        x, (top, _, left, right) = self._padded(module, x, dtype)
        kh, kw = module.kernel_size
        sh, sw = module.stride
        dh, dw = module.dilation
        span = dh * (kh - 1) + 1
        height = x.shape[2]
        total: torch.Tensor | None = None
        for first, last in _runs(rows.tolist()):
            lo = (
                first * sh - top
            )  # input rows [lo, hi) of the padded-coordinates band, unpadded here
            hi = last * sh - top + span
            part = conv2d_a_factor(
                x[:, :, max(lo, 0) : min(hi, height)],
                kernel_size=(kh, kw),
                stride=(sh, sw),
                padding=(max(-lo, 0), max(hi - height, 0), left, right),
                dilation=(dh, dw),
                bias=bias,
            )
            total = part if total is None else total.add_(part)
        assert total is not None
        out_w = (x.shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
        return Gram(total, x.shape[0], rows.numel() * out_w)

    @staticmethod
    def _padded(
        module: nn.Conv2d, x: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
        """``x`` as a batch in ``dtype``, padded here unless its padding is zeros, and the zero padding
        ``(top, bottom, left, right)`` still to apply."""
        if x.dim() == 3:
            x = x.unsqueeze(0)
        x = x.to(dtype)
        # F.pad order: (left, right, top, bottom); nn.Conv2d stores it for every padding kind.
        left, right, top, bottom = module._reversed_padding_repeated_twice
        if module.padding_mode != "zeros":
            x = F.pad(x, (left, right, top, bottom), mode=module.padding_mode)
            left = right = top = bottom = 0
        return x, (top, bottom, left, right)

    def g_gram(self, module: nn.Module, g: torch.Tensor, dtype: torch.dtype) -> Gram:
        if g.dim() == 3:
            g = g.unsqueeze(0)
        n, c, h, w = g.shape
        g = g.to(dtype)
        if h * w >= _BMM_POSITIONS_PER_CHANNEL * c:
            # Many positions per channel (early layers): per-example (C, T) views of an NCHW gradient, one
            # batched product and a sum of the N small (C, C) results, without the (C, N·T) copy: about
            # half the time of the copy + GEMM at ResNet-32's first stage (C = 16, T = 1024), 1 thread.
            rows = g.reshape(n, c, h * w)
            return Gram(torch.bmm(rows, rows.transpose(1, 2)).sum(0), n, h * w)
        # Few positions per channel: one (C, N·T) copy and one GEMM (a batched product of thin matrices and
        # the N·C² sum would cost more than the copy).
        rows = g.transpose(0, 1).reshape(c, -1)
        return Gram(rows @ rows.t(), n, h * w)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """``(first, last)`` of each run of consecutive values of the sorted ``rows``."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


#: Output positions per channel from which the conv G factor takes the batched product: with few positions
#: per channel the batched product's overhead outweighs what it saves.
_BMM_POSITIONS_PER_CHANNEL = 16


def conv_batch_key(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, bias: bool) -> Hashable | None:
    """Calls with one input shape and one geometry (zero padding) go together: the batch key of a
    convolution's call (Conv1d's and Conv2d's handlers)."""
    if x.dim() != len(module.kernel_size) + 2 or module.padding_mode != "zeros":
        return None
    return (
        f"conv{len(module.kernel_size)}d",
        tuple(x.shape),
        tuple(module.kernel_size),
        tuple(module.stride),
        tuple(module._reversed_padding_repeated_twice),
        tuple(module.dilation),
        bias,
        x.device,
    )
