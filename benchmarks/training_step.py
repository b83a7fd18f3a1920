"""One timed training step per arm, for benchmarks that set SGD and SGD + K-FAC side by side.

A :class:`Workload` is what one step computes (model, batch maker, loss); :class:`Setup` is where and in
what precision the arms run (device, autocast, GradScaler, channels_last); an :class:`Arm` is one copy of the
model with its optimizer and, for K-FAC, its preconditioner, and times one step in the harness loop's order.
:func:`twins` builds the SGD and the K-FAC arm from the same weights; :func:`eigh_check` sets the
decomposition stage against bare ``torch.linalg.eigh`` on the same factors. The overhead benchmark
(``benchmarks/overhead.py``, on the CPU) and the GPU check (``benchmarks/gpu/``, on CUDA under AMP) use them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner


@dataclass
class Workload:
    """A model, a batch maker and a loss: what one training step computes."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    skip_layers: tuple[str, ...] = ()


def classification(
    name: str, build: Callable[[], nn.Module], shape: tuple[int, ...], classes: int
) -> Workload:
    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    return Workload(name, build, batch, loss)


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
    return model(**b).loss


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
        before = stage_times(p)
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
        after = stage_times(p)
        stages = {k: after[k] - before[k] for k in after}
        return StepTime(t3 - t0, t1 - t0, t2 - t1, t3 - t2, stages)


#: The phases of one training step, as :class:`StepTime` splits it.
PHASES = ("forward_backward", "precondition", "update")


def stage_times(p: Any) -> dict[str, float]:
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
