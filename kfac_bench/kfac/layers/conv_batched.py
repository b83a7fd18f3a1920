"""Exact Conv2d input factors of several same-shaped calls at once: a few batched GEMMs per group.

Same contract as :func:`~.conv_unfold.conv2d_a_factor` (``S = Σ_n Σ_t p pᵀ`` of each call, ``D = C·kh·kw``
(+1 with ``bias``), rows in the order of ``weight.reshape(out, -1)``), for ``B`` inputs of one shape and
one convolution geometry, returned stacked ``(B, D', D')``. Three exact kernels, chosen per device type
(:data:`RULES`, :func:`batched_method`):

* ``'per_call'`` (the CPU's): each call's factor by the per-call kernels of :mod:`.conv_unfold` (the shift
  method or chunked unfold, by the CPU cost model), stacked: the fastest on the CPU, a few dozen ops per
  call.
* ``'pixel'``: the shift method (:mod:`.conv_shift`) reorganised so that every shift of every call is one
  batched GEMM. The inputs are zero-padded into one buffer laid out ``(call, pixel, C, N)``: a pixel's
  ``(C, N)`` slice is a matrix, and block ``(k, k')`` of ``A`` is ``Σ_p X[p] X[p + δ]ᵀ`` over the pixels
  ``p`` that kernel position ``k`` reads (its *window*), ``δ = (i'-i)·Wp + (j'-j)`` the partner's flat
  pixel offset. For one kernel-row offset ``dy``, the partners of all column offsets ``dx`` of a pixel are
  consecutive pixels, so their ``(C, N)`` slices form one ``(n·C, N)`` matrix: one ``bmm`` over all pixels
  of all calls gives every ``(pixel, dx)`` product for that ``dy`` (``kh`` GEMMs in all, reading strided
  views of the buffer, no copy). The windows are then a sum pooling of the window's size per ``dy``
  (exact: no subtraction of boundary bands), and two indexed writes place every block and its mirror
  image: about a dozen ops per group. Stride and dilation 1 (the kernel itself also handles strides, as
  windows with gaps; its tests use them). No device takes it by default yet: it does the shift method's
  FLOPs plus a transposing copy, which made it slower than ``'per_call'`` on the CPU; a GPU, where it
  replaces dozens of launches per layer, is where it should be measured.
* ``'unfold'`` (every other device type, until measured): im2col of all calls' examples at once and one
  batched GEMM (``bmm``) of the patches, ``kh·kw`` times the input in memory: one large GEMM runs near a
  GPU's peak, and each extra launch costs more than the FLOPs it saves.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .conv_shift import Padding, Pair
from .conv_unfold import conv2d_a_factor

__all__ = ["MAX_TRANSIENT_BYTES", "batched_method", "conv2d_a_factors"]

#: Bytes of transient tensors one batch of calls may take (products or patches); see conv2d_a_factors.
MAX_TRANSIENT_BYTES = 1 << 28


#: Device type -> kernel for a group's conv input factors (``'per_call'``, ``'pixel'``, ``'unfold'``);
#: device types not listed take ``'unfold'``. The CPU keeps the per-call kernels: at 2 threads on the
#: development machine (calm) the pixel kernel took 178, 112 and 117 ms for ResNet-32's three stride-1
#: groups (batch 128) against 98, 75 and 71 ms call by call with the shift method: the same FLOPs, plus
#: the transposing copy into its layout.
RULES: dict[str, str] = {"cpu": "per_call"}


def batched_method(device_type: str, stride: Pair, dilation: Pair) -> str:
    """The kernel for a group of calls on ``device_type`` (:data:`RULES`; the pixel kernel needs stride
    and dilation 1, else ``'unfold'``)."""
    method = RULES.get(device_type, "unfold")
    if method == "pixel" and (tuple(stride) != (1, 1) or tuple(dilation) != (1, 1)):
        return "unfold"
    return method


@functools.lru_cache(maxsize=256)
def _pixel_plan(
    h: int, w: int, kernel_size: Pair, stride: Pair, padding: Padding
) -> tuple[int, int, int, int, list[list[int]], list[int], list[int], list[int], list[int]]:
    """Shapes and index lists of the pixel kernel: ``(Hp, Wp, out_h, out_w, windows, first, second,
    shift, shift_starts)``; ``windows[k]`` the flat padded pixels kernel position ``k`` reads."""
    kh, kw = kernel_size
    sh, sw = stride
    top, bottom, left, right = padding
    hp, wp = h + top + bottom, w + left + right
    out_h, out_w = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    windows = [
        [(oy * sh + i) * wp + ox * sw + j for oy in range(out_h) for ox in range(out_w)]
        for i in range(kh)
        for j in range(kw)
    ]
    # Shift index of (dy, dx): dy = 0 holds dx = 0..kw-1, every dy > 0 holds dx = -(kw-1)..kw-1.
    starts = [0] + [kw + (dy - 1) * (2 * kw - 1) for dy in range(1, kh)]
    first, second, shift = [], [], []
    for a in range(kh * kw):
        for b in range(a, kh * kw):
            (ia, ja), (ib, jb) = divmod(a, kw), divmod(b, kw)
            dy, dx = ib - ia, jb - ja
            first.append(a)
            second.append(b)
            shift.append(starts[dy] + (dx if dy == 0 else dx + kw - 1))
    return hp, wp, out_h, out_w, windows, first, second, shift, starts


def conv2d_a_factors(
    xs: Sequence[Tensor],
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    bias: bool,
    dtype: torch.dtype,
) -> Tensor:
    """Input factors of ``xs`` (``B`` inputs ``(N, C, H, W)`` of one shape), stacked ``(B, D', D')`` in
    ``dtype``, by :func:`batched_method` for the inputs' device (contract in the module docstring).

    The calls go in chunks whose transient tensors (the pixel kernel's products, ``C·(2kw-1)·C`` per
    padded pixel; unfold's patches, ``kh·kw`` times the input) stay within :data:`MAX_TRANSIENT_BYTES`; a
    call that alone would exceed it takes the per-call kernel of :func:`~.conv_unfold.conv2d_a_factor`
    (the shift method or chunked unfold, bounded by a few times its input)."""
    n, c, h, w = xs[0].shape
    kh, kw = kernel_size
    top, bottom, left, right = padding
    size = torch.empty((), dtype=dtype).element_size()
    method = batched_method(xs[0].device.type, stride, dilation)
    if method == "pixel":
        per_call = (h + top + bottom) * (w + left + right) * c * (2 * kw - 1) * c * size
    else:
        per_call = kh * kw * n * c * h * w * size
    if method == "per_call" or per_call > MAX_TRANSIENT_BYTES:
        return torch.stack(
            [conv2d_a_factor(x.to(dtype), kernel_size, stride, padding, dilation, bias) for x in xs]
        )
    chunk = max(1, MAX_TRANSIENT_BYTES // per_call)
    parts = []
    for i in range(0, len(xs), chunk):
        part = xs[i : i + chunk]
        if method == "pixel":
            parts.append(_pixel(part, kernel_size, stride, padding, bias, dtype))
        else:
            parts.append(_unfold(part, kernel_size, stride, padding, dilation, bias, dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pixel(
    xs: Sequence[Tensor],
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    bias: bool,
    dtype: torch.dtype,
) -> Tensor:
    n, c, h, w = xs[0].shape
    kh, kw = kernel_size
    kk, d, b = kh * kw, c * kh * kw, len(xs)
    hp, wp, out_h, out_w, *_ = _pixel_plan(h, w, kernel_size, stride, padding)
    device = xs[0].device
    _, _, _, _, _, *pairs, _ = _pixel_plan(h, w, kernel_size, stride, padding)
    # Made per call, not cached: a cache would keep device tensors alive beyond what memory_usage counts.
    first, second, shift = (torch.tensor(v, dtype=torch.long, device=device) for v in pairs)
    top, _, left, _ = padding
    pixels = b * hp * wp
    lo, hi = kw - 1, (kh - 1) * wp + kw - 1  # margins: every shifted view stays inside the buffer
    buf = torch.zeros(lo + pixels + hi, c, n, dtype=dtype, device=device)
    grid = buf[lo : lo + pixels].view(b, hp, wp, c, n)
    dsts = [grid[i, top : top + h, left : left + w] for i in range(b)]
    srcs = [x.detach().permute(2, 3, 1, 0) for x in xs]
    try:
        torch._foreach_copy_(dsts, srcs)
    except RuntimeError:  # tensors without a multi-tensor kernel (e.g. functorch's under vmap)
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
    a = buf[lo : lo + pixels]  # (pixels, C, N)
    per_dy = []
    for dy in range(kh):
        shifts = kw if dy == 0 else 2 * kw - 1
        begin = lo + (0 if dy == 0 else dy * wp - (kw - 1))
        partners = buf.as_strided((pixels, shifts * c, n), (c * n, n, 1), begin * c * n)
        prod = torch.bmm(a, partners.transpose(1, 2))  # (pixels, C, shifts·C)
        win = _window_sums(prod.view(b, hp, wp, -1), (kh, kw), stride, (out_h, out_w))
        per_dy.append(win.view(b, kk, c, shifts, c).transpose(2, 3))
    blocks = torch.cat(per_dy, dim=2)[:, first, shift]  # (B, pairs, C, C)
    out = buf.new_empty(b, d + int(bias), d + int(bias))
    view = out[:, :d, :d].view(b, c, kk, c, kk).permute(0, 2, 4, 1, 3)  # [b, k, k', c, c']
    view[:, second, first] = blocks.transpose(-1, -2)
    view[:, first, second] = blocks
    if bias:
        sums = _window_sums(a.sum(dim=2).view(b, hp, wp, c), (kh, kw), stride, (out_h, out_w))
        col = sums.transpose(1, 2).reshape(b, d)
        out[:, :d, d] = col
        out[:, d, :d] = col
        out[:, d, d] = n * out_h * out_w
    return out


def _window_sums(grid: Tensor, kernel_size: Pair, stride: Pair, out: Pair) -> Tensor:
    """``Σ`` over each kernel position's window of ``grid`` ``(B, Hp, Wp, F)``: ``(B, kh·kw, F)``. Window
    ``(i, j)`` is the pixels ``(i + u·sh, j + v·sw)``, ``u < out_h``, ``v < out_w``: with stride 1, a sum
    pooling of the window's size (``avg_pool2d`` without its division), evaluated at the ``kh × kw``
    positions; with a stride, a strided slice summed per kernel position."""
    b, f = grid.shape[0], grid.shape[-1]
    (kh, kw), (out_h, out_w) = kernel_size, out
    if tuple(stride) == (1, 1):
        pooled = F.avg_pool2d(grid.permute(0, 3, 1, 2), (out_h, out_w), 1, divisor_override=1)
        return pooled[:, :, :kh, :kw].reshape(b, f, kh * kw).transpose(1, 2)
    sh, sw = stride
    return torch.stack(
        [
            grid[:, i : i + sh * (out_h - 1) + 1 : sh, j : j + sw * (out_w - 1) + 1 : sw].sum(
                dim=(1, 2)
            )
            for i in range(kh)
            for j in range(kw)
        ],
        dim=1,
    )


def _unfold(
    xs: Sequence[Tensor],
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    bias: bool,
    dtype: torch.dtype,
) -> Tensor:
    n, c, h, w = xs[0].shape
    top, bottom, left, right = padding
    b = len(xs)
    x = torch.stack([x.detach() for x in xs]).to(dtype).view(b * n, c, h, w)
    if (top, left) != (bottom, right):
        x = F.pad(x, (left, right, top, bottom))
        pad: Pair = (0, 0)
    else:
        pad = (top, left)
    patches = F.unfold(x, kernel_size, dilation=dilation, padding=pad, stride=stride)  # (B·N, D, T)
    dim, t = patches.shape[1], patches.shape[2]
    rows = patches.view(b, n, dim, t).transpose(1, 2).reshape(b, dim, n * t)
    if bias:
        rows = torch.cat([rows, rows.new_ones(b, 1, n * t)], dim=1)
    return torch.bmm(rows, rows.transpose(1, 2))
