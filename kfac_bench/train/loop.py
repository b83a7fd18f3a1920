"""The one training loop. Tasks define only the loss of a batch and the evaluation; the order lives here,
in :func:`run_loop` (CONTRIBUTING.md, convention 3; the shape of nanoGPT's loop and detectron2's
``SimpleTrainer.run_step``).

One optimizer step: forward under autocast -> scaled backward per micro-batch (DDP ``no_sync`` on all but the
last) -> one all-reduce of [loss, preemption flag] -> AMP unscale -> gradient clipping -> ``precond.step()``
(after DDP averaged the gradients and after unscaling) -> ``optimizer.step()`` -> ``zero_grad`` -> LR schedule
step. Around it: metrics, evaluation, the stop test, checkpoints, preemption.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_bench.checkpoint.manager import CheckpointManager, NonFiniteState
from kfac_bench.launcher.signals import PreemptionFlag
from kfac_bench.metrics.recorder import Recorder
from kfac_bench.metrics.timekeeping import StepTimer, TargetTracker
from kfac_bench.train.state import TrainState

__all__ = ["Loop", "evaluate", "run_loop"]


@dataclass
class Loop:
    """Everything the loop touches, built by :func:`kfac_bench.train.build.build_run`.

    ``model`` is what the forward pass calls (the DDP wrapper when distributed); ``module`` is the bare
    model (evaluation, checkpoints). ``recorder`` receives the measurements (it does not change the order);
    ``target_tracker`` is the run's one stop test (the target; experiment trackers are the recorder's);
    ``checkpoints`` saves every stateful part. With ``step_timer``
    (``train.mode=benchmark``) the loop only trains and times its steps: no evaluation, no checkpoint.
    """

    model: nn.Module
    module: nn.Module
    task: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precond: Any
    scaler: torch.amp.GradScaler | None
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    device: torch.device
    train_loader: Any
    eval_loader: Any
    sampler: Any
    state: TrainState
    target_tracker: TargetTracker
    recorder: Recorder
    checkpoints: CheckpointManager
    preempt: PreemptionFlag
    accumulation_steps: int
    micro_per_epoch: int
    epochs: int
    max_steps: int
    world_size: int
    batch_size: int
    grad_clip_norm: float | None = None
    eval_every_epochs: int = 1
    eval_every_steps: int | None = None
    checkpoint_every_epochs: int = 1
    checkpoint_every_steps: int | None = None
    checkpoint_at_end: bool = True
    stop_at_target: bool = False
    limit_eval_batches: int | None = None
    step_timer: StepTimer | None = None
    #: Set when the run diverged: (step, what was non-finite, in words).
    divergence: tuple[int, str] | None = None


def run_loop(loop: Loop) -> str:
    """Train until the epoch/step budget, the target (with ``stop_at_target``), divergence or preemption:
    the order-sensitive sequence of a step in one place (forward and scaled backward of each micro-batch,
    the ranks' agreement, unscale, clip, ``precond.step()``, ``optimizer.step()``, schedules, metrics,
    evaluation, checkpoint).

    The run diverges on a non-finite loss (it stops before any parameter changes) or when a checkpoint
    would hold a non-finite weight, optimizer or K-FAC value (it is not written): either way the newest
    checkpoint stays the last finite one, and ``loop.divergence`` says where and what.

    Returns:
        The run status: ``success``, ``target_not_reached``, ``diverged`` or ``preempted`` (a benchmark that
        ran its steps: ``success``).
    """
    s, timer = loop.state, loop.step_timer
    s.wall.start()
    if timer is not None:
        timer.start()
    loop.module.train()
    try:
        while s.epoch < loop.epochs and s.step < loop.max_steps:
            if s.micro_in_epoch == 0:  # a run resumed mid-epoch continues the epoch it logged
                loop.recorder.on_epoch(started=True)
            s.train_clock.start()
            for micro_batches in _epoch_batches(loop):
                t0 = time.perf_counter()
                loss_sum, examples = forward_backward(loop, micro_batches)
                mean_loss, preempted = _agree(loop, loss_sum / len(micro_batches))
                if not math.isfinite(mean_loss):
                    loop.optimizer.zero_grad(set_to_none=True)
                    s.train_clock.stop()
                    loop.divergence = (s.step + 1, f"non-finite loss {mean_loss}")
                    return "diverged"
                if loop.scaler is not None:
                    loop.scaler.unscale_(loop.optimizer)
                if loop.grad_clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(loop.module.parameters(), loop.grad_clip_norm)
                if loop.precond is not None:
                    loop.precond.step()
                optimizer_step(loop)
                _count_step(loop, len(micro_batches), examples, t0, mean_loss)
                ended = _after_step(loop, preempted)
                if ended is not None:
                    return ended
                if s.step >= loop.max_steps:
                    break
            s.train_clock.stop()
            if s.step >= loop.max_steps and s.micro_in_epoch < loop.micro_per_epoch:
                break  # a step budget ended mid-epoch
            ended = _after_epoch(loop)
            if ended is not None:
                return ended
        if timer is not None:
            return "success"
        if s.last_eval_step != s.step:
            evaluate(loop)
        if loop.checkpoint_at_end:
            loop.checkpoints.save(s.step)
        return (
            "success"
            if loop.target_tracker.reached or not loop.target_tracker.targets
            else "target_not_reached"
        )
    except NonFiniteState as exc:
        s.train_clock.stop()
        loop.divergence = (exc.step, exc.what)
        return "diverged"


def forward_backward(loop: Loop, micro_batches: list[Any]) -> tuple[torch.Tensor, int]:
    """Forward and scaled backward of one optimizer step's micro-batches (DDP all-reduces in the last
    one's backward only); returns (the sum of their losses, the examples they held)."""
    ddp = isinstance(loop.model, nn.parallel.DistributedDataParallel)
    loss_sum, examples = torch.zeros((), device=loop.device), 0
    for i, batch in enumerate(micro_batches):
        batch = loop.task.to_device(batch, loop.device)
        examples += loop.task.batch_size(batch)
        last = i == len(micro_batches) - 1
        with loop.model.no_sync() if ddp and not last else contextlib.nullcontext():  # type: ignore[operator]
            with loop.autocast():
                loss = loop.task.loss(loop.model, batch)
            scaled = loss / len(micro_batches)
            (loop.scaler.scale(scaled) if loop.scaler else scaled).backward()
        loss_sum += loss.detach().float()
    return loss_sum, examples


def optimizer_step(loop: Loop) -> None:
    """The optimizer's step (through the AMP scaler when there is one), then the schedules' step."""
    if loop.scaler is not None:
        loop.scaler.step(loop.optimizer)
        loop.scaler.update()
    else:
        loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.scheduler.step()


def _count_step(loop: Loop, micro: int, examples: int, t0: float, mean_loss: float) -> None:
    """Advance the step counters and record the step's time since ``t0`` (``time.perf_counter``), the
    device synchronised first: its work is done."""
    s = loop.state
    s.step += 1
    s.micro_in_epoch += micro
    s.samples += examples * loop.world_size
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)
    s.throughput.add(time.perf_counter() - t0, examples * loop.world_size)
    if loop.step_timer is not None:
        loop.step_timer.tick(examples * loop.world_size)
    loop.recorder.on_step(mean_loss, loop.optimizer.param_groups[0]["lr"])


def _after_step(loop: Loop, preempted: bool) -> str | None:
    """A step's evaluation and checkpoint when due, and a preemption's checkpoint; returns the status that
    ends the run here (``success`` at the target with ``stop_at_target``, ``preempted``), else None."""
    s, timer = loop.state, loop.step_timer
    if timer is None and _due(s.step, loop.eval_every_steps):
        evaluate(loop)
        s.train_clock.start()
        if loop.stop_at_target and loop.target_tracker.reached:
            if loop.checkpoint_at_end:
                loop.checkpoints.save(s.step)
            return "success"
    if timer is None and _due(s.step, loop.checkpoint_every_steps):
        s.train_clock.stop()
        loop.checkpoints.save(s.step)
        s.train_clock.start()
    if preempted:
        s.train_clock.stop()
        if timer is None:
            loop.checkpoints.save(s.step)
        return "preempted"
    return None


def _after_epoch(loop: Loop) -> str | None:
    """Close the epoch: its evaluation and checkpoint when due; returns ``success`` when the target ends
    the run here, else None."""
    s = loop.state
    loop.recorder.on_epoch(started=False)
    s.epoch += 1
    s.micro_in_epoch = 0
    finished = s.epoch >= loop.epochs or s.step >= loop.max_steps
    if loop.step_timer is not None:
        return None  # a benchmark: no evaluation, no checkpoint
    if (_due(s.epoch, loop.eval_every_epochs) or finished) and s.last_eval_step != s.step:
        evaluate(loop)
        if loop.stop_at_target and loop.target_tracker.reached:
            if loop.checkpoint_at_end:
                loop.checkpoints.save(s.step)
            return "success"
    if _due(s.epoch, loop.checkpoint_every_epochs) and not finished:
        loop.checkpoints.save(s.step)
    return None


def _agree(loop: Loop, local_loss: torch.Tensor) -> tuple[float, bool]:
    """(mean loss over ranks, whether any rank was asked to stop): one collective decides for every rank,
    divergence (a NaN spreads through the sum) and preemption alike."""
    stats = torch.stack(
        [local_loss, torch.tensor(float(loop.preempt.signum is not None), device=loop.device)]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
        stats[0] /= loop.world_size
    return float(stats[0]), bool(stats[1] > 0)


def _epoch_batches(loop: Loop) -> Iterator[list[Any]]:
    """This epoch's remaining micro-batches, grouped by optimizer step."""
    s = loop.state
    loop.sampler.set_epoch(s.epoch, start=s.sample_in_epoch)
    remaining = loop.micro_per_epoch - s.micro_in_epoch
    it = itertools.islice(iter(loop.train_loader), remaining)
    while group := list(itertools.islice(it, loop.accumulation_steps)):
        if len(group) == loop.accumulation_steps:
            yield group


class FirstBatches:
    """The first ``n`` batches of ``loader``, keeping its ``dataset``: a task may score against the
    dataset itself (COCO evaluation reads the ground truth from ``loader.dataset``)."""

    def __init__(self, loader: Any, n: int) -> None:
        self.loader, self.n = loader, n
        self.dataset = getattr(loader, "dataset", None)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.n)


def evaluate(loop: Loop) -> dict[str, Any]:
    """Evaluate, record the result (tracker, then recorder) and return the record."""
    s = loop.state
    s.train_clock.stop()
    epoch = s.epoch + s.micro_in_epoch / max(loop.micro_per_epoch, 1)
    loop.recorder.on_eval_start(epoch)
    loader: Any = loop.eval_loader
    if loop.limit_eval_batches is not None:
        loader = FirstBatches(loader, loop.limit_eval_batches)
    metrics = loop.task.evaluate(loop.module, loader)
    record = {
        "step": s.step,
        "epoch": epoch,
        "samples": s.samples,
        "wall_time_s": s.wall.elapsed,
        "train_time_s": s.train_clock.elapsed,
        "metrics": metrics,
    }
    s.last_eval_step = s.step
    first = loop.target_tracker.update(record)
    loop.recorder.on_eval(record, target_met=first)
    return record


def _due(count: int, every: int | None) -> bool:
    return bool(every) and count % every == 0  # type: ignore[operator]
