"""Conv2d input factor by unfold + GEMM (im2col): the reference kernel, and a batch-chunked form.

Contract shared with :mod:`.conv_shift` (see :mod:`.conv_factor` for the notation): ``S = Σ_n Σ_t p pᵀ`` of
shape ``(D, D)``, ``D = C·kh·kw (+1 if bias)``, not normalised, in ``x``'s dtype.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .conv_shift import Padding, Pair, conv_plan

__all__ = ["conv2d_a_factor_unfold", "unfold_chunked"]


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
    plan = conv_plan(h, w, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
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
