"""Conv2d input factor A: the engine's fast path vs unfold + GEMM, per layer shape and per network.

Run: ``python -m benchmarks.conv_factor [--threads 2] [--repeats 7] [--json PATH]``.

Shapes: CIFAR ResNet-32 at batch 128 (the paper's CIFAR setting) and torchvision ResNet-50 at 64×64, batch 8
(its conv inputs captured with forward hooks). Each distinct layer configuration is timed once, both paths
alternating after a warm-up, and weighted by how many layers share it; reported times are medians in float32.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kfac_bench.kfac.layers.conv_unfold import (
    conv2d_a_factor,
    conv2d_a_factor_unfold,
    fast_method,
)


@dataclass(frozen=True)
class ConvShape:
    """One Conv2d input configuration: ``x`` is ``(batch, channels, size, size)``."""

    batch: int
    channels: int
    size: int
    kernel: int
    stride: int
    padding: int
    bias: bool = False

    def args(self) -> tuple:
        k, s, p = self.kernel, self.stride, self.padding
        return ((k, k), (s, s), (p, p, p, p), (1, 1), self.bias)

    def label(self) -> str:
        return f"{self.channels}ch@{self.size}² k{self.kernel} s{self.stride}"


def resnet32_shapes(batch: int = 128) -> Counter[ConvShape]:
    """CIFAR ResNet-32: 3 stages of 5 basic blocks (16, 32, 64 channels), option-A shortcuts (no conv)."""
    shapes: Counter[ConvShape] = Counter()
    shapes[ConvShape(batch, 3, 32, 3, 1, 1)] += 1
    for channels, size, first_in in ((16, 32, 16), (32, 16, 16), (64, 8, 32)):
        stride = 1 if channels == 16 else 2
        shapes[ConvShape(batch, first_in, size * stride, 3, stride, 1)] += 1
        shapes[ConvShape(batch, channels, size, 3, 1, 1)] += 9
    return shapes


def resnet50_shapes(batch: int = 8, size: int = 64) -> Counter[ConvShape]:
    """torchvision ResNet-50 conv inputs at ``size``² (captured by forward hooks on a real model)."""
    import torchvision

    model = torchvision.models.resnet50(weights=None)
    shapes: Counter[ConvShape] = Counter()

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        assert isinstance(module, torch.nn.Conv2d)
        n, c, h, _w = inputs[0].shape
        k, s, p = module.kernel_size[0], module.stride[0], module.padding[0]
        assert isinstance(p, int)
        shapes[ConvShape(n, c, h, k, s, p, module.bias is not None)] += 1

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.zeros(batch, 3, size, size))
    return shapes


def _median_pair(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Medians of two callables timed alternately (so both see the same machine load)."""
    first(), second()  # warm-up: allocator, thread pool, BLAS packing buffers
    times_a, times_b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        first()
        times_a.append(time.perf_counter() - start)
        start = time.perf_counter()
        second()
        times_b.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def measure(family: str, shapes: Counter[ConvShape], repeats: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, count in shapes.items():
        x = torch.randn(shape.batch, shape.channels, shape.size, shape.size, generator=gen)
        args = shape.args()
        unfold_s, fast_s = _median_pair(
            functools.partial(conv2d_a_factor_unfold, x, *args),
            functools.partial(conv2d_a_factor, x, *args),
            repeats,
        )
        rows.append(
            {
                "family": family,
                "layer": shape.label(),
                "count": count,
                "method": fast_method(x, *args[:4]),
                "unfold_ms": unfold_s * 1e3,
                "fast_ms": fast_s * 1e3,
                "ratio": unfold_s / fast_s,
                "shape": asdict(shape),
            }
        )
    return rows


def _table(rows: list[dict], totals: dict[str, dict]) -> str:
    lines = [
        f"{'network':<9} {'layer':<22} {'n':>3} {'method':<7} {'unfold ms':>10} {'fast ms':>9} {'ratio':>6}",
    ]
    for row in rows:
        lines.append(
            f"{row['family']:<9} {row['layer']:<22} {row['count']:>3} {row['method']:<7} "
            f"{row['unfold_ms']:>10.2f} {row['fast_ms']:>9.2f} {row['ratio']:>6.2f}"
        )
    for family, total in totals.items():
        lines.append(
            f"{family:<9} {'TOTAL (all layers)':<22} {total['layers']:>3} {'':<7} "
            f"{total['unfold_ms']:>10.1f} {total['fast_ms']:>9.1f} {total['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per shape (default 7)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows and totals as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was

    rows = measure("resnet32", resnet32_shapes(), args.repeats)
    rows += measure("resnet50", resnet50_shapes(), args.repeats)
    totals: dict[str, dict] = {}
    for family in ("resnet32", "resnet50"):
        mine = [r for r in rows if r["family"] == family]
        unfold = sum(r["unfold_ms"] * r["count"] for r in mine)
        fast = sum(r["fast_ms"] * r["count"] for r in mine)
        totals[family] = {
            "layers": sum(r["count"] for r in mine),
            "unfold_ms": unfold,
            "fast_ms": fast,
            "ratio": unfold / fast,
        }
    load = os.getloadavg()[0]
    print(
        f"Conv2d A factor, float32, {args.threads} threads, median of {args.repeats} "
        f"(1-min load average before: {load_before:.2f}, after: {load:.2f})"
    )
    print(_table(rows, totals))
    if args.json:
        report = {
            "threads": args.threads,
            "repeats": args.repeats,
            "load_average": [load_before, load],
            "rows": rows,
            "totals": totals,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
