"""Cheaper factor statistics, studied: ``factor_batch_fraction`` / ``factor_position_fraction`` vs exact.

Run ``python -m benchmarks.subsample_study`` (both parts; ``--part digits`` or ``--part resnet`` for one).
It prints two tables (the README's "Cheaper factor statistics" section holds one run of them).

**Digits (time to target).** The digits benchmark's setting (:class:`benchmarks.digits_grid.Setting`: the
recipe's data, batch 256, schedule and target 98.5 %), trained by :func:`benchmarks.digits_grid.train_run`
(the harness's own parts; its test checks it against ``kfac-bench train``): SGD at its grid-chosen LR (0.1)
and K-FAC arms at K-FAC's (0.8), for every seed. The arms of one seed run back to back, in an order rotated
from seed to seed, so a change in the machine's load hits every arm alike; each K-FAC arm is compared with
SGD *of the same seed* (paired): its time-to-target ratio, and whether it was faster.

**ResNet-32 (per-step cost and gradient error).** Time to target is not feasible on a CPU (hundreds of
epochs of CIFAR-10), so this part measures what decides it, on CIFAR-shaped synthetic batches (128 x 3 x 32
x 32, random labels) at the recipe's paper cadence (factors every step, decompositions every 10, damping
0.003, decay 0.95): every variant runs the same batches on the same weights (SGD with LR 0, so nothing
moves and every variant sees the same gradients), *in lockstep* (step s of every variant, in an order
rotated each step, before step s+1 of any). The running factors of every K-FAC variant start from the exact
variant's after the first step (a steady state, not the identity start that would hide the noise); after
``--resnet-steps`` steps (a multiple of 10: the last one decomposes) each variant's preconditioned gradient
(KL clip off: the direction, not the step size) is compared with the exact variant's: relative error
``|P g - P_exact g| / |P_exact g|``. Step times exclude the first step; the ratio to SGD is taken per step
(paired) and its median reported.

Wall times on a shared machine are noisy: read ratios of runs that ran next to each other, never absolute
seconds, and only medians over seeds / steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.digits_grid import Arm, RunResult, Setting, train_run
from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.config.schema import KFACConfig
from kfac_bench.data.digits import build_digits

__all__ = [
    "DIGITS_ARMS",
    "RESNET_VARIANTS",
    "digits_study",
    "digits_table",
    "main",
    "resnet_study",
    "resnet_table",
]

SGD_LR, KFAC_LR = 0.1, 0.8  # each arm's best over the grid (benchmarks/digits_grid.py, the recipes)

#: The digits arms: SGD, the recipe's exact K-FAC (factors every 2nd step), exact factors every step (the
#: paper's cadence), and factors every step from part of each batch / of each conv's output rows.
DIGITS_ARMS: tuple[Arm, ...] = (
    Arm(kfac=False),
    Arm(True, 2, 10),
    Arm(True, 1, 10),
    Arm(True, 1, 10, factor_batch_fraction=0.5),
    Arm(True, 1, 10, factor_batch_fraction=0.25),
    Arm(True, 1, 10, factor_batch_fraction=0.125),
    Arm(True, 1, 10, factor_batch_fraction=0.0625),
    Arm(True, 1, 10, factor_position_fraction=0.25),
)


@dataclass(frozen=True)
class Variant:
    """One ResNet-32 variant: SGD (``kfac=False``) or K-FAC with its fractions."""

    label: str
    kfac: bool = True
    factor_batch_fraction: float = 1.0
    factor_position_fraction: float = 1.0


RESNET_VARIANTS: tuple[Variant, ...] = (
    Variant("sgd", kfac=False),
    Variant("kfac exact"),
    Variant("kfac b0.5", factor_batch_fraction=0.5),
    Variant("kfac b0.25", factor_batch_fraction=0.25),
    Variant("kfac p0.5", factor_position_fraction=0.5),
    Variant("kfac p0.25", factor_position_fraction=0.25),
)


# ---------------------------------------------------------------------------------------------- digits
def digits_study(
    arms: Sequence[Arm], seeds: Sequence[int], setting: Setting, log: Any = None
) -> list[RunResult]:
    """Every arm for every seed; the arms of a seed back to back, their order rotated by the seed."""
    splits = build_digits()
    results = []
    for i, seed in enumerate(seeds):
        order = list(arms[i % len(arms) :]) + list(arms[: i % len(arms)])
        for arm in order:
            r = train_run(setting, arm, KFAC_LR if arm.kfac else SGD_LR, seed, splits)
            results.append(r)
            if log is not None:
                ett = "-" if r.epochs_to_target is None else r.epochs_to_target
                ttt = "-" if r.time_to_target_s is None else f"{r.time_to_target_s:.2f}s"
                print(
                    f"{r.arm:<22} seed {seed}: target at epoch {ett} ({ttt}), "
                    f"step {r.mean_step_s * 1e3:.1f} ms, final {r.final_top1:.4f}",
                    file=log,
                    flush=True,
                )
    return results


def _spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{fmt.format(med)} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def digits_table(results: Sequence[RunResult]) -> str:
    """Markdown table: per arm, seeds reaching the target, epochs, time-to-target ratio to SGD (paired)."""
    by = {(r.arm, r.seed): r for r in results}
    arms = list(dict.fromkeys(r.arm for r in results))
    seeds = sorted({r.seed for r in results})
    lines = [
        "| arm | reached | epochs to target | step time / SGD | time to target / SGD (paired) "
        "| faster than SGD | final top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        runs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        epochs = [float(r.epochs_to_target) for r in runs if r.epochs_to_target is not None]
        step, ratio, faster, both = [], [], 0, 0
        for r in runs:
            sgd = by.get(("sgd", r.seed))
            if sgd is None:
                continue
            step.append(r.mean_step_s / sgd.mean_step_s)
            if r.time_to_target_s is not None and sgd.time_to_target_s is not None:
                both += 1
                ratio.append(r.time_to_target_s / sgd.time_to_target_s)
                faster += r.time_to_target_s < sgd.time_to_target_s
        final = [r.final_top1 for r in runs]
        lines.append(
            f"| {arm} | {len(epochs)}/{len(runs)} | {_spread(epochs, '{:.0f}')} | "
            f"{_spread(step)} | {'-' if arm == 'sgd' else _spread(ratio)} | "
            f"{'-' if arm == 'sgd' else f'{faster}/{both}'} | {_spread(final, '{:.3f}')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- resnet
def _resnet_kfac(variant: Variant) -> KFACConfig:
    return KFACConfig(
        factor_update_steps=1,
        inv_update_steps=10,
        damping=0.003,
        factor_decay=0.95,
        kl_clip=None,
        factor_batch_fraction=variant.factor_batch_fraction,
        factor_position_fraction=variant.factor_position_fraction,
    )


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def resnet_study(
    variants: Sequence[Variant], steps: int, batch: int = 128, seed: int = 0, log: Any = None
) -> dict[str, dict[str, Any]]:
    """Per variant: step times (s), paired step-time ratios to SGD and the preconditioned-gradient
    error against exact K-FAC after ``steps`` steps (module docstring)."""
    from kfac_bench.models.cifar_resnet import build_cifar_resnet

    if steps % 10 or steps < 10:
        raise ValueError(f"--resnet-steps {steps}: a multiple of 10 (the last step decomposes)")
    torch.manual_seed(seed)
    base = build_cifar_resnet(32, 10)
    runs = []
    for v in variants:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4)
        precond = None
        if v.kfac:
            precond = build_preconditioner(
                model,
                _resnet_kfac(v),
                steps_per_epoch=390,
                world_size=1,
                accumulation_steps=1,
                lr=0.1,
            )
        runs.append((v, model, opt, precond))
    exact = next((p for v, _, _, p in runs if v.kfac and v.label == "kfac exact"), None)
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    grads: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps + 1):
        x = torch.randn(batch, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        order = runs[step % len(runs) :] + runs[: step % len(runs)]
        if step == 0:  # the exact variant first: the others start from its factors
            order = sorted(runs, key=lambda r: r[0].label != "kfac exact")
        for v, model, opt, precond in order:
            t0 = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            if precond is not None:
                precond.step()
            if step == steps:  # outside the clock
                elapsed = time.perf_counter() - t0
                grads[v.label] = _flat_grad(model)
                t0 = time.perf_counter() - elapsed
            opt.step()
            elapsed = time.perf_counter() - t0
            opt.zero_grad(set_to_none=True)
            if step == 0 and precond is not None and exact is not None and precond is not exact:
                precond.load_state_dict(exact.state_dict(include_decompositions=True))
            if step > 0:
                times[v.label].append(elapsed)
        if log is not None and step > 0:
            line = ", ".join(f"{k} {t[-1]:.2f}s" for k, t in times.items())
            print(f"resnet-32 step {step}/{steps}: {line}", file=log, flush=True)
    out: dict[str, dict[str, Any]] = {}
    ref = grads.get("kfac exact")
    for v in variants:
        t = times[v.label]
        ratios = [a / b for a, b in zip(t, times["sgd"])] if "sgd" in times else []
        err = None
        if ref is not None and v.kfac:
            err = float((grads[v.label] - ref).norm() / ref.norm())
        out[v.label] = {"step_s": t, "ratio_to_sgd": ratios, "grad_error": err}
    return out


def resnet_table(stats: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| variant | step time / SGD (paired, median [min–max]) | preconditioned-gradient error vs exact |",
        "|---|---|---|",
    ]
    for label, s in stats.items():
        err = "-" if s["grad_error"] is None else f"{100 * s['grad_error']:.1f} %"
        lines.append(f"| {label} | {_spread(s['ratio_to_sgd'])} | {err} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- cli
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.subsample_study", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--part", choices=["all", "digits", "resnet"], default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--resnet-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write every run / step measurement here as JSON")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    payload: dict[str, Any] = {"threads": args.threads, "torch": torch.__version__}
    try:
        if args.part in ("all", "digits"):
            results = digits_study(DIGITS_ARMS, args.seeds, Setting(), log=sys.stderr)
            payload["digits"] = [r.row() for r in results]
            print(f"Digits, {len(args.seeds)} seeds (SGD LR {SGD_LR}, K-FAC LR {KFAC_LR}):\n")
            print(digits_table(results))
            print()
        if args.part in ("all", "resnet"):
            stats = resnet_study(RESNET_VARIANTS, args.resnet_steps, log=sys.stderr)
            print(
                f"ResNet-32, synthetic CIFAR-shaped batches of 128, {args.resnet_steps} steps "
                "(factors every step, decompositions every 10):\n"
            )
            print(resnet_table(stats))
            print()
            payload["resnet"] = stats
    finally:
        torch.set_num_threads(threads)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    print(f"{time.perf_counter() - started:.0f} s ({args.threads} thread(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
