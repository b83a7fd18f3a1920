"""One run: build everything from the config, resume if the run directory has a checkpoint, run the loop,
write the summary. :func:`run` is what ``kfac-bench train`` calls in every rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from kfac_bench.config.schema import Precision
from kfac_bench.data.batching import plan_batches
from kfac_bench.data.loader import build_loaders
from kfac_bench.metrics import sinks, summary
from kfac_bench.metrics.progress import Progress
from kfac_bench.metrics.tracker import StageTimes, TargetTracker
from kfac_bench.train import distributed
from kfac_bench.train.build import build_data, instantiate
from kfac_bench.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointManager,
    PreconditionerState,
    RNGState,
)
from kfac_bench.train.kfac_adapter import build_preconditioner
from kfac_bench.train.loop import Loop, train
from kfac_bench.train.optim import build_lr_scheduler, build_optimizer, lr_factor
from kfac_bench.train.signals import EXIT_REQUEUE, PreemptionFlag
from kfac_bench.train.state import TrainState

__all__ = ["EXIT_CODES", "run"]

#: Process exit status per run status. A diverged run is a result (status in summary.json), not a crash,
#: so it exits 0 and a torchrun restart does not replay it.
EXIT_CODES = {"success": 0, "target_not_reached": 0, "diverged": 0, "preempted": EXIT_REQUEUE}


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _set_threads(threads: int | None, device: torch.device) -> None:
    if threads is None and device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local_world)
    if threads is not None:
        torch.set_num_threads(threads)


def _autocast(device: torch.device, precision: Precision) -> Any:
    if device.type != "cuda" or precision is Precision.fp32:
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision is Precision.bf16 else torch.float16
    return functools.partial(torch.autocast, device_type="cuda", dtype=dtype)


def run(cfg: DictConfig, run_dir: Path) -> int:
    """Train as configured, writing everything under ``run_dir``; returns the process exit status."""
    env = distributed.detect()
    t = cfg.train
    device = distributed.pick_device(str(t.device.value), env)
    distributed.setup(env, device)
    try:
        return _run(cfg, Path(run_dir), env, device)
    finally:
        distributed.cleanup()


def _run(cfg: DictConfig, run_dir: Path, env: distributed.DistEnv, device: torch.device) -> int:
    t = cfg.train
    main = env.is_main
    _set_threads(t.cpu_threads, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    _seed(t.seed)
    splits = build_data(cfg.dataset)
    task = instantiate(cfg.task)
    module: nn.Module = instantiate(cfg.model).to(device)
    _seed(t.seed + env.rank)  # per-rank streams for augmentation/dropout; the model init is shared
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
    plan = plan_batches(
        samples_per_rank=sampler.num_samples,
        batch_size=t.batch_size,
        world_size=env.world_size,
        global_batch=t.global_batch_size,
        accumulation=t.accumulation_steps,
        limit_micro_batches=t.limit_train_batches,
    )
    accum, micro, steps_per_epoch = (
        plan.accumulation_steps,
        plan.micro_per_epoch,
        plan.steps_per_epoch,
    )
    max_steps = min(t.epochs * steps_per_epoch, t.max_steps or sys.maxsize)
    precision = Precision(t.precision)
    scaler = (
        torch.amp.GradScaler("cuda")
        if device.type == "cuda" and precision is Precision.fp16
        else None
    )
    optimizer = build_optimizer(module, cfg.optimizer, env.world_size)
    factor = lr_factor(cfg.lr_schedule, steps_per_epoch, max_steps, env.world_size)
    scheduler = build_lr_scheduler(optimizer, factor)
    precond = build_preconditioner(
        module,
        cfg.kfac,
        steps_per_epoch=steps_per_epoch,
        world_size=env.world_size,
        accumulation_steps=accum,
        lr=lambda step: optimizer.param_groups[0]["lr"],
        grad_scaler=scaler,
    )
    model: nn.Module = module
    if env.distributed:
        model = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=t.find_unused_parameters,
        )
    state = TrainState(world_size=env.world_size)
    tracker = TargetTracker(dict(t.targets), task.target_metric, bool(task.higher_is_better))
    stages = StageTimes(precond)
    checkpoints = CheckpointManager(
        run_dir / CHECKPOINT_DIR,
        {
            "model": module,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "scaler": scaler,
            "precond": PreconditionerState(precond) if precond is not None else None,
            "train_state": state,
            "tracker": tracker,
            "stage_times": stages,
            "rng": RNGState(
                env.rank, env.world_size
            ),  # last: nothing may draw after it is restored
        },
        is_main=main,
    )
    resumed = checkpoints.load() if t.resume else False

    jsonl = sinks.JsonlSink(run_dir / sinks.EVAL_FILE) if main else None
    tb = sinks.TensorBoardSink(run_dir / "tb") if main and t.tensorboard else None
    mlperf = (
        sinks.MLPerfSink(run_dir / sinks.MLPERF_FILE, t.benchmark_name)
        if main and t.mlperf_log
        else None
    )
    global_batch = t.batch_size * accum * env.world_size
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        print(
            f"kfac-bench: run dir {run_dir} | world {env.world_size} on {device} | "
            f"kfac {'on' if precond is not None else 'off'} | {steps_per_epoch} steps/epoch, "
            f"global batch {global_batch}"
            + (f" | resumed at step {state.step}" if resumed else ""),
            flush=True,
        )
    if mlperf:
        mlperf.run_start(global_batch, resumed=resumed)
    progress = Progress(str(t.progress.value), max_steps, t.log_every_steps, enabled=main)
    window = {"loss": 0.0, "n": 0, "t": time.perf_counter(), "samples": state.samples}
    stage_prev = stages.totals()
    last_metric: dict[str, float] = {}

    def on_log(stats: dict[str, Any]) -> None:
        window["loss"] += stats["loss"]
        window["n"] += 1
        if state.step % max(t.log_every_steps, 1) and state.step != max_steps:
            return
        now = time.perf_counter()
        rate = (state.samples - window["samples"]) / max(now - window["t"], 1e-9)
        loss = window["loss"] / window["n"]
        shown = {"loss": loss, "lr": stats["lr"], "samples/s": rate, **last_metric}
        mean = state.throughput.mean_step_time_s
        progress.update(
            state.step, state.epoch, shown, mean * (max_steps - state.step) if mean else None
        )
        if tb is not None:
            scalars = {"train/loss": loss, "train/lr": stats["lr"], "train/samples_per_s": rate}
            nonlocal stage_prev
            totals = stages.totals()
            for k, v in totals.items():
                scalars[f"kfac/{k}_s_per_step"] = (v - stage_prev.get(k, 0.0)) / window["n"]
            stage_prev = totals
            tb.scalars(scalars, state.step)
        window.update(loss=0.0, n=0, t=now, samples=state.samples)

    def on_eval(record: dict[str, Any]) -> None:
        last_metric.clear()
        if tracker.primary in record["metrics"]:
            last_metric[tracker.primary] = record["metrics"][tracker.primary]
        if not main:
            return
        assert jsonl is not None
        jsonl.write(record)
        progress.message(
            f"eval step {record['step']} epoch {record['epoch']:.2f}: "
            + " ".join(f"{k} {v:.4f}" for k, v in record["metrics"].items())
            + f" (train {record['train_time_s']:.1f}s, wall {record['wall_time_s']:.1f}s)"
        )
        if tb is not None:
            tb.scalars({f"eval/{k}": v for k, v in record["metrics"].items()}, record["step"])
        if mlperf is not None and tracker.primary in record["metrics"]:
            mlperf.eval(
                tracker.primary,
                record["metrics"][tracker.primary],
                record["epoch"],
                record["samples"],
            )

    preempt = PreemptionFlag().install()
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
        tracker=tracker,
        accumulation_steps=accum,
        micro_per_epoch=micro,
        epochs=t.epochs,
        max_steps=max_steps,
        world_size=env.world_size,
        batch_size=t.batch_size,
        preempt=preempt,
        on_eval=on_eval,
        on_log=on_log,
        checkpoint=lambda: checkpoints.save(state.step),
        grad_clip_norm=t.grad_clip_norm,
        eval_every_epochs=t.eval_every_epochs,
        eval_every_steps=t.eval_every_steps,
        checkpoint_every_epochs=t.checkpoint_every_epochs,
        checkpoint_every_steps=t.checkpoint_every_steps,
        stop_at_target=t.stop_at_target,
        limit_eval_batches=t.limit_eval_batches,
    )
    try:
        status = train(loop)
    finally:
        preempt.restore()
        progress.close()
    state.wall.stop()
    if main:
        result = _summary(
            cfg, status, state, tracker, precond, stages, env, device, steps_per_epoch
        )
        summary.write_summary(run_dir, result)
        _report(result, run_dir)
    if mlperf is not None:
        mlperf.run_stop(status)
        mlperf.close()
    if tb is not None:
        tb.close()
    return EXIT_CODES[status]


def _summary(
    cfg: DictConfig,
    status: str,
    state: TrainState,
    tracker: TargetTracker,
    precond: Any,
    stages: StageTimes,
    env: distributed.DistEnv,
    device: torch.device,
    steps_per_epoch: int,
) -> dict[str, Any]:
    reached = tracker.reached
    totals = stages.totals()
    train_s = state.train_clock.elapsed
    return {
        "name": cfg.name,
        "status": status,
        "target_metric": tracker.primary,
        "targets": tracker.targets,
        "target_value": tracker.targets.get(tracker.primary),
        "higher_is_better": tracker.higher_is_better,
        "reached_target": reached is not None,
        "time_to_target_s": reached["wall_time_s"] if reached else None,
        "train_time_to_target_s": reached["train_time_s"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "best_metric": tracker.best,
        "best_metric_epoch": tracker.best_record.get("epoch"),
        "final_metrics": tracker.last.get("metrics"),
        "steps": state.step,
        "epochs": state.step / steps_per_epoch,
        "samples": state.samples,
        "wall_time_s": state.wall.elapsed,
        "train_time_s": train_s,
        "mean_step_time_s": state.throughput.mean_step_time_s,
        "samples_per_s": state.throughput.samples_per_s,
        "kfac_enabled": precond is not None,
        "kfac_stage_times_s": totals,
        "kfac_time_fraction": (sum(totals.values()) / train_s) if totals and train_s > 0 else None,
        "kfac_memory_bytes": precond.memory_usage()
        if precond is not None and hasattr(precond, "memory_usage")
        else None,
        "peak_memory_bytes": summary.peak_memory_bytes(device),
        "world_size": env.world_size,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git_commit": summary.git_commit(),
        "torch_version": torch.__version__,
    }


def _report(result: dict[str, Any], run_dir: Path) -> None:
    metric = result["target_metric"]
    if result["reached_target"]:
        line = (
            f"time-to-target: {result['time_to_target_s']:.1f} s "
            f"({result['epochs_to_target']:.2f} epochs) for {metric} >= {result['target_value']}"
        )
    elif result["targets"]:
        line = (
            f"target {metric} {result['target_value']} not reached (best {result['best_metric']})"
        )
    else:
        line = f"no target set (best {metric} {result['best_metric']})"
    print(f"kfac-bench: {result['status']} | {line} | run dir {run_dir}", flush=True)
