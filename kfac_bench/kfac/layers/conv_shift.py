"""Exact Conv2d input factor by the shift-correlation method: no patch (im2col) tensor is built.

Notation: the input ``x`` has shape ``(N, C, H, W)``; a kernel position ``k = i·kw + j`` reads input pixel
``(oy·sh − top + i·dh, ox·sw − left + j·dw)`` for output position ``(oy, ox)``. The patch vector ``p`` of one
output position has length ``D = C·kh·kw`` in the order of ``weight.reshape(out_channels, -1)`` (channel,
then kernel row, then kernel column), with a constant 1 appended last when the layer has a bias.

Block ``(k, k')`` of ``A`` (a ``C × C`` matrix) is a correlation between two shifted copies of the input
summed over the output window of ``k``. The shift method (KFC's Ω computed as correlations):

* The input is split into ``sh·sw`` phase sub-grids ``x[:, :, p::sh, q::sw]`` (one grid for stride 1), so that
  every kernel position reads a contiguous rectangle of one grid and its partner position reads the same
  rectangle of a grid shifted by a relative offset ``δ``.
* Blocks that share ``(grid, partner grid, δ)`` share their full correlation ``F`` over all pixel pairs:
  one GEMM per distinct key (13 for a 3×3 stride-1 kernel instead of 45 block products over patches).
  ``F`` is computed on a ``(C, H·N·Wpad)`` copy of the grids (rows of all examples interleaved, a zero
  margin after each row), where a 2-D shift is a flat column offset whose wrap-around terms vanish: each
  GEMM reads strided views, no copy.
* A block equals ``F`` minus the pixel pairs outside its window: thin boundary bands (rows, columns and their
  corner cells, by inclusion-exclusion), which only exist where a window stops short of the image edge.
* Only one triangle of blocks is computed; ``A[k', k] = A[k, k']ᵀ``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Padding", "Pair", "ShiftGeometry", "conv2d_a_factor_shift", "shift_geometry"]

Pair = tuple[int, int]
Key = tuple[int, int, int]
Padding = tuple[int, int, int, int]


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
    offsets = [i * d - pad_lo for i in range(k)]
    return _Axis(
        phase=tuple(o % s for o in offsets),
        start=tuple(o // s for o in offsets),  # floor division: negative starts lie in the padding
        out=(size + pad_lo + pad_hi - d * (k - 1) - 1) // s + 1,
        length=tuple(max(0, (size - p + s - 1) // s) for p in range(s)),
    )


def _runs(lo: int, hi: int, start: int, out: int) -> tuple[Pair, ...]:
    """Runs of the overlap ``[lo, hi)`` outside the window ``[start, start + out)``: at most two."""
    w0 = min(max(start, lo), hi)
    w1 = min(max(start + out, lo), hi)
    return tuple(run for run in ((lo, w0), (w1, hi)) if run[0] < run[1])


@dataclass(frozen=True)
class _Group:
    """Blocks that read grid ``g1`` against grid ``g2`` shifted by ``(dy, dx)``: one full correlation.

    ``rows``/``cols`` is the overlap (grid-1 coordinates whose partner lies in grid 2's data); for each
    oriented pair ``(k, k')`` of kernel positions, ``excluded[m]`` holds the row runs and column runs of the
    overlap that lie outside ``k``'s output window.
    """

    g1: int
    g2: int
    dy: int
    dx: int
    rows: Pair
    cols: Pair
    pairs: tuple[Pair, ...]
    excluded: tuple[tuple[tuple[Pair, ...], tuple[Pair, ...]], ...]

    @property
    def empty(self) -> bool:
        return self.rows[0] >= self.rows[1] or self.cols[0] >= self.cols[1]


@dataclass(frozen=True)
class ShiftGeometry:
    """Everything about the shift method that depends only on shapes and conv settings (cached)."""

    ax_r: _Axis
    ax_c: _Axis
    grid_phases: tuple[Pair, ...]  # (row phase, column phase) of each grid
    margin: int  # zero columns after each grid row: the largest column shift
    groups: tuple[_Group, ...]
    strip_cols: tuple[tuple[int, ...], ...]  # per grid: the columns that column bands read

    @functools.cached_property
    def pair_index(self) -> tuple[Tensor, Tensor]:
        """First and second kernel positions of every block, in group order (index tensors)."""
        pairs = [pair for group in self.groups for pair in group.pairs]
        return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])

    def grid(self, pr: int, pc: int) -> int:
        return self.grid_phases.index((pr, pc))

    @property
    def pad_shape(self) -> Pair:
        return max(self.ax_r.length), max(self.ax_c.length) + self.margin


@functools.lru_cache(maxsize=512)
def shift_geometry(
    h: int, w: int, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair
) -> ShiftGeometry:
    kh, kw = kernel_size
    top, bottom, left, right = padding
    ax_r = _axis(h, kh, stride[0], dilation[0], top, bottom)
    ax_c = _axis(w, kw, stride[1], dilation[1], left, right)
    if ax_r.out <= 0 or ax_c.out <= 0:
        raise ValueError(f"a {h}×{w} input has no output positions under these conv settings")
    # Group the upper-triangle pairs by (row key, column key); an axis key (phase, partner phase, shift)
    # names the grids and their distance. Each pair is oriented so that its key is the smaller of {key,
    # reversed key}: the reversed orientation is the transposed block, so a group needs one correlation.
    keyed: dict[tuple[Key, Key], list[Pair]] = {}
    for a in range(kh * kw):
        for b in range(a, kh * kw):
            (ia, ja), (ib, jb) = divmod(a, kw), divmod(b, kw)
            rk = (ax_r.phase[ia], ax_r.phase[ib], ax_r.start[ib] - ax_r.start[ia])
            ck = (ax_c.phase[ja], ax_c.phase[jb], ax_c.start[jb] - ax_c.start[ja])
            rev = ((rk[1], rk[0], -rk[2]), (ck[1], ck[0], -ck[2]))
            if (rk, ck) <= rev:
                keyed.setdefault((rk, ck), []).append((a, b))
            else:
                keyed.setdefault(rev, []).append((b, a))
    grid_phases = tuple(
        (pr, pc) for pr in sorted(set(ax_r.phase)) for pc in sorted(set(ax_c.phase))
    )
    groups = []
    for (rk, ck), pairs in keyed.items():
        dy, dx = rk[2], ck[2]
        rows = (max(0, -dy), min(ax_r.length[rk[0]], ax_r.length[rk[1]] - dy))
        cols = (max(0, -dx), min(ax_c.length[ck[0]], ax_c.length[ck[1]] - dx))
        excluded = tuple(
            (
                _runs(*rows, ax_r.start[first // kw], ax_r.out),
                _runs(*cols, ax_c.start[first % kw], ax_c.out),
            )
            for first, _ in pairs
        )
        g1 = grid_phases.index((rk[0], ck[0]))
        g2 = grid_phases.index((rk[1], ck[1]))
        groups.append(_Group(g1, g2, dy, dx, rows, cols, tuple(pairs), excluded))
    # A shift as long as a grid never pairs two data pixels (such groups are empty), so a margin of at
    # most the grid width suffices.
    live = [g for g in groups if not g.empty] or groups
    margin = min(max(abs(g.dx) for g in live), max(ax_c.length))
    strip_cols: list[set[int]] = [set() for _ in grid_phases]
    for g in live:
        for run in {run for _, ex_c in g.excluded for run in ex_c}:
            strip_cols[g.g1].update(range(*run))
            strip_cols[g.g2].update(range(run[0] + g.dx, run[1] + g.dx))
    return ShiftGeometry(
        ax_r,
        ax_c,
        grid_phases,
        margin,
        tuple(groups),
        tuple(tuple(sorted(cols)) for cols in strip_cols),
    )


def _phase_grids(x: Tensor, stride: Pair, plan: ShiftGeometry) -> Tensor:
    """The used phase sub-grids of ``x`` as ``(grids, C, H, N, Wpad)``, data top-left, zeros elsewhere.

    Grid ``(pr, pc)`` holds ``x[:, :, pr::sh, pc::sw]`` with the rows of all examples interleaved. Flattened
    to ``(C, H·N·Wpad)``, a 2-D shift ``(dy, dx)`` is the column offset ``dy·N·Wpad + dx``: the zero margin
    of ``|dx|`` columns keeps pairs that wrap into the next row segment at zero, and a row shift never
    wraps (it runs off the end of the buffer instead), so rows need no margin.

    With several grids (a strided convolution) ``x`` is first copied to the grids' ``(C, H, N, W)`` order:
    each grid then gathers its every-``sw``-th column from contiguous rows of all examples instead of from
    ``N`` places ``C·H·W`` apart (the copy is freed on return).
    """
    n, c = x.shape[:2]
    hpad, wpad = plan.pad_shape
    grids = x.new_zeros(len(plan.grid_phases), c, hpad, n, wpad)
    rows = x.permute(1, 2, 0, 3)  # (C, H, N, W)
    if len(plan.grid_phases) > 1:
        rows = rows.contiguous()
    for g, (pr, pc) in enumerate(plan.grid_phases):
        hg, wg = plan.ax_r.length[pr], plan.ax_c.length[pc]
        grids[g, :, :hg, :, :wg] = rows[:, pr :: stride[0], :, pc :: stride[1]]
    return grids


class _Strips:
    """Boundary columns of the grids as contiguous ``(C, columns, H, N)`` strips, extracted once per call.

    A column is strided in the grid layout; in a strip, a run of rows of one column is a contiguous block
    (a view), and every group that corrects the same columns shares the strip.
    """

    def __init__(self, grids: Tensor, plan: ShiftGeometry) -> None:
        self.grids, self.plan = grids, plan
        self.cache: dict[int, tuple[Tensor, dict[int, int]]] = {}

    def get(self, g: int) -> tuple[Tensor, dict[int, int]]:
        """Strip of grid ``g`` and each column's position in it."""
        if g not in self.cache:
            lines = self.plan.strip_cols[g]
            index = torch.tensor(lines, device=self.grids.device)
            strip = self.grids[g].index_select(3, index).movedim(3, 1).contiguous()
            self.cache[g] = (strip, {line: i for i, line in enumerate(lines)})
        return self.cache[g]


def _shifted_gram(a: Tensor, b: Tensor, off: int, out: Tensor | None = None) -> Tensor:
    """``Σ_k a[:, k] b[:, k + off]ᵀ`` over the ``k`` where both exist, for ``(C, K)`` matrices ``a, b``."""
    lo, hi = max(0, -off), a.shape[1] - max(0, off)
    return torch.mm(a[:, lo:hi], b[:, lo + off : hi + off].t(), out=out)


class _Correlator:
    """Correlations of grid ``g1`` with grid ``g2`` shifted by ``(dy, dx)``, whole or over bands.

    Every method returns the ``C × C`` matrix ``Σ g1[:, y, n, x] g2[:, y + dy, n, x + dx]ᵀ`` over the pixels
    it names; band sums are memoised because several blocks of a group exclude the same band.
    """

    def __init__(self, grids: Tensor, group: _Group, strips: _Strips) -> None:
        self.a, self.b = grids[group.g1], grids[group.g2]  # (C, H, N, Wpad)
        self.group, self.strips = group, strips
        self.dy, self.dx = group.dy, group.dx
        self.memo: dict[tuple[object, ...], Tensor] = {}

    def full(self, out: Tensor | None = None) -> Tensor:
        """All pixel pairs: one GEMM over strided views of the flattened grids (no copy)."""
        c, _, n, wpad = self.a.shape
        off = self.dy * n * wpad + self.dx
        return _shifted_gram(self.a.reshape(c, -1), self.b.reshape(c, -1), off, out=out)

    def row_band(self, run: Pair) -> Tensor:
        """Pairs whose first pixel lies in grid rows ``run`` (all columns): a GEMM on contiguous views."""
        if ("r", run) not in self.memo:
            c, (r0, r1), dy = self.a.shape[0], run, self.dy
            a = self.a[:, r0:r1].reshape(c, -1)
            b = self.b[:, r0 + dy : r1 + dy].reshape(c, -1)
            self.memo["r", run] = _shifted_gram(a, b, self.dx)
        return self.memo["r", run]

    def col_band(self, run: Pair, rows: Pair | None = None) -> Tensor:
        """Pairs whose first pixel lies in grid columns ``run`` and ``rows`` (default: the overlap)."""
        rows = rows if rows is not None else self.group.rows
        if ("c", run, rows) not in self.memo:
            (s1, pos1), (s2, pos2) = self.strips.get(self.group.g1), self.strips.get(self.group.g2)
            i, j, count = pos1[run[0]], pos2[run[0] + self.dx], run[1] - run[0]
            (r0, r1), dy = rows, self.dy
            a = s1[:, i : i + count, r0:r1].reshape(s1.shape[0], -1)
            b = s2[:, j : j + count, r0 + dy : r1 + dy].reshape(s2.shape[0], -1)
            self.memo["c", run, rows] = a @ b.t()
        return self.memo["c", run, rows]

    def window(self, full: Tensor, ex_r: tuple[Pair, ...], ex_c: tuple[Pair, ...]) -> Tensor:
        """``full`` minus the pairs in the excluded row or column runs (inclusion-exclusion)."""
        if not ex_r and not ex_c:
            return full
        total = full.clone()
        for run in ex_r:
            total -= self.row_band(run)
        for run in ex_c:
            total -= self.col_band(run)
        for row_run in ex_r:
            for col_run in ex_c:
                total += self.col_band(col_run, rows=row_run)
        return total


def conv2d_a_factor_shift(
    x: Tensor, kernel_size: Pair, stride: Pair, padding: Padding, dilation: Pair, bias: bool
) -> Tensor:
    """Input factor by the shift-correlation method (module docstring); contract of the unfold reference.

    Memory: one zero-margined copy of the input (its phase grids), the result, and thin boundary bands
    (strided: one more transient copy of the input while the grids are built).
    The result is a curvature statistic, not part of the autograd graph: ``x`` is read detached.
    """
    x = x.detach()
    n, c, h, w = x.shape
    plan = shift_geometry(h, w, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
    kk = kernel_size[0] * kernel_size[1]
    d = c * kk
    grids = _phase_grids(x, stride, plan)
    strips = _Strips(grids, plan)
    out = x.new_empty(d + int(bias), d + int(bias))
    if kk == 1 and not plan.groups[0].empty and not any(plan.groups[0].excluded[0]):
        # 1×1 kernel whose window covers the grid: the whole factor is one GEMM, written in place.
        if bias:
            out[:d, :d] = _Correlator(grids, plan.groups[0], strips).full()
        else:
            _Correlator(grids, plan.groups[0], strips).full(out=out)
    else:
        blocks: list[Tensor] = []
        for group in plan.groups:
            if group.empty:  # no pixel pair at this shift
                blocks += [x.new_zeros(c, c)] * len(group.pairs)
                continue
            corr = _Correlator(grids, group, strips)
            full = corr.full()
            blocks += [corr.window(full, ex_r, ex_c) for ex_r, ex_c in group.excluded]
        # Block (k, k') is the (C, C) slice [:, k, :, k'] of the (C, kh·kw, C, kh·kw) view; two indexed
        # writes place every block and its mirror image.
        first, second = plan.pair_index
        block_view = out[:d, :d].view(c, kk, c, kk).permute(1, 3, 0, 2)
        stacked = torch.stack(blocks)
        block_view[second, first] = stacked.transpose(1, 2)
        block_view[first, second] = stacked
    if bias:
        _fill_bias(out, grids, plan, kernel_size[1], n)
    return out


def _fill_bias(out: Tensor, grids: Tensor, plan: ShiftGeometry, kw: int, n: int) -> None:
    """Bias row/column: each kernel position's window sum over its grid; corner: ``N·T``."""
    d = out.shape[0] - 1
    c = grids.shape[1]
    ax_r, ax_c = plan.ax_r, plan.ax_c
    per_grid = grids.sum(dim=3)  # (grids, C, H, Wpad): summed over examples
    sums = out[:d, d].view(c, -1)
    sums.zero_()
    for k in range(sums.shape[1]):
        i, j = divmod(k, kw)
        r0, c0 = max(ax_r.start[i], 0), max(ax_c.start[j], 0)
        r1 = min(ax_r.start[i] + ax_r.out, ax_r.length[ax_r.phase[i]])
        c1 = min(ax_c.start[j] + ax_c.out, ax_c.length[ax_c.phase[j]])
        if r0 < r1 and c0 < c1:
            g = plan.grid(ax_r.phase[i], ax_c.phase[j])
            sums[:, k] = per_grid[g, :, r0:r1, c0:c1].sum(dim=(1, 2))
    out[d, :d] = out[:d, d]
    out[d, d] = n * ax_r.out * ax_c.out
