"""K-FAC overhead by stage against its floor: SGD, K-FAC variants (and the reference), side by side.

Run ``python -m benchmarks.overhead`` (or ``make bench``). For each workload (the digits demo CNN, CIFAR
ResNet-32 at batch 128, a BERT-like encoder: hidden 256, 4 layers, seq 128, batch 16) at its cadence (factor
interval / decomposition interval; the paper's 1/10 by default), copies of the model take turns on the same
batches: one plain SGD step, then one step of each K-FAC variant (the exact default path, opt-in
approximations such as ``factor_batch_fraction=0.25``) and, with ``--reference PATH``, of the reference
implementation (kfac-pytorch, imported from its source tree at PATH), so every arm sees the same machine load.
A *round* is one decomposition interval; an arm's time per step of a round includes its one decomposition
(amortised). The report gives medians over rounds (at least 3), one thread by default.

The reference is built with the first variant's hyperparameters, mapped onto its constructor
(:meth:`Reference.arguments` documents the mapping); what it cannot match is printed under its row. It has
no stage timers, so every arm's step is also split into forward + backward (the reference computes its
factors in the module hooks, there), ``precond.step()`` and the optimizer update.

Each engine stage (``KFACPreconditioner.stage_times``, ms per step) is set against its *floor* on this
machine: the factor stage against the FLOPs of its factor GEMMs (``2·rows·d²`` per factor, rows = examples ×
positions) at the GEMM rate measured here, the decomposition stage against bare ``torch.linalg.eigh`` of the
same factors, the preconditioning stage against its four GEMMs per layer (``4·g·a·(g+a)`` FLOPs) at that
rate. Floors are per step at the workload's cadence; the GEMM rate and the bare ``eigh`` are measured once
per round, between the arms' steps, and their medians used. The conv A factor can beat its im2col floor
(the engine never builds the patches).

The side-by-side pieces (:class:`Setup`: device, autocast, GradScaler, channels_last; :class:`Arm`: one
timed training step in the harness loop's order; :func:`twins`; :func:`eigh_check`) are shared with the GPU
check (``python -m benchmarks.gpu``), which runs them on CUDA under AMP.

Wall times on a shared machine are noisy; only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib
import importlib.metadata
import inspect
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

from kfac_bench.kfac import STAGES, KFACPreconditioner, parse_grad_worker_fraction
from kfac_bench.kfac.preconditioner import resolve_dtypes


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
    from kfac_bench.models.small_cnn import build_small_cnn
    from kfac_bench.models.torchvision_models import build_torchvision_resnet

    return {
        "digits": _classification("digits", build_small_cnn, (32, 1, 8, 8), 10),
        "resnet32": _classification(
            "resnet32", lambda: build_cifar_resnet(32), (128, 3, 32, 32), 10
        ),
        "bert": bert_encoder_workload(),
        "resnet50": _classification(
            "resnet50", lambda: build_torchvision_resnet("resnet50"), (8, 3, 64, 64), 1000
        ),
    }


#: Workloads ``make bench`` measures (``resnet50`` on request: ``--workloads resnet50``).
DEFAULT_WORKLOADS = ("digits", "resnet32", "bert")


def bert_encoder_workload(
    hidden: int = 256,
    layers: int = 4,
    seq: int = 128,
    batch_size: int = 16,
    vocab_size: int = 30522,
) -> Workload:
    """A BERT-like encoder: ``BertForPreTraining`` with ``hidden`` units, ``layers`` layers (heads of 64,
    intermediate 4·hidden), on random token batches; K-FAC on the encoder's Linear layers only."""
    from transformers import BertConfig, BertForPreTraining

    from kfac_bench.models.bert import BERT_KFAC_SKIP_LAYERS

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
    )
    return Workload(
        "bert",
        lambda: BertForPreTraining(config),
        _token_batches(vocab_size, seq, batch_size),
        _pretraining_loss,
        tuple(BERT_KFAC_SKIP_LAYERS),
    )


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
    return Workload(
        name,
        lambda: build_bert(preset, vocab_size),
        _token_batches(vocab, seq, batch_size),
        _pretraining_loss,
        tuple(BERT_KFAC_SKIP_LAYERS),
    )


def _token_batches(vocab: int, seq: int, batch_size: int) -> Callable[[torch.Generator], Any]:
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

    return batch


def _pretraining_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**b).loss  # type: ignore[no-any-return]


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

    def __init__(
        self,
        model: nn.Module,
        setup: Setup,
        kfac: dict[str, Any] | None,
        factory: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        self.setup = setup
        if setup.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(setup.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.scaler = torch.amp.GradScaler(setup.device_type) if setup.grad_scaler else None
        # Another preconditioner (the reference) from ``factory(model, grad_scaler)``: anything with a
        # ``step()``.
        self.precond: Any = (
            factory(self.model, self.scaler)
            if factory is not None
            else KFACPreconditioner(
                self.model, grad_scaler=self.scaler, track_stage_times=True, **kfac
            )
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
        before = _stage_times(p)
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
        after = _stage_times(p)
        stages = {k: after[k] - before[k] for k in after}
        return StepTime(t3 - t0, t1 - t0, t2 - t1, t3 - t2, stages)


#: The phases of one training step, as :class:`StepTime` splits it.
PHASES = ("forward_backward", "precondition", "update")


def _stage_times(p: Any) -> dict[str, float]:
    return p.stage_times() if isinstance(p, KFACPreconditioner) else {}


def twins(w: Workload, setup: Setup, **kfac: Any) -> tuple[Arm, Arm]:
    """The SGD arm and the SGD + K-FAC arm: the same initial weights, ``kfac`` are engine arguments."""
    torch.manual_seed(0)
    sgd_model, kfac_model = w.build(), w.build()
    kfac_model.load_state_dict(sgd_model.state_dict())
    return Arm(sgd_model, setup, None), Arm(kfac_model, setup, kfac_arguments(w, **kfac))


def kfac_arguments(w: Workload, **kfac: Any) -> dict[str, Any]:
    """The benchmark's engine arguments for ``w`` (damping, lr, its skip list), updated by ``kfac``."""
    return {"damping": 0.003, "lr": 1e-3, "skip_layers": w.skip_layers, **kfac}


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
    torch.manual_seed(0)
    base = w.build()
    state = base.state_dict()
    # kfac-pytorch's full backward hooks forbid in-place ops on a hooked module's output: with the
    # reference, every arm runs the model with in-place activations off (the same model for all).
    in_place_off = _out_of_place(base) if reference is not None else 0

    def copy() -> nn.Module:
        m = w.build()
        m.load_state_dict(state)
        if in_place_off:
            _out_of_place(m)
        return m

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
        before = {k: _stage_times(arms[k].precond) for k in variants}
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
            after = _stage_times(arms[k].precond)
            stage_cycles[k].append({s: (after[s] - before[k][s]) / inv_steps for s in STAGES})
        # The floors' measurements take turns with the arms too (the machine's load changes).
        rates.append(gemm_rate(repeats=3))
        eighs.append(eigh_check(arms[variants[0]].precond, 0.0, repeats=1)["bare_eigh_s"])
    step_s = {k: statistics.median(v) for k, v in per_cycle.items()}
    sgd_s = step_s["sgd"]
    out_variants = {
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


#: Our engine's arguments that kfac-pytorch's ``KFACPreconditioner`` takes under the same name, meaning and
#: values (enum options as their lower-case names, which it accepts as strings).
_REFERENCE_SAME = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
    "accumulation_steps",
    "compute_eigenvalue_outer_product",
    "colocate_factors",
    "assignment_strategy",
    "symmetry_aware",
    "allreduce_bucket_cap_mb",
)
#: Our engine's arguments kfac-pytorch has no counterpart for, with the value that is its fixed behaviour:
#: an arm with another value is reported as not matched.
_REFERENCE_FIXED: dict[str, Any] = {
    "factor_scaling": "kaisa",  # its get_cov: mean over all rows, conv A and G divided by positions
    "placement": "lpt",
    "factor_reduction": "allreduce",
    "factor_batch_fraction": 1.0,
    "factor_position_fraction": 1.0,
    "comm_dtype": None,
    "process_group": None,
}
#: Our engine's arguments that change nothing the reference arm could mirror here: instrumentation, a
#: construction-time warning, the batch dimension only ``factor_scaling='per_example'`` reads, the
#: low-rank method's knobs (an ``eigen_lowrank`` arm is reported through ``compute_method``).
_REFERENCE_IRRELEVANT = (
    "track_stage_times",
    "coverage_threshold",
    "batch_dim",
    "lowrank_fraction",
    "lowrank_min_dim",
    "grad_scaler",
)
#: The SC20-era ``kfac.KFAC``'s fixed behaviour: its factors split the Kronecker product of ours
#: (``'per_example'``) differently, which the eigen method does not see; it places layers round-robin.
_LEGACY_FIXED = {**_REFERENCE_FIXED, "factor_scaling": "per_example", "placement": "round_robin"}
_STRATEGY_FRACTIONS = {"comm_opt": 1.0, "hybrid_opt": 0.5, "mem_opt": 0.0}  # its 0: 1/world size


def _plain(value: Any) -> Any:
    """An option enum as its plain string value (kfac-pytorch parses strings, not our enums)."""
    return str(value.value) if isinstance(value, enum.Enum) else value


def engine_defaults() -> dict[str, Any]:
    """Our ``KFACPreconditioner``'s keyword arguments and their defaults."""
    params = inspect.signature(KFACPreconditioner).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@dataclass
class Reference:
    """kfac-pytorch imported from its source tree: builds its preconditioner for one of our arms.

    ``reference(model, engine_arguments, grad_scaler)`` builds it with our engine's arguments mapped onto
    its own (:meth:`arguments`). The current API is ``kfac.preconditioner.KFACPreconditioner`` (KAISA,
    kfac-pytorch 0.4+); the SC20-era ``kfac.KFAC`` (``legacy``) takes the cadence, damping, decay, KL clip
    and lr only.
    """

    path: str
    cls: Any
    legacy: bool = False

    def arguments(
        self, model: nn.Module, a: dict[str, Any], grad_scaler: Any = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """kfac-pytorch's constructor arguments for our engine arguments ``a`` (our defaults filling the
        rest), and what could not be matched (``{name: 'ours X, reference Y'}``).

        The mapping (current API), besides the names both take alike (:data:`_REFERENCE_SAME`):
        ``compute_method`` ``'eigen'``/``'inverse'`` as is (``'eigen_lowrank'`` has no counterpart: the
        reference runs ``'eigen'``); ``grad_worker_fraction`` as the number it stands for (``comm_opt`` 1,
        ``hybrid_opt`` 0.5, ``mem_opt`` 0 = 1/world, as kfac-pytorch reads 0); ``factor_dtype`` and
        ``inv_dtype`` as ours resolves them for ``model`` (:func:`resolve_dtypes`: float32 for a float32 or
        low-precision model), so both store factors and decompositions alike (the reference always runs
        ``eigh``/``inv`` in float32 and casts to ``inv_dtype``; ours decomposes in ``inv_dtype``);
        ``skip_layers`` as a list (both ``re.search`` the qualified name and the class name);
        ``grad_scaler`` as its ``get_scale`` (kfac-pytorch recognises only ``torch.cuda.amp.GradScaler``,
        and takes any callable returning the scale). Its own ``update_factors_in_hook=True`` (factors
        computed in the module hooks, during forward and backward) and ``loglevel`` keep their defaults.
        Our arguments it has no counterpart for must hold its fixed behaviour (:data:`_REFERENCE_FIXED`),
        else they are reported: ``factor_scaling`` always is (ours defaults to ``'per_example'``, the
        reference's ``get_cov`` is our ``'kaisa'``; a scalar per factor, the same FLOPs).
        """
        ours = {**engine_defaults(), **a}
        unmatched: dict[str, str] = {}
        for name, fixed in (_LEGACY_FIXED if self.legacy else _REFERENCE_FIXED).items():
            if ours.get(name) != fixed:
                unmatched[name] = f"ours {_plain(ours.get(name))!r}, reference {fixed!r}"
        unknown = sorted(
            set(a)
            - set(_REFERENCE_SAME)
            - set(_REFERENCE_FIXED)
            - set(_REFERENCE_IRRELEVANT)
            - {"compute_method", "grad_worker_fraction", "factor_dtype", "inv_dtype", "skip_layers"}
        )
        for name in unknown:
            unmatched[name] = f"ours {_plain(a[name])!r}, reference has no such argument"
        if self.legacy:
            taken = {
                "factor_update_steps",
                "inv_update_steps",
                "damping",
                "lr",
                "factor_decay",
                "kl_clip",
            }
            defaults = engine_defaults()
            for name in sorted(set(a) - taken - set(_LEGACY_FIXED) - set(_REFERENCE_IRRELEVANT)):
                if a[name] != defaults.get(name):
                    unmatched.setdefault(
                        name, f"ours {_plain(a[name])!r}, kfac.KFAC takes no {name}"
                    )
            return {
                "lr": ours["lr"],
                "factor_decay": ours["factor_decay"],
                "damping": ours["damping"],
                "kl_clip": ours["kl_clip"],
                "fac_update_freq": ours["factor_update_steps"],
                "kfac_update_freq": ours["inv_update_steps"],
            }, unmatched
        kwargs = {name: _plain(ours[name]) for name in _REFERENCE_SAME}
        method = _plain(ours["compute_method"])
        if method not in ("eigen", "inverse"):
            unmatched["compute_method"] = f"ours {method!r}, reference 'eigen'"
            method = "eigen"
        kwargs["compute_method"] = method
        fraction = parse_grad_worker_fraction(ours["grad_worker_fraction"])
        kwargs["grad_worker_fraction"] = (
            fraction if isinstance(fraction, float) else _STRATEGY_FRACTIONS[_plain(fraction)]
        )
        kwargs["factor_dtype"], kwargs["inv_dtype"] = resolve_dtypes(
            model, ours["factor_dtype"], ours["inv_dtype"]
        )
        kwargs["skip_layers"] = list(ours["skip_layers"])
        if grad_scaler is not None:
            kwargs["grad_scaler"] = grad_scaler.get_scale
        return kwargs, unmatched

    def __call__(self, model: nn.Module, a: dict[str, Any], grad_scaler: Any = None) -> Any:
        kwargs, _ = self.arguments(model, a, grad_scaler)
        return self.cls(model, **kwargs)


def _out_of_place(model: nn.Module) -> int:
    """Turn off ``inplace`` in ``model``'s modules (``nn.ReLU(inplace=True)`` and the like); how many."""
    changed = 0
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False  # type: ignore[assignment]
            changed += 1
    return changed


def reference_factory(path: str) -> Reference:
    """kfac-pytorch imported from its source tree at ``path`` (the directory holding its ``kfac``
    package): the current API (``kfac.preconditioner.KFACPreconditioner``) or the SC20-era one
    (``kfac.KFAC``). A ``kfac`` imported before (an installed kfac-pytorch) is set aside for it.

    Raises:
        SystemExit: one line, when no ``kfac`` package with either class is importable from ``path``.
    """
    for name in [m for m in sys.modules if m == "kfac" or m.startswith("kfac.")]:
        del sys.modules[name]
    sys.path.insert(0, path)
    try:
        ref = importlib.import_module("kfac")
        with contextlib.suppress(ImportError):
            importlib.import_module("kfac.preconditioner")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"--reference {path}: its kfac package reads the version of an installed kfac-pytorch; "
            f"install that tree without dependencies (pip install --no-deps -e {path})"
        ) from None
    except ImportError as err:
        raise SystemExit(
            f"--reference {path}: cannot import kfac-pytorch from there ({err}); give its source root"
        ) from None
    current = getattr(getattr(ref, "preconditioner", None), "KFACPreconditioner", None)
    if current is not None:
        return Reference(path, current)
    legacy = getattr(ref, "KFAC", None)
    if legacy is None:
        raise SystemExit(
            f"--reference {path}: its kfac package has neither preconditioner.KFACPreconditioner nor KFAC"
        )
    return Reference(path, legacy, legacy=True)


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


def table(rows: list[dict[str, Any]]) -> str:
    """One block per workload: each stage's ms per step against its floor, per variant; the step times
    and ratios to SGD; the reference's when measured."""
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
    blocks.append(
        "floors: factor GEMM FLOPs and preconditioning GEMM FLOPs at the GEMM rate, bare eigh of the same "
        "factors; decompositions amortised over their interval; 'x floor' is the first variant's"
    )
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS))
    ap.add_argument(
        "--cadence",
        default="1/10",
        help="factor/decomposition intervals (default: the paper's 1/10)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help="K-FAC arms: 'exact' or key=value[,key=value] engine arguments; the first is the main one",
    )
    ap.add_argument("--rounds", type=int, default=3, help="measured decomposition intervals")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--reference", metavar="PATH", help="kfac-pytorch source root: also time its step"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="digits only, cadence 1/2, one warm-up step (a smoke run)",
    )
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.workloads, args.cadence = ["digits"], "1/2"
    torch.set_num_threads(args.threads)
    reference = reference_factory(args.reference) if args.reference else None
    all_workloads = workloads()
    unknown = [n for n in args.workloads if n not in all_workloads]
    if unknown:
        ap.error(f"unknown workload {unknown[0]!r}: choose from {', '.join(all_workloads)}")
    try:
        for spec in args.variants:
            parse_variant(spec)
    except ValueError as err:
        ap.error(str(err))
    f, k = (int(v) for v in args.cadence.split("/"))
    rows = []
    for name in args.workloads:
        print(f"measuring {name} at {f}/{k} ...", file=sys.stderr, flush=True)
        rows.append(
            measure(
                all_workloads[name],
                f,
                k,
                args.rounds,
                warmup_steps=1 if args.quick else 3,
                variants=tuple(args.variants),
                reference=reference,
            )
        )
        print(table(rows[-1:]), file=sys.stderr, flush=True)  # progress
    meta = {"torch": torch.__version__, "threads": args.threads, "device": "cpu"}
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
