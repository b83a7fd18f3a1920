"""One run, in every rank: build -> resume -> loop -> report. :func:`train` is what ``kfac-bench train``
calls (directly, or in each rank that ``launcher=torchrun`` starts)."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kfac_bench.metrics import summary
from kfac_bench.train import distributed, warm_start
from kfac_bench.train.build import build_run
from kfac_bench.train.checkpoint import CHECKPOINT_DIR
from kfac_bench.train.loop import run_loop
from kfac_bench.train.signals import EXIT_REQUEUE

__all__ = ["EXIT_CODES", "train"]

#: Process exit status per run status. A diverged run is a result (status in summary.json), not a crash,
#: so it exits 0 and a torchrun restart does not replay it.
EXIT_CODES = {"success": 0, "target_not_reached": 0, "diverged": 0, "preempted": EXIT_REQUEUE}


def train(cfg: DictConfig, run_dir: Path) -> int:
    """Train as configured, writing everything under ``run_dir``; returns the process exit status."""
    env = distributed.detect()
    device = distributed.pick_device(str(cfg.train.device.value), env)
    distributed.setup(env, device)
    try:
        return _train(cfg, Path(run_dir), env, device)
    finally:
        distributed.cleanup()


def _train(cfg: DictConfig, run_dir: Path, env: distributed.DistEnv, device: torch.device) -> int:
    init_from = cfg.train.init_from
    if init_from is not None and not (run_dir / CHECKPOINT_DIR).is_dir():
        warm_start.locate(init_from)  # a wrong path stops the run before anything is built
    run = build_run(cfg, run_dir, env, device)
    loop, state = run.loop, run.loop.state

    resumed = run.checkpoints.load() if cfg.train.resume else False
    if not resumed and init_from is not None:
        started = warm_start.start_from(init_from, loop.module, loop.optimizer, loop.precond)
        if env.is_main:
            print(started, flush=True)
    if env.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        print(
            f"kfac-bench: run dir {run_dir} | world {env.world_size} on {device} | "
            f"kfac {'on' if loop.precond is not None else 'off'} | "
            f"{run.plan.steps_per_epoch} steps/epoch, global batch {run.plan.global_batch}"
            + (f" | resumed at step {state.step}" if resumed else ""),
            flush=True,
        )
    run.recorder.start(run.plan.global_batch, resumed)

    status: str | None = None
    loop.preempt.install()
    try:
        status = run_loop(loop)
    finally:
        loop.preempt.restore()
        run.recorder.close(status)
    state.wall.stop()

    if env.is_main:
        save_outputs = getattr(loop.task, "save_outputs", None)  # optional (tasks/base.py)
        if save_outputs is not None:
            save_outputs(run_dir)
        result = summary.run_summary(
            name=cfg.name,
            status=status,
            tracker=loop.tracker,
            steps=state.step,
            steps_per_epoch=run.plan.steps_per_epoch,
            samples=state.samples,
            wall_time_s=state.wall.elapsed,
            train_time_s=state.train_clock.elapsed,
            throughput=state.throughput,
            stage_times_s=run.stages.totals(),
            precond=loop.precond,
            world_size=env.world_size,
            device=device,
            config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        )
        summary.write_summary(run_dir, result)
        print(summary.report_line(result, run_dir), flush=True)
    return EXIT_CODES[status]
