"""Exact Conv2d input factor ``A = Σ_n Σ_t p pᵀ`` without building the patch (im2col) tensor.

Notation: the input ``x`` has shape ``(N, C, H, W)``; a kernel position ``k = i·kw + j`` reads input pixel
``(oy·sh − top + i·dh, ox·sw − left + j·dw)`` for output position ``(oy, ox)``. The patch vector ``p`` of one
output position has length ``D = C·kh·kw`` in the order of ``weight.reshape(out_channels, -1)`` (channel,
then kernel row, then kernel column), with a constant 1 appended last when the layer has a bias.

Block ``(k, k')`` of ``A`` (a ``C × C`` matrix) is a correlation between two shifted copies of the input
summed over the output window of ``k``. The shift method (KFC's Ω computed as correlations):

* The input is split into ``sh·sw`` phase sub-grids ``x[:, :, p::sh, q::sw]`` (one grid for stride 1), so that
  every kernel position reads a contiguous rectangle of one grid and its partner position reads the same
  rectangle of a grid shifted by a relative offset ``δ``.
* Blocks that share ``(grid, partner grid, δ)`` share their full correlation ``F`` over all pixel pairs; one GEMM
  per distinct key (13 for a 3×3 stride-1 kernel instead of 45 block products over patches). ``F`` is computed on
  a zero-margined ``(C, N·Hpad·Wpad)`` copy of the grids, where a 2-D shift is a flat column offset (the margins
  make the wrap-around terms vanish), so each GEMM reads strided views and copies nothing.
* A block equals ``F`` minus the pixel pairs outside its window: thin boundary bands (rows, columns and their
  corner cells, by inclusion-exclusion), which only exist where a window stops short of the image edge.
* Only one triangle of blocks is computed; ``A[k', k] = A[k, k']ᵀ``.

``conv2d_a_factor`` dispatches between this method and unfold + GEMM (``conv2d_a_factor_unfold``) with a cost
model; both are exact and return the same matrix up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["conv2d_a_factor", "conv2d_a_factor_shift", "conv2d_a_factor_unfold"]

Pair = tuple[int, int]
Key = tuple[int, int, int]
Padding = tuple[int, int, int, int]


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


@dataclass(frozen=True)
class _Axis:
    """How one spatial axis of the kernel maps onto phase sub-grids (stride ``s``).

    Kernel index ``i`` reads grid ``phase[i]`` at grid coordinates ``start[i] + o`` for outputs
    ``o ∈ [0, out)``; grid ``p`` holds input coordinates ``p, p + s, …`` and has ``length[p]`` entries.
    """

    phase: tuple[int, ...]
    start: tuple[int, ...]
    out: int
    length: tuple[int, ...]


def _axis(size: int, k: int, s: int, d: int, pad_lo: int, pad_hi: int) -> _Axis:
    out = (size + pad_lo + pad_hi - d * (k - 1) - 1) // s + 1
    offsets = [i * d - pad_lo for i in range(k)]
    return _Axis(
        phase=tuple(o % s for o in offsets),
        start=tuple(o // s for o in offsets),  # floor division: negative starts lie in the padding
        out=out,
        length=tuple(max(0, (size - p + s - 1) // s) for p in range(s)),
    )


def _runs(lo: int, hi: int, start: int, out: int) -> tuple[Pair, ...]:
    """Runs of the overlap ``[lo, hi)`` outside the window ``[start, start + out)``: at most two."""
    w0 = min(max(start, lo), hi)
    w1 = min(max(start + out, lo), hi)
    return tuple(run for run in ((lo, w0), (w1, hi)) if run[0] < run[1])


def _pair_groups(ax_r: _Axis, ax_c: _Axis, kw: int) -> dict[tuple[Key, Key], list[Pair]]:
    """Upper-triangle block pairs ``(k, k')`` grouped by key ``(row key, column key)``.

    An axis key ``(phase, partner phase, shift)`` says which grids the pair reads and how far apart. A pair
    is oriented so that its key is the smaller of {key, reversed key}; the reversed orientation is the
    transposed block, so each group needs one full correlation.
    """
    groups: dict[tuple[Key, Key], list[Pair]] = {}
    kk = len(ax_r.phase) * kw
    for a in range(kk):
        for b in range(a, kk):
            (ia, ja), (ib, jb) = divmod(a, kw), divmod(b, kw)
            rk = (ax_r.phase[ia], ax_r.phase[ib], ax_r.start[ib] - ax_r.start[ia])
            ck = (ax_c.phase[ja], ax_c.phase[jb], ax_c.start[jb] - ax_c.start[ja])
            rev = ((rk[1], rk[0], -rk[2]), (ck[1], ck[0], -ck[2]))
            if (rk, ck) <= rev:
                groups.setdefault((rk, ck), []).append((a, b))
            else:
                groups.setdefault(rev, []).append((b, a))
    return groups


def _phase_grids(x: Tensor, stride: Pair, ax_r: _Axis, ax_c: _Axis, margin: Pair) -> Tensor:
    """The used phase sub-grids of ``x`` as ``(grids, C, N, Hpad, Wpad)``, data top-left, zero margins.

    Grid ``(pr, pc)`` (index ``rank(pr)·len(col phases) + rank(pc)``) holds ``x[:, :, pr::sh, pc::sw]``.
    ``Hpad``/``Wpad`` exceed the largest grid by ``margin``, so in the flattened ``(C, N·Hpad·Wpad)`` layout a
    2-D shift ``(dy, dx)`` with ``|dy|, |dx| <= margin`` is the column offset ``dy·Wpad + dx`` and every
    wrapped-around pair (across a row end or an image end) has a zero factor.
    """
    n, c = x.shape[:2]
    phases_r, phases_c = sorted(set(ax_r.phase)), sorted(set(ax_c.phase))
    hpad, wpad = max(ax_r.length) + margin[0], max(ax_c.length) + margin[1]
    grids = x.new_empty(len(phases_r) * len(phases_c), c, n, hpad, wpad)
    for gr, pr in enumerate(phases_r):
        for gc, pc in enumerate(phases_c):
            grid = grids[gr * len(phases_c) + gc]
            hg, wg = ax_r.length[pr], ax_c.length[pc]
            grid[:, :, :hg, :wg] = x[:, :, pr :: stride[0], pc :: stride[1]].transpose(0, 1)
            grid[:, :, hg:].zero_()
            grid[:, :, :hg, wg:].zero_()
    return grids


class _KeyCorrelator:
    """Correlations of grid ``g1`` with grid ``g2`` shifted by ``(dy, dx)``, over the whole overlap or bands.

    Every method returns a ``C × C`` matrix ``Σ g1[:, n, y, x] g2[:, n, y + dy, x + dx]ᵀ``.
    """

    def __init__(self, grids: Tensor, g1: int, g2: int, dy: int, dx: int, overlap: Pair) -> None:
        self.a, self.b = grids[g1], grids[g2]  # (C, N, Hpad, Wpad)
        self.dy, self.dx = dy, dx
        self.overlap_rows = overlap

    def full(self) -> Tensor:
        """All pixel pairs: one GEMM over strided views of the flattened grids (no copy)."""
        c = self.a.shape[0]
        wpad = self.a.shape[3]
        fa, fb = self.a.reshape(c, -1), self.b.reshape(c, -1)
        off = self.dy * wpad + self.dx
        size = fa.shape[1]
        lo, hi = max(0, -off), size - max(0, off)
        return fa[:, lo:hi] @ fb[:, lo + off : hi + off].t()

    def rows(self, run: Pair) -> Tensor:
        """Pairs whose first pixel lies in grid rows ``run`` (all columns): a batched GEMM over examples.

        Within one image the rows are contiguous in memory, so the views need no copy. Columns whose partner
        falls outside the row are trimmed; they only hold margin zeros.
        """
        c, n, _, wpad = self.a.shape
        fa, fb = self.a.reshape(c, n, -1), self.b.reshape(c, n, -1)
        lo = run[0] * wpad + max(0, -self.dx)
        hi = run[1] * wpad - max(0, self.dx)
        off = self.dy * wpad + self.dx
        prod = torch.bmm(
            fa[:, :, lo:hi].transpose(0, 1), fb[:, :, lo + off : hi + off].permute(1, 2, 0)
        )
        return prod.sum(dim=0)

    def cols(self, run: Pair, rows: Pair | None = None) -> Tensor:
        """Pairs whose first pixel lies in grid columns ``run`` and rows ``rows`` (default: the overlap)."""
        r0, r1 = rows if rows is not None else self.overlap_rows
        c = self.a.shape[0]
        a = self.a[:, :, r0:r1, run[0] : run[1]].reshape(c, -1)
        b = self.b[:, :, r0 + self.dy : r1 + self.dy, run[0] + self.dx : run[1] + self.dx]
        return a @ b.reshape(c, -1).t()


def conv2d_a_factor_shift(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
) -> Tensor:
    """Input factor by the shift-correlation method (module docstring); contract of the unfold reference.

    Memory: one zero-margined copy of the input (its phase grids), the result, and thin boundary bands.
    """
    n, c, h, w = x.shape
    kh, kw = kernel_size
    top, bottom, left, right = padding
    ax_r = _axis(h, kh, stride[0], dilation[0], top, bottom)
    ax_c = _axis(w, kw, stride[1], dilation[1], left, right)
    if ax_r.out <= 0 or ax_c.out <= 0:
        raise ValueError(f"a {h}×{w} input has no output positions under these conv settings")
    kk = kh * kw
    d = c * kk
    out = x.new_empty(d + int(bias), d + int(bias))
    groups = _pair_groups(ax_r, ax_c, kw)
    # A shift as large as a grid never pairs two data pixels (those groups are skipped), so margins of at
    # most the grid size suffice.
    margin = (
        min(max(abs(key[0][2]) for key in groups), max(ax_r.length)),
        min(max(abs(key[1][2]) for key in groups), max(ax_c.length)),
    )
    grids = _phase_grids(x, stride, ax_r, ax_c, margin)
    phases_r, phases_c = sorted(set(ax_r.phase)), sorted(set(ax_c.phase))

    def grid_of(pr: int, pc: int) -> int:
        return phases_r.index(pr) * len(phases_c) + phases_c.index(pc)

    firsts: list[int] = []
    seconds: list[int] = []
    results: list[Tensor] = []
    zero = x.new_zeros(c, c)
    for (rk, ck), pairs in groups.items():
        firsts += [p[0] for p in pairs]
        seconds += [p[1] for p in pairs]
        # Overlap: grid-1 coordinates whose partner (shifted by dy, dx) lies in grid 2's data.
        dy, dx = rk[2], ck[2]
        rows = (max(0, -dy), min(ax_r.length[rk[0]], ax_r.length[rk[1]] - dy))
        cols = (max(0, -dx), min(ax_c.length[ck[0]], ax_c.length[ck[1]] - dx))
        if rows[0] >= rows[1] or cols[0] >= cols[1]:
            results += [zero] * len(pairs)  # no pixel pair at this shift
            continue
        corr = _KeyCorrelator(grids, grid_of(rk[0], ck[0]), grid_of(rk[1], ck[1]), dy, dx, rows)
        full = corr.full()
        memo: dict[object, Tensor] = {}
        for first, _ in pairs:
            ex_r = _runs(*rows, ax_r.start[first // kw], ax_r.out)
            ex_c = _runs(*cols, ax_c.start[first % kw], ax_c.out)
            if (ex_r, ex_c) not in memo:
                memo[ex_r, ex_c] = _window_sum(corr, full, ex_r, ex_c, memo)
            results.append(memo[ex_r, ex_c])

    # Blocks are (C, C) slices of the (C, kh·kw, C, kh·kw) view of the weight part: write both triangles.
    blocks_view = out[:d, :d].view(c, kk, c, kk).permute(1, 3, 0, 2)
    stacked = torch.stack(results)
    first_idx, second_idx = torch.tensor(firsts), torch.tensor(seconds)
    blocks_view[second_idx, first_idx] = stacked.transpose(1, 2)
    blocks_view[first_idx, second_idx] = stacked
    if bias:
        _fill_bias(out, grids, ax_r, ax_c, kw, grid_of, n)
    return out


def _window_sum(
    corr: _KeyCorrelator,
    full: Tensor,
    ex_r: tuple[Pair, ...],
    ex_c: tuple[Pair, ...],
    memo: dict[object, Tensor],
) -> Tensor:
    """``full`` minus the pairs in excluded rows or columns (inclusion-exclusion); band sums are memoised."""
    if not ex_r and not ex_c:
        return full
    total = full.clone()
    for run in ex_r:
        if ("r", run) not in memo:
            memo["r", run] = corr.rows(run)
        total -= memo["r", run]
    for run in ex_c:
        if ("c", run) not in memo:
            memo["c", run] = corr.cols(run)
        total -= memo["c", run]
    for row_run in ex_r:
        for col_run in ex_c:
            total += corr.cols(col_run, rows=row_run)
    return total


def _fill_bias(
    out: Tensor, grids: Tensor, ax_r: _Axis, ax_c: _Axis, kw: int, grid_of, n: int
) -> None:
    """Bias row/column: the window sum of each kernel position's grid; corner: ``N·T``."""
    d = out.shape[0] - 1
    c = grids.shape[1]
    per_grid = grids.sum(dim=2)  # (grids, C, Hpad, Wpad): summed over examples
    sums = out[:d, d].view(c, -1)
    for k in range(sums.shape[1]):
        i, j = divmod(k, kw)
        r0 = max(ax_r.start[i], 0)
        c0 = max(ax_c.start[j], 0)
        r1 = min(ax_r.start[i] + ax_r.out, ax_r.length[ax_r.phase[i]])
        c1 = min(ax_c.start[j] + ax_c.out, ax_c.length[ax_c.phase[j]])
        if r0 < r1 and c0 < c1:
            g = grid_of(ax_r.phase[i], ax_c.phase[j])
            sums[:, k] = per_grid[g, :, r0:r1, c0:c1].sum(dim=(1, 2))
    out[d, :d] = out[:d, d]
    out[d, d] = n * ax_r.out * ax_c.out


def conv2d_a_factor(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
) -> Tensor:
    """Input factor ``S = Σ_n Σ_t p pᵀ`` by the fastest exact method for the shape.

    Same contract as :func:`conv2d_a_factor_unfold` (shape ``(D, D)``, patch order of
    ``weight.reshape(out_channels, -1)``, bias entry last, not normalised, computed in ``x``'s dtype).
    """
    return conv2d_a_factor_shift(x, kernel_size, stride, padding, dilation, bias)
