"""Exact Conv2d input factor ``A = Σ_n Σ_t p pᵀ``: the entry point that picks one of two exact kernels.

Notation: the input ``x`` has shape ``(N, C, H, W)``; a kernel position ``k = i·kw + j`` reads input pixel
``(oy·sh − top + i·dh, ox·sw − left + j·dw)`` for output position ``(oy, ox)``. The patch vector ``p`` of one
output position has length ``D = C·kh·kw`` in the order of ``weight.reshape(out_channels, -1)`` (channel,
then kernel row, then kernel column), with a constant 1 appended last when the layer has a bias.

``conv2d_a_factor`` picks, per shape and device type, the shift-correlation method (:mod:`.conv_shift`, no
patch tensor) or unfold + GEMM (:mod:`.conv_unfold`, in batch chunks that bound the patch tensor) with the
cost model of :mod:`.conv_cost`; both are exact. On CPU: 1×1 kernels always take the shift path (subsample,
one GEMM); k×k kernels take it while the bands stay thin and the ``kh·kw·(kh·kw+1)/2`` blocks stay cheap to
assemble (ResNet-32's CIFAR layers: about 4-5.5× faster than unfold + GEMM in total, 2 cores); many channels
on small maps (ResNet-50 at 64×64 from 8×8 down) and 3-channel 7×7 stems take unfold. Other device types
follow the rule documented in :mod:`.conv_cost` until they are measured.
"""

from __future__ import annotations

from torch import Tensor

from .conv_cost import choose_method
from .conv_shift import Padding, Pair, conv2d_a_factor_shift
from .conv_unfold import conv2d_a_factor_unfold, unfold_chunked

__all__ = ["conv2d_a_factor", "conv2d_a_factor_shift", "conv2d_a_factor_unfold", "fast_method"]


def fast_method(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
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
    if fast_method(x, kernel_size, stride, padding, dilation, bias) == "shift":
        return conv2d_a_factor_shift(x, kernel_size, stride, padding, dilation, bias)
    return unfold_chunked(x, kernel_size, stride, padding, dilation, bias)
