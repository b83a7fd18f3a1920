"""K-FAC overhead: step time of SGD and SGD + K-FAC, side by side in one process, with a stage breakdown.

Run ``python -m benchmarks.overhead`` (or ``make bench``). For each workload and each cadence
(factor interval / decomposition interval), two copies of the model take turns on the same batches: one
plain SGD step, then one K-FAC step, so both arms see the same machine load. A *cycle* is one decomposition
interval; the K-FAC time per step of a cycle includes its one decomposition (amortised), and the table
reports medians over cycles, the ratio K-FAC/SGD, and the per-stage seconds per step. The decomposition
stage is also compared with bare ``torch.linalg.eigh`` calls on the same factors.

The side-by-side pieces (:class:`Setup`: device, autocast, GradScaler, channels_last; :class:`Arm`: one
timed training step in the harness loop's order; :func:`twins`; :func:`eigh_check`) are shared with the GPU
check (``python -m benchmarks.gpu_check``), which runs them on CUDA under AMP.

Wall times on a shared machine are noisy; only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
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
    out["bert"] = bert_workload()
    return out


def bert_workload(
    preset: str = "tiny",
    seq: int = 128,
    batch_size: int = 16,
    name: str = "bert",
    vocab_size: int | None = None,
) -> Workload:
    """``BertForPreTraining`` of ``preset`` (vocabulary ``vocab_size``, default the preset's) on random
    token batches (about one masked token in 7), K-FAC on the encoder's Linear layers only
    (``BERT_KFAC_SKIP_LAYERS``)."""
    from kfac_bench.models.bert import BERT_KFAC_SKIP_LAYERS, BERT_PRESETS, build_bert

    vocab = vocab_size or BERT_PRESETS[preset]["vocab_size"]

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

    return Workload(
        name, lambda: build_bert(preset, vocab_size), batch, loss, tuple(BERT_KFAC_SKIP_LAYERS)
    )


@dataclass(frozen=True)
class Setup:
    """Where and in what precision both arms run: device, autocast dtype, GradScaler, memory format."""

    device: str = "cpu"
    amp_dtype: torch.dtype | None = None  # autocast dtype of forward and backward; None: float32
    grad_scaler: bool = False  # a GradScaler per arm (float16 autocast)
    channels_last: bool = False  # model and 4-D inputs in NHWC

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def sync(self) -> None:
        """Wait for queued device work, so that wall-clock intervals time it (no-op on the CPU)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def to_device(self, batch: Any) -> Any:
        """A batch (tensor, tuple/list or dict of tensors) on the device, 4-D images in the memory format."""
        if isinstance(batch, torch.Tensor):
            fmt = torch.channels_last if self.channels_last and batch.dim() == 4 else None
            return batch.to(self.device, memory_format=fmt or torch.preserve_format)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return type(batch)(self.to_device(v) for v in batch)


@dataclass
class StepTime:
    """Seconds of one training step of one arm, split at the synchronisation points."""

    total: float
    forward_backward: float
    precondition: float  # unscale + ``KFACPreconditioner.step()``; for SGD, unscale only
    update: float
    stages: dict[str, float]  # engine stage seconds added by this step (empty for SGD)


class Arm:
    """One copy of the model with its SGD optimizer and, for the K-FAC arm, its preconditioner.

    ``step`` is the harness loop's order (``kfac_bench/train/loop.py``): autocast forward, scaled backward,
    ``unscale_``, ``precond.step()``, ``optimizer.step()`` (through the scaler), with a device
    synchronisation between phases so each phase's wall time includes its device work.
    """

    def __init__(self, model: nn.Module, setup: Setup, kfac: dict[str, Any] | None) -> None:
        self.setup = setup
        if setup.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(setup.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.scaler = torch.amp.GradScaler(setup.device_type) if setup.grad_scaler else None
        self.precond = (
            KFACPreconditioner(self.model, grad_scaler=self.scaler, track_stage_times=True, **kfac)
            if kfac is not None
            else None
        )

    def step(self, w: Workload, batch: Any) -> StepTime:
        s, p = self.setup, self.precond
        s.sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        amp = (
            torch.autocast(s.device_type, dtype=s.amp_dtype)
            if s.amp_dtype is not None
            else contextlib.nullcontext()
        )
        with amp:
            loss = w.loss(self.model, batch)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        s.sync()
        t1 = time.perf_counter()
        before = p.stage_times() if p is not None else {}
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if p is not None:
            p.step()
        s.sync()
        t2 = time.perf_counter()
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        s.sync()
        t3 = time.perf_counter()
        after = p.stage_times() if p is not None else {}
        stages = {k: after[k] - before[k] for k in after}
        return StepTime(t3 - t0, t1 - t0, t2 - t1, t3 - t2, stages)


def twins(w: Workload, setup: Setup, **kfac: Any) -> tuple[Arm, Arm]:
    """The SGD arm and the SGD + K-FAC arm: the same initial weights, ``kfac`` are engine arguments."""
    torch.manual_seed(0)
    sgd_model, kfac_model = w.build(), w.build()
    kfac_model.load_state_dict(sgd_model.state_dict())
    return Arm(sgd_model, setup, None), Arm(kfac_model, setup, kfac_arguments(w, **kfac))


def kfac_arguments(w: Workload, **kfac: Any) -> dict[str, Any]:
    """The benchmark's engine arguments for ``w`` (damping, lr, its skip list), updated by ``kfac``."""
    return {"damping": 0.003, "lr": 1e-3, "skip_layers": w.skip_layers, **kfac}


def measure(
    w: Workload,
    factor_steps: int,
    inv_steps: int,
    cycles: int,
    warmup_steps: int = 3,
    setup: Setup | None = None,
) -> dict[str, Any]:
    """Interleaved SGD and K-FAC steps: ``warmup_steps`` (first-call costs, the first decomposition),
    then ``cycles`` windows of ``inv_steps`` steps, each holding exactly one decomposition step."""
    setup = setup or Setup()
    sgd, kfac = twins(w, setup, factor_update_steps=factor_steps, inv_update_steps=inv_steps)
    p = kfac.precond
    assert p is not None
    g = torch.Generator().manual_seed(1)
    for _ in range(warmup_steps):
        b = setup.to_device(w.batch(g))
        sgd.step(w, b)
        kfac.step(w, b)
    sgd_cycles, kfac_cycles, stage_cycles = [], [], []
    for _ in range(cycles):
        before = p.stage_times()
        s_tot = k_tot = 0.0
        for _ in range(inv_steps):
            b = setup.to_device(w.batch(g))
            s_tot += sgd.step(w, b).total
            k_tot += kfac.step(w, b).total
        after = p.stage_times()
        sgd_cycles.append(s_tot / inv_steps)
        kfac_cycles.append(k_tot / inv_steps)
        stage_cycles.append({k: (after[k] - before[k]) / inv_steps for k in STAGES})
    sgd_s, kfac_s = statistics.median(sgd_cycles), statistics.median(kfac_cycles)
    stages = {k: statistics.median(s[k] for s in stage_cycles) for k in STAGES}
    return {
        "workload": w.name,
        "factor_update_steps": factor_steps,
        "inv_update_steps": inv_steps,
        "cycles": cycles,
        "sgd_step_s": sgd_s,
        "kfac_step_s": kfac_s,
        "ratio": kfac_s / sgd_s,
        "stages_s_per_step": stages,
        "eigh_check": eigh_check(p, stages["decomposition"] * inv_steps),
        "layers": len(p.layers),
    }


def eigh_check(p: KFACPreconditioner, decomposition_s: float, repeats: int = 3) -> dict[str, float]:
    """The decomposition stage of one decomposition step against bare eigh calls on the same factors
    (one call per factor, as a user would write it, in the engine's ``inv_dtype``; the device is
    synchronised around each repeat)."""
    factors = [
        f.to(p.inv_dtype)
        for s in p.layers.values()
        for f in (s.a_factor, s.g_factor)
        if f is not None
    ]
    cuda = any(f.is_cuda for f in factors)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for f in factors:
            torch.linalg.eigh(f)
        if cuda:
            torch.cuda.synchronize()
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
