"""Config -> the objects of one run, wired together (:func:`build_run`): what trains (data, task and model
from the run's seed, loaders, batch arithmetic, budget, optimizer, LR schedule, preconditioner), then
what keeps account of it (train state, target, stage totals, recorder, checkpoint manager), then the
:class:`~kfac_bench.train.loop.Loop` that holds them all."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from kfac_bench.checkpoint.elastic import World, accumulation_for
from kfac_bench.checkpoint.manager import (
    CHECKPOINT_DIR,
    CheckpointManager,
    PreconditionerState,
    RNGState,
)
from kfac_bench.config.compose import instantiate
from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.config.schema import Precision, RunConfig, TrainConfig
from kfac_bench.data.base import DataSplits
from kfac_bench.data.batching import BatchLayout, batch_layout
from kfac_bench.data.loader import ResumableSampler, build_loaders
from kfac_bench.launcher.distributed import DistEnv
from kfac_bench.launcher.signals import PreemptionFlag
from kfac_bench.metrics.mlperf import writes_log
from kfac_bench.metrics.recorder import Recorder
from kfac_bench.metrics.timekeeping import StageTotals, StepTimer, TargetTracker
from kfac_bench.metrics.trackers import Tracker
from kfac_bench.train.loop import Loop
from kfac_bench.train.mlperf_facts import run_facts
from kfac_bench.train.optim import base_lr, build_lr_scheduler, build_optimizer, lr_factor
from kfac_bench.train.state import TrainState

__all__ = ["Run", "build_data", "build_run", "seed_everything"]


def build_data(dataset_cfg: Any) -> DataSplits:
    """Both splits of a ``dataset`` config: its builder returns a :class:`DataSplits`.

    Raises:
        TypeError: the builder returned something else (a programming error, not a user's).
    """
    splits = instantiate(dataset_cfg)
    if not isinstance(splits, DataSplits):
        raise TypeError(
            f"dataset builder {dataset_cfg._target_} returned {type(splits).__name__}; "
            "every dataset builder returns kfac_bench.data.base.DataSplits"
        )
    return splits


@dataclass
class Run:
    """Everything one run is made of, ready to resume and train.

    ``loop`` holds what the loop touches; ``checkpoints`` saves and restores the stateful parts;
    ``recorder`` writes the measurements; ``batches`` is the batch arithmetic of this job; ``world`` the world
    the run started with (:mod:`kfac_bench.checkpoint.elastic`).
    """

    loop: Loop
    checkpoints: CheckpointManager
    recorder: Recorder
    batches: BatchLayout
    stages: StageTotals
    world: World


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators, as a run is seeded before it builds its parts."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _set_threads(threads: int | None, device: torch.device) -> None:
    if threads is None and device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local_world)
    if threads is not None:
        torch.set_num_threads(threads)


def _autocast(device: torch.device, precision: Precision) -> Callable[[], Any]:
    if device.type != "cuda" or precision is Precision.fp32:
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision is Precision.bf16 else torch.float16
    return functools.partial(torch.autocast, device_type="cuda", dtype=dtype)


def build_run(
    cfg: RunConfig,
    run_dir: Path,
    env: DistEnv,
    device: torch.device,
    starting_world_size: int | None = None,
    experiment_tracker: Tracker | None = None,
) -> Run:
    """Build a run from its composed config, for this rank of ``env`` on ``device``;
    ``experiment_tracker`` is the one rank 0 opened (:func:`kfac_bench.train.run.open_side_channels`).

    The model is initialised from ``train.seed`` on every rank (identical weights); augmentation and
    dropout then draw from per-rank streams (``train.seed + rank``).

    ``starting_world_size`` (default: ``env``'s) is the world size the run started with: its global batch,
    steps per epoch and hyperparameters are that world's; ``env``'s ranks keep the global batch with more
    or fewer accumulation steps (:mod:`kfac_bench.checkpoint.elastic`).

    Raises:
        UserError: a builder's problem with the user's data or settings (one line).
    """
    init_start_s = time.time()  # MLPerf's init_start
    t = cfg.train
    _set_threads(t.cpu_threads, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = _training_parts(cfg, env, device, starting_world_size or env.world_size)
    state = TrainState(
        world_size=env.world_size,
        batch_size=t.batch_size,
        global_batch=parts.batches.global_batch,
        reference_world_size=parts.world.world_size,
    )
    targets = TargetTracker(
        dict(t.targets), parts.task.target_metric, bool(parts.task.higher_is_better)
    )
    stages = StageTotals(parts.rule.precond)
    recorder = _recorder(
        cfg, run_dir, env, device, parts, state, stages, targets, init_start_s, experiment_tracker
    )
    checkpoints = _checkpoints(t, run_dir, env, parts, state, targets, stages, recorder)
    loop = _loop(t, env, device, parts, state, targets, recorder, checkpoints)
    return Run(loop, checkpoints, recorder, parts.batches, stages, parts.world)


class _Budget(NamedTuple):
    """How long the run trains: a benchmark's warm-up and timed steps take as many epochs as they need."""

    epochs: int
    max_steps: int
    benchmark: bool


class _UpdateRule(NamedTuple):
    """What changes the weights, each built from its own config section."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    precond: Any  # None with kfac=none
    scaler: Any  # the AMP grad scaler, fp16 on CUDA only


@dataclass
class _TrainingParts:
    """What trains, built from the config's sections in the order the seeds require."""

    splits: DataSplits
    task: Any
    module: nn.Module  # the bare model (evaluation, checkpoints)
    model: nn.Module  # what the forward pass calls: the DDP wrapper when distributed
    train_loader: Any
    eval_loader: Any
    sampler: ResumableSampler
    batches: BatchLayout
    world: World  # the world the run started with: the hyperparameters' world size
    budget: _Budget
    rule: _UpdateRule
    autocast: Callable[[], Any]


def _training_parts(
    cfg: RunConfig, env: DistEnv, device: torch.device, starting_world_size: int
) -> _TrainingParts:
    """Data, task and model from ``train.seed`` (identical on every rank), then the loaders from per-rank
    streams, the batch arithmetic, the budget and the update rule on the starting world's hyperparameters."""
    t = cfg.train
    seed_everything(t.seed)
    splits = build_data(cfg.dataset)
    task = instantiate(cfg.task)
    module: nn.Module = instantiate(cfg.model).to(device)
    seed_everything(t.seed + env.rank)
    train_loader, eval_loader, sampler = build_loaders(
        splits,
        t.batch_size,
        env.world_size,
        env.rank,
        t.seed,
        t.num_workers,
        pin_memory=device.type == "cuda",
        eval_batch_size=t.eval_batch_size,
    )
    batches, world = _batches(t, splits, env.world_size, starting_world_size)
    sampler.cover(batches.steps_per_epoch * batches.global_batch)
    budget = _budget(t, batches.steps_per_epoch)
    precision = Precision(t.precision)
    rule = _update_rule(cfg, module, batches, world.world_size, budget.max_steps, device, precision)
    model: nn.Module = module
    if env.distributed:
        model = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=t.find_unused_parameters,
        )
    return _TrainingParts(
        splits,
        task,
        module,
        model,
        train_loader,
        eval_loader,
        sampler,
        batches,
        world,
        budget,
        rule,
        _autocast(device, precision),
    )


def _recorder(
    cfg: RunConfig,
    run_dir: Path,
    env: DistEnv,
    device: torch.device,
    parts: _TrainingParts,
    state: TrainState,
    stages: StageTotals,
    targets: TargetTracker,
    init_start_s: float,
    tracker: Tracker | None,
) -> Recorder:
    """The run's measurements, written by rank 0; the MLPerf log (a timed run's) opens with the run's
    facts (:func:`~kfac_bench.train.mlperf_facts.run_facts`)."""
    t = cfg.train
    facts = run_facts(
        cfg,
        batches=parts.batches,
        splits=parts.splits,
        max_steps=parts.budget.max_steps,
        world_size=env.world_size,
        device=device,
        primary=targets.primary,
        starting_world_size=parts.world.world_size,
        init_start_s=init_start_s,
    )
    return Recorder(
        run_dir,
        state,
        stages,
        targets.primary,
        parts.budget.max_steps,
        enabled=env.is_main,
        progress=str(t.progress.value),
        log_every_steps=t.log_every_steps,
        tensorboard=t.tensorboard,
        mlperf=writes_log(
            t.mlperf_log, str(t.benchmark_name), timed_run=not parts.budget.benchmark
        ),
        benchmark=t.benchmark_name,
        facts=facts,
        tracker=tracker,
    )


def _checkpoints(
    t: TrainConfig,
    run_dir: Path,
    env: DistEnv,
    parts: _TrainingParts,
    state: TrainState,
    targets: TargetTracker,
    stages: StageTotals,
    recorder: Recorder,
) -> CheckpointManager:
    """Every stateful part of the run, saved and restored as one set."""
    precond = parts.rule.precond
    return CheckpointManager(
        run_dir / CHECKPOINT_DIR,
        {
            "model": parts.module,
            "optimizer": parts.rule.optimizer,
            "scheduler": parts.rule.scheduler,
            "scaler": parts.rule.scaler,
            "precond": PreconditionerState(precond) if precond is not None else None,
            "train_state": state,
            "tracker": targets,
            "stage_times": stages,
            "mlperf_log": recorder.mlperf,  # its length and clock: a resumed run continues the log
            "rng": RNGState(env.rank, env.world_size),  # last: restored after everything else
        },
        is_main=env.is_main,
        keep=t.keep_checkpoints,
    )


def _loop(
    t: TrainConfig,
    env: DistEnv,
    device: torch.device,
    parts: _TrainingParts,
    state: TrainState,
    targets: TargetTracker,
    recorder: Recorder,
    checkpoints: CheckpointManager,
) -> Loop:
    """Everything the loop touches; ``train.mode=benchmark`` times its steps instead of evaluating."""
    return Loop(
        model=parts.model,
        module=parts.module,
        task=parts.task,
        optimizer=parts.rule.optimizer,
        scheduler=parts.rule.scheduler,
        precond=parts.rule.precond,
        scaler=parts.rule.scaler,
        autocast=parts.autocast,
        device=device,
        train_loader=parts.train_loader,
        eval_loader=parts.eval_loader,
        sampler=parts.sampler,
        state=state,
        target_tracker=targets,
        recorder=recorder,
        checkpoints=checkpoints,
        preempt=PreemptionFlag(),
        accumulation_steps=parts.batches.accumulation_steps,
        micro_per_epoch=parts.batches.micro_per_epoch,
        epochs=parts.budget.epochs,
        max_steps=parts.budget.max_steps,
        world_size=env.world_size,
        batch_size=t.batch_size,
        grad_clip_norm=t.grad_clip_norm,
        eval_every_epochs=t.eval_every_epochs,
        eval_every_steps=t.eval_every_steps,
        checkpoint_every_epochs=t.checkpoint_every_epochs,
        checkpoint_every_steps=t.checkpoint_every_steps,
        checkpoint_at_end=t.checkpoint_at_end,
        stop_at_target=t.stop_at_target,
        limit_eval_batches=t.limit_eval_batches,
        step_timer=StepTimer(t.benchmark_warmup_steps) if parts.budget.benchmark else None,
    )


def _budget(t: TrainConfig, steps_per_epoch: int) -> _Budget:
    """The run's epochs and steps, the train config's or, for a benchmark, its warm-up and timed steps."""
    max_steps = min(t.epochs * steps_per_epoch, t.max_steps or sys.maxsize)
    benchmark = str(t.mode.value) == "benchmark"
    if not benchmark:
        return _Budget(t.epochs, max_steps, False)
    max_steps = t.benchmark_warmup_steps + t.benchmark_steps
    return _Budget(-(-max_steps // steps_per_epoch), max_steps, True)


def _update_rule(
    cfg: RunConfig,
    module: nn.Module,
    batches: BatchLayout,
    world_size: int,
    max_steps: int,
    device: torch.device,
    precision: Precision,
) -> _UpdateRule:
    """Optimizer, LR scheduler, preconditioner (or None) and AMP grad scaler (or None) for the run's
    hyperparameters on ``world_size`` ranks, each built from its own config section."""
    fp16_on_cuda = device.type == "cuda" and precision is Precision.fp16
    scaler = torch.amp.GradScaler("cuda") if fp16_on_cuda else None
    optimizer = build_optimizer(module, cfg.optimizer, world_size)
    factor = lr_factor(
        cfg.lr_schedule,
        batches.steps_per_epoch,
        max_steps,
        world_size,
        base_lr=base_lr(cfg.optimizer, world_size),
    )
    scheduler = build_lr_scheduler(optimizer, factor)
    precond = build_preconditioner(
        module,
        cfg.kfac,
        steps_per_epoch=batches.steps_per_epoch,
        world_size=world_size,
        accumulation_steps=batches.accumulation_steps,
        lr=lambda step: optimizer.param_groups[0]["lr"],
        grad_scaler=scaler,
    )
    return _UpdateRule(optimizer, scheduler, precond, scaler)


def _batches(
    t: TrainConfig, splits: DataSplits, world_size: int, starting_world_size: int
) -> tuple[BatchLayout, World]:
    """This job's batch layout and the run's starting world: the epoch and the global batch are planned on
    ``starting_world_size`` ranks; ``world_size`` ranks keep them with their own accumulation.

    Raises:
        ConfigError: the batch sizes do not fit, or ``world_size`` cannot keep the global batch.
    """
    n = len(splits.train)  # type: ignore[arg-type]
    start = batch_layout(
        samples_per_rank=math.ceil(n / starting_world_size),  # DistributedSampler's shard
        batch_size=t.batch_size,
        world_size=starting_world_size,
        global_batch=t.global_batch_size,
        accumulation=t.accumulation_steps,
        limit_micro_batches=t.limit_train_batches,
    )
    world = World(starting_world_size, start.global_batch, t.batch_size)
    if world_size == starting_world_size:
        return start, world
    accumulation = accumulation_for(world, world_size)
    batches = BatchLayout(
        t.batch_size, world_size, accumulation, start.steps_per_epoch * accumulation
    )
    return batches, world
