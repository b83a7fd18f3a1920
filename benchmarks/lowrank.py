"""``eigen_lowrank`` against exact ``eigh`` on BERT-Large-sized Linear-layer factors: decomposition time and
preconditioned-gradient error, side by side with the exact rank-k truncation's error.

Run ``python -m benchmarks.lowrank``. Two parts, one thread by default:

* **time** (``--layers``; default BERT-Large's attention projections, A 1025² and G 1024², and its
  intermediate layer, A 1025² and G 4096²): A and G with decaying spectra (power law ``λᵢ = i^-p``, random
  eigenbases) are decomposed once (the previous decomposition), moved by one running-average step
  (``0.95·F + 0.05·(F + noise)``, a rank-``r`` noise term), then the exact method's decomposition stage
  (``eigh`` of both factors) and the low-rank one's (warm-started from the previous basis) are timed,
  interleaved over rounds. Reported: the speed-up, the relative error ``‖P̃ − P‖ / ‖P‖`` of the
  preconditioned gradient of a random ``∇W`` at damping γ, the same error of the exact rank-k truncation
  (top-k pairs of ``eigh`` plus the mean of the rest) and their ratio.
* **accumulated** (``--accumulate-dim``, ``--spectra``): factors as the engine accumulates them — the
  running average (``factor_decay`` 0.95, from the identity, :func:`kfac_bench.kfac.factors.running_average`)
  of batch covariances of 256 samples from a power-law covariance per step (``--spectra``: the powers; 2 is
  decaying, 0.5 flat) — decomposed every 10 steps with the warm start, as ``inv_update_steps=10`` does; the
  ratio of the low-rank error to the exact truncation's at each decomposition (the first is exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kfac_bench.kfac.factors import running_average
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


def truncation(exact: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """The exact rank-k truncation of an ``eigh`` result: top-k pairs (descending) and the mean of the
    rest, the model ``eigen_lowrank`` approximates."""
    w, q = exact["eigenvalues"], exact["q"]
    n = w.shape[0]
    return {
        "q": q[:, n - k :].flip(1),
        "eigenvalues": w[n - k :].flip(0),
        "rest": w[: n - k].mean()[None],
    }


def _error(p: torch.Tensor, ref: torch.Tensor) -> float:
    return float((p - ref).norm() / ref.norm())


def accumulated(
    n: int, power: float, decompositions: int, fraction: float, damping: float
) -> list[float]:
    """Low-rank error over exact-truncation error at each decomposition of an accumulated factor."""
    g = torch.Generator().manual_seed(11)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    root = q * torch.arange(1, n + 1, dtype=torch.float64) ** (-power / 2)
    grad = torch.randn(n, n, generator=g)
    rule = RankRule(fraction=fraction, min_dim=1)
    k = rule.rank(n)
    low = EigenLowRankMethod(torch.float32, rule, outer=False)
    exact_method = EigenMethod(torch.float32, outer=False)
    running, previous, ratios = None, None, []
    for step in range(10 * (decompositions - 1) + 1):
        x = torch.randn(256, n, generator=g, dtype=torch.float64) @ root.t()
        running, _ = running_average(running, (x.t() @ x / 256).float(), 0.95)
        if step % 10:
            continue
        previous = low.decompose([running], damping, previous=[previous])[0]
        exact = exact_method.decompose([running], damping)[0]
        assert exact is not None and previous is not None
        ref = exact_method.precondition(grad, {"a": exact, "g": exact}, damping)
        cut = truncation(exact, k)
        e_cut = _error(low.precondition(grad, {"a": cut, "g": cut}, damping), ref)
        e_low = _error(low.precondition(grad, {"a": previous, "g": previous}, damping), ref)
        ratios.append(e_low / e_cut)
    return ratios


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
    results: dict[str | float, Any] = {}  # "eigh", then each rank fraction
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
        low = EigenLowRankMethod(torch.float32, outer=False)
        approx = low.precondition(grad, dict(zip("ag", results[f])), damping)
        cut = [truncation(r, rules[f].rank(r["q"].shape[0])) for r in results["eigh"]]
        t = statistics.median(times[f"rank {f:g}n"])
        error = _error(approx, exact)
        cut_error = _error(low.precondition(grad, dict(zip("ag", cut)), damping), exact)
        out["lowrank"].append(
            {
                "fraction": f,
                "decomposition_s": t,
                "speedup": out["eigh_s"] / t,
                "error": error,
                "truncation_error": cut_error,
                "ratio": error / cut_error,
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
    ap.add_argument("--accumulate-dim", type=int, default=1024, help="0: skip the accumulated part")
    ap.add_argument("--spectra", nargs="+", type=float, default=[2.0, 0.5])
    ap.add_argument("--decompositions", type=int, default=10)
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    head = f"{'layer (A x G)':<14} {'method':<12} {'decomp s':>9} {'speedup':>8} {'grad error':>11}"
    print(head + f" {'truncation':>11} {'ratio':>6}")
    for spec in args.layers:
        a_dim, g_dim = (int(v) for v in spec.split("x"))
        r = measure_pair(a_dim, g_dim, tuple(args.fractions), args.rounds, args.power, args.damping)
        rows.append(r)
        print(f"{spec:<14} {'eigh':<12} {r['eigh_s']:>9.3f} {'1.0x':>8} {'-':>11}")
        for lr in r["lowrank"]:
            print(
                f"{spec:<14} {'rank ' + format(lr['fraction'], 'g') + 'n':<12} "
                f"{lr['decomposition_s']:>9.3f} {lr['speedup']:>7.1f}x {lr['error']:>11.2e} "
                f"{lr['truncation_error']:>11.2e} {lr['ratio']:>5.2f}x",
                flush=True,
            )
    acc = {}
    for power in args.spectra if args.accumulate_dim else []:
        ratios = accumulated(args.accumulate_dim, power, args.decompositions, 0.25, args.damping)
        acc[power] = ratios
        print(
            f"accumulated {args.accumulate_dim}², λ ∝ i^-{power:g}, rank n/4: error / exact truncation's "
            f"at each decomposition: {' '.join(f'{r:.2f}' for r in ratios)} (max after the first "
            f"{max(ratios[1:], default=1.0):.2f})",
            flush=True,
        )
    if args.json:
        meta = {"torch": torch.__version__, "threads": args.threads, "power": args.power}
        with open(args.json, "w") as fh:
            json.dump(
                {"meta": meta | {"damping": args.damping}, "results": rows, "accumulated": acc},
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
