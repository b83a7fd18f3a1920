"""K-FAC overhead: step time of SGD and SGD + K-FAC, side by side in one process, with a stage breakdown.

Run ``python -m benchmarks.overhead`` (or ``make bench``). For each workload and each cadence
(factor interval / decomposition interval), two copies of the model take turns on the same batches: one
plain SGD step, then one K-FAC step, so both arms see the same machine load. A *cycle* is one decomposition
interval; the K-FAC time per step of a cycle includes its one decomposition (amortised), and the table
reports medians over cycles, the ratio K-FAC/SGD, and the per-stage seconds per step. The decomposition
stage is also compared with bare ``torch.linalg.eigh`` calls on the same factors.

Wall times on a shared machine are noisy; only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import STAGES, KFACPreconditioner


@dataclass
class Workload:
    """A model, a batch maker and a loss: what one training step computes."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    skip_layers: tuple[str, ...] = ()


def _classification(
    name: str, build: Callable[[], nn.Module], shape: tuple[int, ...], classes: int
) -> Workload:
    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    return Workload(name, build, batch, loss)


def workloads() -> dict[str, Workload]:
    from kfac_bench.models.cifar_resnet import build_cifar_resnet
    from kfac_bench.models.torchvision_models import build_torchvision_resnet

    out = {
        "resnet32": _classification(
            "resnet32", lambda: build_cifar_resnet(32), (128, 3, 32, 32), 10
        ),
        "resnet50": _classification(
            "resnet50", lambda: build_torchvision_resnet("resnet50"), (8, 3, 64, 64), 1000
        ),
    }
    out["bert"] = _bert_workload()
    return out


def _bert_workload() -> Workload:
    from kfac_bench.models.bert import BERT_KFAC_SKIP_LAYERS, build_bert

    seq, batch_size, vocab = 128, 16, 30522

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, ::7] = ids[:, ::7]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.zeros_like(ids),
            "labels": labels,
            "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=g),
        }

    def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**b).loss  # type: ignore[no-any-return]

    return Workload("bert", lambda: build_bert("tiny"), batch, loss, tuple(BERT_KFAC_SKIP_LAYERS))


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer, w: Workload, b: Any) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    w.loss(model, b).backward()
    opt.step()
    return time.perf_counter() - t0


def _kfac_step(
    model: nn.Module, opt: torch.optim.Optimizer, p: KFACPreconditioner, w: Workload, b: Any
) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    w.loss(model, b).backward()
    p.step()
    opt.step()
    return time.perf_counter() - t0


def measure(
    w: Workload, factor_steps: int, inv_steps: int, cycles: int, warmup_steps: int = 3
) -> dict[str, Any]:
    """Interleaved SGD and K-FAC steps: ``warmup_steps`` (first-call costs, the first decomposition),
    then ``cycles`` windows of ``inv_steps`` steps, each holding exactly one decomposition step."""
    torch.manual_seed(0)
    sgd_model, kfac_model = w.build(), w.build()
    kfac_model.load_state_dict(sgd_model.state_dict())
    sgd_opt = torch.optim.SGD(sgd_model.parameters(), lr=1e-3, momentum=0.9)
    kfac_opt = torch.optim.SGD(kfac_model.parameters(), lr=1e-3, momentum=0.9)
    p = KFACPreconditioner(
        kfac_model,
        factor_update_steps=factor_steps,
        inv_update_steps=inv_steps,
        damping=0.003,
        lr=1e-3,
        skip_layers=w.skip_layers,
        track_stage_times=True,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(warmup_steps):
        b = w.batch(g)
        _sgd_step(sgd_model, sgd_opt, w, b)
        _kfac_step(kfac_model, kfac_opt, p, w, b)
    sgd_cycles, kfac_cycles, stage_cycles = [], [], []
    for _ in range(cycles):
        before = p.stage_times()
        s_tot = k_tot = 0.0
        for _ in range(inv_steps):
            b = w.batch(g)
            s_tot += _sgd_step(sgd_model, sgd_opt, w, b)
            k_tot += _kfac_step(kfac_model, kfac_opt, p, w, b)
        after = p.stage_times()
        sgd_cycles.append(s_tot / inv_steps)
        kfac_cycles.append(k_tot / inv_steps)
        stage_cycles.append({k: (after[k] - before[k]) / inv_steps for k in STAGES})
    sgd, kfac = statistics.median(sgd_cycles), statistics.median(kfac_cycles)
    stages = {k: statistics.median(s[k] for s in stage_cycles) for k in STAGES}
    return {
        "workload": w.name,
        "factor_update_steps": factor_steps,
        "inv_update_steps": inv_steps,
        "cycles": cycles,
        "sgd_step_s": sgd,
        "kfac_step_s": kfac,
        "ratio": kfac / sgd,
        "stages_s_per_step": stages,
        "eigh_check": eigh_check(p, stages["decomposition"] * inv_steps),
        "layers": len(p.layers),
    }


def eigh_check(p: KFACPreconditioner, decomposition_s: float) -> dict[str, float]:
    """The decomposition stage of one decomposition step against bare eigh calls on the same factors."""
    factors = [f for s in p.layers.values() for f in (s.a_factor, s.g_factor) if f is not None]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for f in factors:
            torch.linalg.eigh(f)
        times.append(time.perf_counter() - t0)
    bare = statistics.median(times)  # the stage is one measurement too: compare like with like
    return {"stage_s": decomposition_s, "bare_eigh_s": bare, "ratio": decomposition_s / bare}


def table(rows: list[dict[str, Any]]) -> str:
    short = {
        "factor": "fac",
        "factor_comm": "fac_comm",
        "decomposition": "decomp",
        "decomposition_comm": "dec_comm",
        "precondition": "precond",
        "grad_broadcast": "g_bcast",
        "kl_clip": "kl",
    }
    head = (
        f"{'workload':<9} {'cadence':>8} {'SGD s':>7} {'K-FAC s':>8} {'ratio':>6} "
        + " ".join(f"{short[k]:>8}" for k in STAGES)
        + f" {'decomp/eigh':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cad = f"{r['factor_update_steps']}/{r['inv_update_steps']}"
        st = " ".join(f"{r['stages_s_per_step'][k]:>8.4f}" for k in STAGES)
        lines.append(
            f"{r['workload']:<9} {cad:>8} {r['sgd_step_s']:>7.3f} {r['kfac_step_s']:>8.3f} "
            f"{r['ratio']:>5.2f}x {st} {r['eigh_check']['ratio']:>10.2f}x"
        )
    lines.append("stage columns: seconds per step (decompositions amortised over their interval)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["resnet32", "resnet50", "bert"])
    ap.add_argument(
        "--cadences",
        nargs="+",
        default=["1/10", "10/100"],
        help="factor/decomposition intervals, e.g. 1/10",
    )
    ap.add_argument(
        "--cycles", type=int, default=2, help="measured decomposition intervals per cadence"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    all_workloads = workloads()
    rows = []
    for name in args.workloads:
        for cad in args.cadences:
            f, k = (int(v) for v in cad.split("/"))
            print(f"measuring {name} at {cad} ...", file=sys.stderr, flush=True)
            rows.append(measure(all_workloads[name], f, k, args.cycles))
            print(table(rows[-1:]).splitlines()[2], file=sys.stderr, flush=True)  # progress
    meta = {"torch": torch.__version__, "threads": args.threads, "device": "cpu"}
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
