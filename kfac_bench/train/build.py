"""Config -> the objects of one run: data, model, task, optimizer, schedule, preconditioner, loop state,
checkpoint manager and recorder, wired together (:func:`build_run`); and the Hydra instantiation that
reports a builder's user errors in one line."""

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
from typing import Any

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
from kfac_bench.data.loader import build_loaders
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
    batches, world = _batches(t, splits, env.world_size, starting_world_size or env.world_size)
    sampler.cover(batches.steps_per_epoch * batches.global_batch)
    w0 = world.world_size  # the hyperparameters' world size
    epochs, max_steps, benchmark = _budget(t, batches.steps_per_epoch)
    precision = Precision(t.precision)
    optimizer, scheduler, precond, scaler = _update_rule(
        cfg, module, batches, w0, max_steps, device, precision
    )
    model: nn.Module = module
    if env.distributed:
        model = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=t.find_unused_parameters,
        )
    state = TrainState(
        world_size=env.world_size,
        batch_size=t.batch_size,
        global_batch=batches.global_batch,
        reference_world_size=w0,
    )
    targets = TargetTracker(dict(t.targets), task.target_metric, bool(task.higher_is_better))
    stages = StageTotals(precond)
    recorder = Recorder(
        run_dir,
        state,
        stages,
        targets.primary,
        max_steps,
        enabled=env.is_main,
        progress=str(t.progress.value),
        log_every_steps=t.log_every_steps,
        tensorboard=t.tensorboard,
        mlperf=writes_log(t.mlperf_log, str(t.benchmark_name), timed_run=not benchmark),
        benchmark=t.benchmark_name,
        facts=run_facts(
            cfg,
            batches=batches,
            splits=splits,
            max_steps=max_steps,
            world_size=env.world_size,
            device=device,
            primary=targets.primary,
            starting_world_size=w0,
            init_start_s=init_start_s,
        ),
        tracker=experiment_tracker,
    )
    checkpoints = CheckpointManager(
        run_dir / CHECKPOINT_DIR,
        {
            "model": module,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "scaler": scaler,
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
    loop = Loop(
        model=model,
        module=module,
        task=task,
        optimizer=optimizer,
        scheduler=scheduler,
        precond=precond,
        scaler=scaler,
        autocast=_autocast(device, precision),
        device=device,
        train_loader=train_loader,
        eval_loader=eval_loader,
        sampler=sampler,
        state=state,
        target_tracker=targets,
        recorder=recorder,
        checkpoints=checkpoints,
        preempt=PreemptionFlag(),
        accumulation_steps=batches.accumulation_steps,
        micro_per_epoch=batches.micro_per_epoch,
        epochs=epochs,
        max_steps=max_steps,
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
        step_timer=StepTimer(t.benchmark_warmup_steps) if benchmark else None,
    )
    return Run(loop, checkpoints, recorder, batches, stages, world)


def _budget(t: TrainConfig, steps_per_epoch: int) -> tuple[int, int, bool]:
    """(epochs, max steps, whether a benchmark): a benchmark's warm-up and timed steps take as many epochs
    as they need."""
    max_steps = min(t.epochs * steps_per_epoch, t.max_steps or sys.maxsize)
    benchmark = str(t.mode.value) == "benchmark"
    if not benchmark:
        return t.epochs, max_steps, False
    max_steps = t.benchmark_warmup_steps + t.benchmark_steps
    return -(-max_steps // steps_per_epoch), max_steps, True


def _update_rule(
    cfg: RunConfig,
    module: nn.Module,
    batches: BatchLayout,
    world_size: int,
    max_steps: int,
    device: torch.device,
    precision: Precision,
) -> tuple[torch.optim.Optimizer, Any, Any, Any]:
    """(optimizer, LR scheduler, preconditioner or None, AMP grad scaler or None) for the run's
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
    return optimizer, scheduler, precond, scaler


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
