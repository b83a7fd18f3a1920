"""Exact Conv2d input factor ``A = Σ_n Σ_t p pᵀ``: unfold + GEMM (im2col), and the entry point
:func:`conv2d_a_factor` that picks it or the shift-correlation method of :mod:`.conv_shift` (whose docstring
has the notation).

Both kernels share one contract: ``S`` of shape ``(D, D)``, ``D = C·kh·kw (+1 if bias)``, not normalised, in
``x``'s dtype. ``conv2d_a_factor`` picks, per shape and device type, the shift method (no patch tensor) or
unfold + GEMM (in batch chunks that bound the patch tensor) with the cost model of :mod:`.conv_cost`. On CPU:
1×1 kernels always take the shift path (subsample, one GEMM); k×k kernels take it while the bands stay thin
and the ``kh·kw·(kh·kw+1)/2`` blocks stay cheap to assemble (ResNet-32's CIFAR layers); many channels on
small maps (ResNet-50 at 64×64 from 8×8 down) and 3-channel 7×7 stems take unfold. Other device types follow
the rule documented in :mod:`.conv_cost` until they are measured.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .conv_cost import choose_method
from .conv_shift import Padding, Pair, conv2d_a_factor_shift, shift_geometry

__all__ = ["conv2d_a_factor", "conv2d_a_factor_unfold", "fast_method", "unfold_chunked"]


def fast_method(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair
) -> str:
    """The method :func:`conv2d_a_factor` uses for these arguments: ``'shift'`` or ``'unfold'``."""
    n, c, h, w = x.shape
    return choose_method(x.device.type, (n, c, h, w), kernel_size, stride, padding, dilation)


def conv2d_a_factor(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
) -> Tensor:
    """Input factor ``S = Σ_n Σ_t p pᵀ`` by the faster exact method for the shape (:func:`fast_method`).

    Same contract as :func:`conv2d_a_factor_unfold`: shape ``(D, D)`` with ``D = C·kh·kw (+1 if bias)``,
    rows/columns in the order of ``weight.reshape(out_channels, -1)`` with the bias entry last, symmetric,
    not normalised, computed in ``x``'s dtype (read detached). Which method runs is in the module docstring;
    unfold runs in batch chunks whose patches hold at most ``max(4·x.numel(), D², 2²²)`` elements.

    Args:
        x: Conv input, shape ``(N, C, H, W)``, any float dtype (cast to the factor dtype beforehand).
        kernel_size: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        padding: Zero padding ``(top, bottom, left, right)``; may be asymmetric (``padding='same'``).
        dilation: ``(dh, dw)``.
        bias: Append the constant 1 to each patch: ``S[-1, -1] = N·T``, ``S[:-1, -1]`` = sum of patches.

    Raises:
        ValueError: The settings leave no output position (the convolution itself would fail).
    """
    x = x.detach()  # a curvature statistic: never part of the autograd graph
    if fast_method(x, kernel_size, stride, padding, dilation) == "shift":
        return conv2d_a_factor_shift(x, kernel_size, stride, padding, dilation, bias)
    return unfold_chunked(x, kernel_size, stride, padding, dilation, bias)


def conv2d_a_factor_unfold(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
) -> Tensor:
    """Reference input factor: materialise the patches with ``F.unfold`` and multiply them (im2col + GEMM).

    Args:
        x: Conv input, shape ``(N, C, H, W)``; the result has ``x``'s dtype.
        kernel_size: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        padding: Zero padding ``(top, bottom, left, right)``; may be asymmetric.
        dilation: ``(dh, dw)``.
        bias: Append the constant 1 to each patch (last row/column of the result).

    Returns:
        ``S = Σ_n Σ_t p pᵀ``, shape ``(D, D)`` with ``D = C·kh·kw (+1 if bias)``; not normalised.
    """
    top, bottom, left, right = padding
    n, c = x.shape[:2]
    d = c * kernel_size[0] * kernel_size[1]
    xp = F.pad(x, (left, right, top, bottom))
    cols = F.unfold(xp, kernel_size, dilation=dilation, padding=0, stride=stride)  # (N, D, T)
    positions = cols.shape[2]
    patches = cols.transpose(1, 2).reshape(n * positions, d)  # one row per (example, position)
    gram = patches.t() @ patches
    if not bias:
        return gram
    out = x.new_empty(d + 1, d + 1)
    out[:d, :d] = gram
    total = patches.sum(dim=0)
    out[:d, d] = total
    out[d, :d] = total
    out[d, d] = n * positions
    return out


def unfold_chunked(
    x: Tensor,
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    bias: bool,
    floor: int = 1 << 22,
) -> Tensor:
    """Unfold + GEMM over batch chunks, so the patch tensor stays within a few times the input's size.

    A chunk's patches may hold ``max(4·x.numel(), D², floor)`` elements: the result itself has ``D²``,
    and below ``floor`` (16 MiB of float32) the memory does not matter but fewer chunks are faster.
    """
    n, c, h, w = x.shape
    plan = shift_geometry(h, w, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
    d = c * kernel_size[0] * kernel_size[1]
    per_example = d * plan.ax_r.out * plan.ax_c.out
    chunk = max(1, min(n, max(4 * c * h * w * n, d * d, floor) // per_example))
    total = None
    for start in range(0, n, chunk):
        part = conv2d_a_factor_unfold(
            x[start : start + chunk], kernel_size, stride, padding, dilation, bias
        )
        total = part if total is None else total.add_(part)
    assert total is not None
    return total
