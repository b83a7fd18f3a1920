"""Which exact Conv2d input-factor kernel is faster for a shape: a cost model per device type.

Both kernels (:mod:`.conv_shift`, :mod:`.conv_unfold`) are exact, so the choice only affects speed.

* ``cpu``: work counts times per-unit costs, fitted to timings of the development machine (below).
* any other device type (``cuda`` included) until it is measured there: shift for 1×1 kernels (a
  subsample and one GEMM, never more work than unfolding), unfold + GEMM otherwise. Unfold is one large GEMM,
  which accelerators run near their peak, whereas the shift method issues ~10-50 small GEMMs and copies
  per layer whose launch latency would dominate; its batch chunking bounds the patch memory.
  ``python -m benchmarks.conv_factor`` times both kernels on a device, the data needed to fit its model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .conv_shift import Padding, Pair, ShiftGeometry, shift_geometry

__all__ = ["RULES", "choose_method"]

# The CPU cost model: work counts times per-unit costs, fitted (weighted by 1/time) to 77 timed
# layer shapes on the 2-core development machine (float32, 2 threads). Both methods are exact, so a wrong
# choice near a tie only costs a little time.
_GEMM_PEAK = 200e9  # FLOP/s of a large float32 GEMM (before _GEMM_SCALE)
_GEMM_HALF = 32  # square GEMM side at which half the peak is reached (thin GEMMs are memory-bound)
_GEMM_SCALE = 0.75  # fitted correction of the GEMM rate model
_UNFOLD = 2.6e-9  # s per patch element written by F.unfold and re-laid out for the GEMM
_COPY = 1.25e-9  # s per element copied or updated (grids, strips, blocks, the result)
_CALL = 8e-6  # s of fixed overhead per tensor operation
_UNFOLD_CALLS = 10  # tensor operations of one unfold + GEMM


def _gemm_time(m: int, k: int) -> float:
    """Compute time of ``(m × k) @ (k × m)``: thin GEMMs are memory-bound, so their rate is lower."""
    return 2.0 * m * m * k / (_GEMM_PEAK * m / (m + _GEMM_HALF))


def _shift_features(plan: ShiftGeometry, n: int, c: int) -> tuple[float, int, int]:
    """Work of the shift method: (GEMM seconds, elements copied or updated, tensor operations)."""
    hpad, wpad = plan.pad_shape
    k = n * hpad * wpad
    lines = sum(len(cols) for cols in plan.strip_cols)
    # Every block is stacked, written, and written again transposed as its mirror image.
    pairs = sum(len(group.pairs) for group in plan.groups)
    copied = c * (len(plan.grid_phases) * k + 2 * n * hpad * lines) + 3 * c * c * pairs
    calls = 4 + len(plan.groups)
    gemm = 0.0
    for group in plan.groups:
        if group.empty:
            continue
        rows = {run for ex_r, _ in group.excluded for run in ex_r}
        cols = {run for _, ex_c in group.excluded for run in ex_c}
        corners = {(r, q) for ex_r, ex_c in group.excluded for r in ex_r for q in ex_c}
        gemm += _gemm_time(c, k)
        gemm += sum(_gemm_time(c, n * (r1 - r0) * wpad) for r0, r1 in rows)
        gemm += sum(_gemm_time(c, n * (c1 - c0) * hpad) for c0, c1 in cols)
        gemm += sum(_gemm_time(c, n * (r1 - r0) * (c1 - c0)) for (r0, r1), (c0, c1) in corners)
        calls += 2 + 2 * (len(rows) + len(cols)) + 4 * len(corners)
        copied += c * c * (1 + len(rows) + len(cols) + len(corners))
        for ex_r, ex_c in group.excluded:
            updates = len(ex_r) + len(ex_c) + len(ex_r) * len(ex_c)
            if updates:  # clone, then one update per band and per corner
                copied, calls = copied + c * c * (1 + updates), calls + 1 + updates
    return gemm, copied, calls


def _shift_time(plan: ShiftGeometry, n: int, c: int) -> float:
    gemm, copied, calls = _shift_features(plan, n, c)
    return _GEMM_SCALE * gemm + _COPY * copied + _CALL * calls


def _unfold_time(n: int, c: int, kk: int, positions: int) -> float:
    d = c * kk
    gemm = _gemm_time(d, n * positions)
    return _GEMM_SCALE * gemm + _UNFOLD * d * n * positions + _COPY * d * d + _UNFOLD_CALLS * _CALL


@functools.lru_cache(maxsize=512)
def cpu_rule(
    n: int,
    c: int,
    h: int,
    w: int,
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
) -> str:
    """The fitted CPU model: 1×1 kernels always shift; k×k kernels take the cheaper predicted method."""
    kk = kernel_size[0] * kernel_size[1]
    if kk == 1:
        return "shift"  # subsample + one GEMM: never slower than unfolding a 1×1 kernel
    plan = shift_geometry(h, w, kernel_size, stride, padding, dilation)
    positions = plan.ax_r.out * plan.ax_c.out
    return "shift" if _shift_time(plan, n, c) <= _unfold_time(n, c, kk, positions) else "unfold"


def unmeasured_rule(
    n: int,
    c: int,
    h: int,
    w: int,
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
) -> str:
    """Device types without a fitted model: shift for 1×1 kernels, else unfold + GEMM (module docstring)."""
    return "shift" if kernel_size[0] * kernel_size[1] == 1 else "unfold"


Rule = Callable[[int, int, int, int, Pair, Pair, Padding, Pair], str]
#: Device type -> dispatch rule; device types not listed use :func:`unmeasured_rule`.
RULES: dict[str, Rule] = {"cpu": cpu_rule}


def choose_method(
    device_type: str,
    shape: tuple[int, int, int, int],
    kernel_size: Pair,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
) -> str:
    """``'shift'`` or ``'unfold'`` for an input of ``shape`` ``(N, C, H, W)`` on ``device_type``."""
    rule = RULES.get(device_type, unmeasured_rule)
    return rule(*shape, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))  # type: ignore[arg-type]
