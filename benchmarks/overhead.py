"""K-FAC overhead by stage against its floor: SGD, K-FAC variants (and the reference), side by side.

Run ``python -m benchmarks.overhead [--quick] [--workloads ...] [--variants ...]`` (or ``make bench
ARGS='...'``). For each workload (the digits demo CNN, CIFAR
ResNet-32 at batch 128, a BERT-like encoder: hidden 256, 4 layers, seq 128, batch 16) at its cadence (factor
interval / decomposition interval; the paper's 1/10 by default), copies of the model take turns on the same
batches: one plain SGD step, then one step of each K-FAC variant (the exact default path, opt-in
approximations such as ``factor_batch_fraction=0.25``) and, with ``--reference PATH``, of the reference
implementation (kfac-pytorch, imported from its source tree at PATH), so every arm sees the same machine load.
A *round* is one decomposition interval; an arm's time per step of a round includes its one decomposition
(amortised). The report gives medians over rounds (at least 3), one thread by default.

The reference is built with the first variant's hyperparameters, mapped onto its constructor
(``benchmarks/kfac_pytorch_reference.py``); what it cannot match is printed under its row. It has no stage
timers, so every arm's step is also split into forward + backward (the reference computes its
factors in the module hooks, there), ``precond.step()`` and the optimizer update.

Each engine stage (``KFACPreconditioner.stage_times``, ms per step) is set against its *floor* on this
machine: the factor stage against the FLOPs of its factor GEMMs (``2·rows·d²`` per factor, rows = examples ×
positions) at the GEMM rate measured here, the decomposition stage against bare ``torch.linalg.eigh`` of the
same factors, the preconditioning stage against its four GEMMs per layer (``4·g·a·(g+a)`` FLOPs) at that
rate. Floors are per step at the workload's cadence; the GEMM rate and the bare ``eigh`` are measured once
per round, between the arms' steps, and their medians used. The conv A factor can beat its im2col floor
(the engine never builds the patches).

The arms and their timed step are ``benchmarks/training_step.py``'s, shared with the GPU check.

Wall times on a shared machine are noisy; only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import ops
from benchmarks.kfac_pytorch_reference import arm_models, reference_factory
from benchmarks.training_step import (
    PHASES,
    Arm,
    Setup,
    Workload,
    bert_encoder_workload,
    classification,
    eigh_check,
    kfac_arguments,
    stage_times,
)
from kfac_bench.kfac import STAGES, KFACPreconditioner

#: The benchmark's workloads (:func:`workload`).
WORKLOADS = ("digits", "resnet32", "bert", "resnet50")


def workload(name: str) -> Workload:
    """The workload ``name``: the digits demo CNN, CIFAR ResNet-32 (batch 128), the BERT-like encoder or
    torchvision ResNet-50 (64², batch 8)."""
    from kfac_bench.models.cifar_resnet import build_cifar_resnet
    from kfac_bench.models.small_cnn import build_small_cnn
    from kfac_bench.models.torchvision_models import build_torchvision_resnet

    if name == "bert":
        return bert_encoder_workload()
    # name: (builder, input shape, classes)
    table: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
        "digits": (build_small_cnn, (32, 1, 8, 8), 10),
        "resnet32": (functools.partial(build_cifar_resnet, 32), (128, 3, 32, 32), 10),
        "resnet50": (functools.partial(build_torchvision_resnet, "resnet50"), (8, 3, 64, 64), 1000),
    }
    build, shape, classes = table[name]
    return classification(name, build, shape, classes)


#: Workloads ``make bench`` measures (``resnet50`` on request: ``--workloads resnet50``).
DEFAULT_WORKLOADS = ("digits", "resnet32", "bert")


#: The K-FAC arms ``make bench`` runs by default: the exact path and the opt-in factor subsampling.
DEFAULT_VARIANTS = ("exact", "factor_batch_fraction=0.25")


def parse_variant(spec: str) -> dict[str, Any]:
    """Engine arguments of a variant spec: ``exact`` (none) or ``key=value[,key=value...]`` (numbers are
    parsed, anything else stays a string), e.g. ``compute_method=inverse,factor_batch_fraction=0.25``."""
    if spec == "exact":
        return {}
    out: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"variant {spec!r}: give 'exact' or key=value[,key=value...]")
        parsed: Any = value
        for cast in (int, float):
            try:
                parsed = cast(value)
                break
            except ValueError:
                continue
        out[key.strip()] = parsed
    return out


def gemm_rate(dim: int = 256, rows: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a float32 factor-shaped GEMM (``xᵀx``, x of ``rows × dim``) here: the best of
    ``repeats``, the rate the floors assume."""
    x = torch.randn(rows, dim)
    x.t() @ x
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.t() @ x
        best = min(best, time.perf_counter() - t0)
    return 2.0 * rows * dim * dim / best


def factor_rows(p: KFACPreconditioner, model: nn.Module, w: Workload, batch: Any) -> dict[str, int]:
    """Rows (examples × positions) of each K-FAC layer's factor GEMMs for ``batch``: one forward
    without gradients (the engine's hooks ignore it), reading each output's size."""
    rows: dict[str, int] = {}
    handles = [
        s.module.register_forward_hook(
            lambda m, a, out, name=name, g=s.g_dim: rows.__setitem__(name, out.numel() // g)
        )
        for name, s in p.layers.items()
    ]
    try:
        with torch.no_grad():
            w.loss(model, batch)
    finally:
        for h in handles:
            h.remove()
    return rows


def floors(
    p: KFACPreconditioner,
    rows: dict[str, int],
    rate: float,
    factor_steps: int,
    inv_steps: int,
    eigh_s: float,
) -> dict[str, float]:
    """Seconds per step each stage could take here at this cadence: the factor GEMMs (``2·rows·d²`` per
    factor) and the preconditioning GEMMs (``4·g·a·(g+a)`` per layer) at ``rate``, bare ``eigh`` of the
    factors (``eigh_s`` per decomposition step)."""
    factor = sum(2.0 * rows.get(n, 0) * (s.a_dim**2 + s.g_dim**2) for n, s in p.layers.items())
    precondition = sum(4.0 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim) for s in p.layers.values())
    return {
        "factor": factor / rate / factor_steps,
        "decomposition": eigh_s / inv_steps,
        "precondition": precondition / rate,
    }


def measure(
    w: Workload,
    factor_steps: int,
    inv_steps: int,
    cycles: int,
    warmup_steps: int = 3,
    setup: Setup | None = None,
    variants: tuple[str, ...] = ("exact",),
    reference: Callable[[nn.Module, dict[str, Any], Any], Any] | None = None,
) -> dict[str, Any]:
    """Interleaved steps of SGD, each K-FAC variant (``parse_variant`` specs; the first is the main one)
    and the reference (``reference(model, engine_arguments, grad_scaler)`` builds its preconditioner from
    the main variant's engine arguments, see :func:`reference_factory`): ``warmup_steps`` (first-call
    costs, the first decomposition), then ``cycles`` rounds of ``inv_steps`` steps, each holding exactly
    one decomposition step. Medians over rounds; each arm's step is also split into its phases
    (forward + backward, ``precond.step()``, optimizer update), so the reference, which has no stage
    timers, shows where its time goes against SGD's phases."""
    setup = setup or Setup()
    cadence = {"factor_update_steps": factor_steps, "inv_update_steps": inv_steps}
    base, copy, in_place_off = arm_models(w, reference is not None)
    arms: dict[str, Arm] = {"sgd": Arm(base, setup, None)}
    for spec in variants:
        arms[spec] = Arm(copy(), setup, kfac_arguments(w, **cadence, **parse_variant(spec)))
    if reference is not None:
        args = kfac_arguments(w, **cadence, **parse_variant(variants[0]))
        arms["reference"] = Arm(copy(), setup, None, factory=lambda m, s: reference(m, args, s))
    g = torch.Generator().manual_seed(1)
    for _ in range(warmup_steps):
        b = setup.to_device(w.batch(g))
        for arm in arms.values():
            arm.step(w, b)
    per_cycle: dict[str, list[float]] = {k: [] for k in arms}
    phase_cycles: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
    stage_cycles: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    rates: list[float] = []
    eighs: list[float] = []
    for _ in range(cycles):
        before = {k: stage_times(arms[k].precond) for k in variants}
        totals = dict.fromkeys(arms, 0.0)
        phases = {k: dict.fromkeys(PHASES, 0.0) for k in arms}
        for _ in range(inv_steps):
            b = setup.to_device(w.batch(g))
            for k, arm in arms.items():
                t = arm.step(w, b)
                totals[k] += t.total
                for ph in PHASES:
                    phases[k][ph] += getattr(t, ph)
        for k in arms:
            per_cycle[k].append(totals[k] / inv_steps)
            phase_cycles[k].append({ph: v / inv_steps for ph, v in phases[k].items()})
        for k in variants:
            after = stage_times(arms[k].precond)
            stage_cycles[k].append({s: (after[s] - before[k][s]) / inv_steps for s in STAGES})
        # The floors' measurements take turns with the arms too (the machine's load changes).
        rates.append(gemm_rate(repeats=3))
        eighs.append(eigh_check(arms[variants[0]].precond, 0.0, repeats=1)["bare_eigh_s"])
    step_s = {k: statistics.median(v) for k, v in per_cycle.items()}
    sgd_s = step_s["sgd"]
    out_variants: dict[str, dict[str, Any]] = {
        k: {
            "step_s": step_s[k],
            "ratio": step_s[k] / sgd_s,
            "stages_s_per_step": {
                s: statistics.median(c[s] for c in stage_cycles[k]) for s in STAGES
            },
        }
        for k in variants
    }
    main = variants[0]
    p = arms[main].precond
    assert isinstance(p, KFACPreconditioner)
    stages = out_variants[main]["stages_s_per_step"]
    bare = statistics.median(eighs)
    check = {
        "stage_s": stages["decomposition"] * inv_steps,
        "bare_eigh_s": bare,
        "ratio": stages["decomposition"] * inv_steps / bare,
    }
    rows = factor_rows(p, arms[main].model, w, setup.to_device(w.batch(g)))
    rate = statistics.median(rates)
    phases_s = {
        k: {ph: statistics.median(c[ph] for c in v) for ph in PHASES}
        for k, v in phase_cycles.items()
    }
    ref = None
    if reference is not None:
        r_arm = arms["reference"]
        describe = getattr(reference, "arguments", None)
        given, unmatched = describe(r_arm.model, args, r_arm.scaler) if describe else ({}, {})
        ref = {
            "in_place_off": in_place_off,
            "step_s": step_s["reference"],
            "ratio": step_s["reference"] / sgd_s,
            "ours_over_reference": step_s[main] / step_s["reference"],
            # the layers kfac-pytorch registered (its current API keeps them in ``_layers``)
            "layers": len(getattr(r_arm.precond, "_layers", ())),
            "arguments": {k: repr(v) for k, v in given.items()},
            "unmatched": unmatched,
        }
    return {
        "workload": w.name,
        "factor_update_steps": factor_steps,
        "inv_update_steps": inv_steps,
        "cycles": cycles,
        "sgd_step_s": sgd_s,
        "kfac_step_s": step_s[main],
        "ratio": step_s[main] / sgd_s,
        "stages_s_per_step": stages,
        "variants": out_variants,
        "floors_s_per_step": floors(p, rows, rate, factor_steps, inv_steps, check["bare_eigh_s"]),
        "gemm_flops_per_s": rate,
        "eigh_check": check,
        "reference": ref,
        "phases_s_per_step": phases_s,
        "layers": len(p.layers),
    }


_SHORT = {
    "factor": "factor",
    "factor_comm": "factor comm",
    "decomposition": "decomposition",
    "decomposition_comm": "decomp. comm",
    "precondition": "precondition",
    "grad_broadcast": "grad broadcast",
    "kl_clip": "KL clip",
}


def _label(spec: str) -> str:
    """A variant's column label: its spec with the long engine names shortened."""
    return spec.replace("factor_batch_fraction", "fbf").replace("compute_method=", "")


#: What the table's floors are, printed under it.
LEGEND = (
    "floors: factor GEMM FLOPs and preconditioning GEMM FLOPs at the GEMM rate, bare eigh of the same "
    "factors; decompositions amortised over their interval; 'x floor' is the first variant's"
)


def table(rows: list[dict[str, Any]], legend: bool = True) -> str:
    """One block per workload: each stage's ms per step against its floor, per variant; the step times
    and ratios to SGD; the reference's when measured; then :data:`LEGEND` unless ``legend`` is false."""
    blocks = []
    for r in rows:
        names = list(r.get("variants") or {"exact": r})
        variants = r.get("variants") or {
            "exact": {
                "step_s": r["kfac_step_s"],
                "ratio": r["ratio"],
                "stages_s_per_step": r["stages_s_per_step"],
            }
        }
        fl = r.get("floors_s_per_step", {})
        width = max(10, *(len(_label(n)) for n in names))
        cad = f"{r['factor_update_steps']}/{r['inv_update_steps']}"
        rate = r.get("gemm_flops_per_s")
        lines = [
            f"{r['workload']}: cadence {cad} (factors/decompositions), {r['layers']} K-FAC layers, "
            f"medians of {r['cycles']} rounds"
            + (f", GEMM rate {rate / 1e9:.1f} GFLOP/s" if rate else "")
        ]
        head = f"  {'ms per step':<16} {'floor':>8} " + " ".join(
            f"{_label(n):>{width}}" for n in names
        )
        head += f" {'x floor':>8}"
        lines += [head, "  " + "-" * (len(head) - 2)]
        for s in STAGES:
            vals = [variants[n]["stages_s_per_step"][s] * 1e3 for n in names]
            if max(vals) < 0.05 and s not in fl:  # e.g. communication in one process
                continue
            floor = fl.get(s)
            cells = " ".join(f"{v:>{width}.1f}" for v in vals)
            over = f"{vals[0] / (floor * 1e3):>7.1f}x" if floor else f"{'':>8}"
            lines.append(
                f"  {_SHORT[s]:<16} {(f'{floor * 1e3:.1f}' if floor else '-'):>8} {cells} {over}"
            )
        lines.append("  " + "-" * (len(head) - 2))
        lines.append(
            f"  {'step':<16} {'':>8} "
            + " ".join(f"{variants[n]['step_s'] * 1e3:>{width}.1f}" for n in names)
            + f"   (SGD {r['sgd_step_s'] * 1e3:.1f})"
        )
        lines.append(
            f"  {'K-FAC/SGD':<16} {'':>8} "
            + " ".join(f"{variants[n]['ratio']:>{width - 1}.2f}x" for n in names)
        )
        ref = r.get("reference")
        if ref:
            lines.append(
                f"  reference (kfac-pytorch): {ref['step_s'] * 1e3:.1f} ms, {ref['ratio']:.2f}x SGD; "
                f"{names[0]}/reference {ref['ours_over_reference']:.2f}"
                + (f"; {ref['layers']} layers" if ref.get("layers") else "")
            )
            ph = r.get("phases_s_per_step", {})
            if {"sgd", "reference", names[0]} <= set(ph):
                lines.append(
                    "  ms per step       fwd+bwd  step()  update   (the reference computes its factors "
                    "in hooks: in fwd+bwd)"
                )
                for arm, label in (
                    ("sgd", "SGD"),
                    (names[0], _label(names[0])),
                    ("reference", "ref."),
                ):
                    lines.append(
                        f"    {label:<14} " + " ".join(f"{ph[arm][k] * 1e3:>7.1f}" for k in PHASES)
                    )
            if ref.get("in_place_off"):
                lines.append(
                    f"  every arm ran with {ref['in_place_off']} in-place activations off (kfac-pytorch's "
                    "full backward hooks forbid them)"
                )
            for name, why in (ref.get("unmatched") or {}).items():
                lines.append(f"  not matched in the reference arm: {name} ({why})")
        blocks.append("\n".join(lines))
    if legend:
        blocks.append(LEGEND)
    return "\n\n".join(blocks)


def _variant(spec: str) -> str:
    try:
        parse_variant(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def _cadence(spec: str) -> str:
    f, sep, k = spec.partition("/")
    if not (sep and f.isdigit() and k.isdigit() and int(f) >= 1 and int(k) % int(f) == 0):
        raise argparse.ArgumentTypeError(f"cadence {spec!r}: give F/K, F dividing K (e.g. 1/10)")
    return spec


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``python -m benchmarks.overhead``, ``make bench ARGS='...'``)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(DEFAULT_WORKLOADS))
    cadence = "factor/decomposition intervals (default: the paper's 1/10)"
    ap.add_argument("--cadence", type=_cadence, default="1/10", help=cadence)
    variants = (
        "K-FAC arms: 'exact' or key=value[,key=value] engine arguments; the first is the main one"
    )
    ap.add_argument(
        "--variants", nargs="+", type=_variant, default=list(DEFAULT_VARIANTS), help=variants
    )
    ap.add_argument("--rounds", type=int, default=3, help="measured decomposition intervals")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--reference", metavar="PATH", help="kfac-pytorch source root: also time its step"
    )
    quick = "digits only, cadence 1/2, one warm-up step (a smoke run)"
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument(
        "--ops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also count compute ops per step by stage (benchmarks/ops.py; --quick: 2 steps)",
    )
    ap.add_argument(
        "--op-rules",
        default="cuda",
        help="count the ops with this device type's kernel choices (default cuda: what a GPU launches)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.workloads, args.cadence = ["digits"], "1/2"
    torch.set_num_threads(args.threads)
    reference = reference_factory(args.reference) if args.reference else None
    f, k = (int(v) for v in args.cadence.split("/"))
    rows = []
    for name in args.workloads:
        print(f"measuring {name} at {f}/{k} ...", file=sys.stderr, flush=True)
        warmup = 1 if args.quick else 3
        variants = tuple(args.variants)
        rows.append(
            measure(
                workload(name), f, k, args.rounds, warmup, variants=variants, reference=reference
            )
        )
        # Each workload's block once, as it is measured; the legend once, under the last.
        print(table(rows[-1:], legend=False) + "\n", flush=True)
    print(LEGEND)
    op_rows = []
    if args.ops:
        print()
        for name in args.workloads:
            print(f"counting ops of {name} at {f}/{k} ...", file=sys.stderr, flush=True)
            steps = 2 if args.quick else k
            op_rows.append(
                ops.measure(
                    workload(name),
                    factor_steps=f,
                    inv_steps=k,
                    steps=steps,
                    warmup=1 if args.quick else 3,
                    reference=reference,
                    variant=parse_variant(args.variants[0]),
                    rules=args.op_rules,
                )
            )
            print(ops.table(op_rows[-1]) + "\n", flush=True)
        print(ops.LEGEND)
    meta = {"torch": torch.__version__, "threads": args.threads, "device": "cpu"}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": rows, "ops": op_rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
