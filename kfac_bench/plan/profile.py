"""``plan.profile=true``: time the engine's decomposition and a GEMM at the model's factor sizes on this
machine's device, and fit ``seconds = intercept + slope · n³`` (the O(N³) cost model of KAISA §3.2).

The decomposition is the engine's own (``SecondOrderMethod.decompose`` of the recipe's method and dtypes, on
a random SPD factor), so the timing includes its upcast and finiteness check. Sizes are sampled from small
to large and the largest ones are skipped when the fit predicts they would overrun the time cap; the fit
then extrapolates to them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .recipe import EngineSettings
from .timing import Rates

__all__ = ["fit_n3", "profile_rates", "sample_sizes"]


def sample_sizes(dims: Sequence[int], count: int = 6) -> list[int]:
    """Up to ``count`` of the distinct ``dims``, spread geometrically from the smallest to the largest."""
    distinct = sorted(set(dims))
    if len(distinct) <= count:
        return distinct
    lo, hi = distinct[0], distinct[-1]
    targets = [lo * (hi / lo) ** (i / (count - 1)) for i in range(count)]
    return sorted({min(distinct, key=lambda d: abs(d - t)) for t in targets})


def fit_n3(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``seconds = intercept + slope · n³``, intercept >= 0."""
    xs = [float(n) ** 3 for n, _ in samples]
    ys = [t for _, t in samples]
    if len(samples) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else my / mx
    intercept = my - slope * mx
    if intercept < 0 or slope <= 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return intercept, slope


def _timed(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.2) -> float:
    """The fastest of 2 to 5 runs of ``fn`` (repeated until they last ``min_seconds``): on a shared machine
    the minimum is the cost, the rest is other work."""
    times: list[float] = []
    while len(times) < 5 and (len(times) < 2 or sum(times) < min_seconds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _decompose(settings: EngineSettings, factor: torch.Tensor) -> Callable[[], object]:
    return lambda: settings.method.decompose([factor], 0.003, False)


def profile_rates(
    dims: Sequence[int],
    settings: EngineSettings,
    budget_s: float,
    bandwidth_bytes: float,
    device: torch.device | None = None,
) -> Rates:
    """Decomposition and GEMM rates measured on ``device`` (default: CUDA if available, else CPU) within
    about ``budget_s`` seconds."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    start = time.perf_counter()
    samples: list[tuple[int, float]] = []
    for n in sample_sizes(dims):
        if len(samples) >= 2:
            a, b = fit_n3(samples)
            if time.perf_counter() - start + 2 * (a + b * n**3) > 0.8 * budget_s:
                break
        x = torch.randn(n, n, generator=gen).to(device=device, dtype=settings.factor_dtype)
        factor = x @ x.t() / n + torch.eye(n, device=device, dtype=settings.factor_dtype)
        settings.method.decompose([factor], 0.003, False)  # warm-up (library load, workspace)
        samples.append((n, _timed(_decompose(settings, factor), device)))
    intercept, slope = fit_n3(samples)
    g = min(max(dims), 4096 if device.type == "cuda" else 1024)
    dt = torch.promote_types(settings.inv_dtype, torch.float32)
    p = torch.randn(g, g, generator=gen).to(device=device, dtype=dt)
    q = torch.randn(g, g, generator=gen).to(device=device, dtype=dt)
    p @ q  # warm-up
    gemm = 2 * g**3 / _timed(lambda: p @ q, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return Rates(
        decomposition_s_per_n3=slope,
        decomposition_intercept_s=intercept,
        gemm_flops=gemm,
        bandwidth_bytes=bandwidth_bytes,
        source=f"profiled on {name} ({torch.get_num_threads()} threads) in "
        f"{time.perf_counter() - start:.1f} s; network {bandwidth_bytes / 1e9:g} GB/s assumed",
        samples=[{"n": n, "seconds": t} for n, t in samples],
    )
