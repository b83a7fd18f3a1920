"""``eigen_lowrank`` against exact ``eigh`` on BERT-Large-sized Linear-layer factors: decomposition time and
preconditioned-gradient error.

Run ``python -m benchmarks.lowrank``. For each layer shape (default: BERT-Large's attention projections,
A 1025² and G 1024², and its intermediate layer, A 1025² and G 4096²) it builds A and G with decaying
spectra (power law ``λᵢ = i^-p``, random eigenbases), decomposes them once (the previous decomposition),
moves them by one running-average step (``0.95·F + 0.05·(F + noise)``, a rank-``r`` noise term), then times,
interleaved over rounds, the exact method's decomposition stage (``eigh`` of both factors) against the
low-rank one's (subspace iteration warm-started from the previous basis), and reports the relative error
``‖P̃ − P‖ / ‖P‖`` of the preconditioned gradient of a random ``∇W`` at damping γ. One thread by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kfac_bench.kfac.second_order import EigenLowRankMethod, EigenMethod, RankRule


def decaying_factor(n: int, power: float, seed: int) -> torch.Tensor:
    """A symmetric n×n factor with eigenvalues ``i^-power`` (i = 1..n) in a random orthonormal basis."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    return (q * torch.arange(1, n + 1, dtype=torch.float32) ** -power) @ q.t()


def step_factor(f: torch.Tensor, seed: int, rank: int = 64) -> torch.Tensor:
    """``f`` after one running-average step (decay 0.95) towards ``f`` plus a rank-``rank`` batch term."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(f.shape[0], rank, generator=g) * (float(f.diagonal().mean()) ** 0.5)
    return 0.95 * f + 0.05 * (f + x @ x.t() / rank)


def measure_pair(
    a_dim: int,
    g_dim: int,
    fractions: tuple[float, ...],
    rounds: int,
    power: float,
    damping: float,
) -> dict[str, Any]:
    """Times (s, median over rounds) and errors of one layer's decomposition stage, exact and low rank."""
    old = [decaying_factor(a_dim, power, 1), decaying_factor(g_dim, power, 2)]
    new = [step_factor(old[0], 3), step_factor(old[1], 4)]
    grad = torch.randn(g_dim, a_dim, generator=torch.Generator().manual_seed(5))
    rules = {f: RankRule(fraction=f, min_dim=1) for f in fractions}
    previous = {
        f: EigenLowRankMethod(torch.float32, r).decompose(old, damping) for f, r in rules.items()
    }
    times: dict[str, list[float]] = {"eigh": [], **{f"rank {f:g}n": [] for f in fractions}}
    results: dict[str, Any] = {}
    for _ in range(rounds):
        t0 = time.perf_counter()
        results["eigh"] = EigenMethod(torch.float32).decompose(new, damping)
        times["eigh"].append(time.perf_counter() - t0)
        for f, rule in rules.items():
            t0 = time.perf_counter()
            low = EigenLowRankMethod(torch.float32, rule)
            results[f] = low.decompose(new, damping, previous=previous[f])
            times[f"rank {f:g}n"].append(time.perf_counter() - t0)
    exact = EigenMethod(torch.float32, outer=False).precondition(
        grad, dict(zip("ag", results["eigh"])), damping
    )
    out: dict[str, Any] = {
        "a_dim": a_dim,
        "g_dim": g_dim,
        "eigh_s": statistics.median(times["eigh"]),
    }
    out["lowrank"] = []
    for f in fractions:
        approx = EigenLowRankMethod(torch.float32, outer=False).precondition(
            grad, dict(zip("ag", results[f])), damping
        )
        t = statistics.median(times[f"rank {f:g}n"])
        out["lowrank"].append(
            {
                "fraction": f,
                "decomposition_s": t,
                "speedup": out["eigh_s"] / t,
                "error": float((approx - exact).norm() / exact.norm()),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--layers", nargs="+", default=["1025x1024", "1025x4096"], help="A_DIMxG_DIM per layer"
    )
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.125, 0.25])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--power", type=float, default=2.0, help="eigenvalue decay i^-power")
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'layer (A x G)':<14} {'method':<12} {'decomp s':>9} {'speedup':>8} {'grad error':>11}")
    for spec in args.layers:
        a_dim, g_dim = (int(v) for v in spec.split("x"))
        r = measure_pair(a_dim, g_dim, tuple(args.fractions), args.rounds, args.power, args.damping)
        rows.append(r)
        print(f"{spec:<14} {'eigh':<12} {r['eigh_s']:>9.3f} {'1.0x':>8} {'-':>11}")
        for lr in r["lowrank"]:
            print(
                f"{spec:<14} {'rank ' + format(lr['fraction'], 'g') + 'n':<12} "
                f"{lr['decomposition_s']:>9.3f} {lr['speedup']:>7.1f}x {lr['error']:>11.2e}",
                flush=True,
            )
    if args.json:
        meta = {"torch": torch.__version__, "threads": args.threads, "power": args.power}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta | {"damping": args.damping}, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
