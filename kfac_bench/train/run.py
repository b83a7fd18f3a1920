"""One run, in every rank: claim -> build -> resume -> loop -> report. :func:`train` is what ``kfac-bench
train`` calls (directly, or in each rank that ``launcher=torchrun`` or a launch script starts)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kfac_bench.checkpoint import elastic, warm_start
from kfac_bench.checkpoint.manager import CHECKPOINT_DIR
from kfac_bench.config.schema import RunConfig
from kfac_bench.data.batching import global_batch_note, rank_batch
from kfac_bench.data.loader import shutdown_workers
from kfac_bench.errors import UserError
from kfac_bench.launcher import distributed, rundir
from kfac_bench.launcher.signals import EXIT_REQUEUE, PreemptionFlag
from kfac_bench.metrics import summary
from kfac_bench.metrics.environment import run_environment
from kfac_bench.metrics.sinks import check_log_dir
from kfac_bench.metrics.summary import label_of_arm
from kfac_bench.metrics.trackers import Tracker, open_tracker
from kfac_bench.rank_zero import from_main
from kfac_bench.train.build import Run, build_run, seed_everything
from kfac_bench.train.loop import run_loop
from kfac_bench.train.warmup import warm_up

__all__ = ["EXIT_CODES", "open_side_channels", "train"]

#: Process exit status per run status. A diverged run is a result (status in summary.json), not a crash,
#: so it exits 0 and a torchrun restart does not replay it. A preempted rank under torchrun exits 0 too
#: (a failure would make torchrun restart it); the run directory's ``preempted`` marker says it stopped.
EXIT_CODES = {"success": 0, "target_not_reached": 0, "diverged": 0, "preempted": EXIT_REQUEUE}


def train(
    cfg: RunConfig,
    run_dir: Path,
    run_dir_from_rank_0: bool = False,
    on_claim: Callable[[Path], None] | None = None,
) -> int:
    """Train as configured, writing everything under ``run_dir``: claim -> build and resume
    (:func:`_prepare`) -> the loop (:func:`~kfac_bench.train.loop.run_loop`) -> report. Returns the
    process exit status. ``run_dir_from_rank_0`` (every rank passes the same): the ranks share rank 0's
    ``run_dir``. ``on_claim``: called with the run directory by the rank that claims it, right after.

    Raises:
        UserError: one line (the run directory is in use or records another config, no checkpoint is
            good, a checkpoint cannot be written); raised on every rank, printed by rank 0.
    """
    run_dir = Path(run_dir)
    started_at = time.time()  # the run's span in summary.json: compare checks the arms' schedule
    # Before anything slow: a preemption signal during setup is kept and honoured at the first step.
    flag = PreemptionFlag().install()
    env = distributed.detect()
    device = distributed.pick_device(str(cfg.train.device.value), env)
    status: str | None = None
    owns_lock = False
    try:
        distributed.setup(env, device)
        if run_dir_from_rank_0:
            run_dir = Path(from_main(str(run_dir.resolve())))
        owns_lock = _claim(cfg, run_dir, env, on_claim)
        ready = _prepare(cfg, run_dir, env, device, flag)
        if isinstance(ready, str):
            status = ready  # a finished run started again: nothing to train
        else:
            try:
                status = run_loop(ready.run.loop)
            finally:
                shutdown_workers(ready.run.loop.train_loader, ready.run.loop.eval_loader)
                ready.run.recorder.close(status)
            ready.run.loop.state.wall.stop()
            if env.is_main:
                span = {"started_at": started_at, "ended_at": time.time()}
                _report(ready, run_dir, env, device, status, span, flag)
    finally:
        flag.restore()
        distributed.cleanup(synchronize=status is not None)
        if owns_lock:
            rundir.release(run_dir)
    code = EXIT_CODES[status]
    if status == "preempted":
        code = 0 if env.elastic else code
        flag.hand_back()  # e.g. submitit's requeue, now that the checkpoint is written
    return code


def _claim(
    cfg: RunConfig,
    run_dir: Path,
    env: distributed.DistEnv,
    on_claim: Callable[[Path], None] | None = None,
) -> bool:
    """Rank 0 claims the run directory (unless its launcher holds it), then calls ``on_claim``; every
    rank learns the outcome. Returns whether this process took the lock."""
    error, took = None, False
    if env.is_main and not rundir.locked_by_launcher(run_dir):
        try:
            rundir.make_run_dir(run_dir)
            rundir.claim(run_dir, cfg)
            took = True
            if on_claim is not None:
                on_claim(run_dir)
        except UserError as exc:
            error = str(exc)
    error = from_main(error)
    if error is not None:
        raise UserError(error)
    return took


@dataclass
class _Ready:
    """A run built, resumed and warmed up, its clock not started: what the loop and the report need."""

    cfg: RunConfig
    run: Run
    #: The summary's batch facts (:func:`_batch_facts`).
    facts: dict[str, Any]


def _prepare(
    cfg: RunConfig,
    run_dir: Path,
    env: distributed.DistEnv,
    device: torch.device,
    flag: PreemptionFlag,
) -> _Ready | str:
    """Build the run, resume it from its newest good checkpoint (or warm-start it), print the start line,
    warm up and start the recorder. Returns the ready run, or the status of a finished run started again
    (nothing to train, nothing rewritten)."""
    init_from = cfg.train.init_from
    if init_from is not None and not (run_dir / CHECKPOINT_DIR).is_dir():
        warm_start.locate(init_from)  # a wrong path stops the run before anything is built
    # The world the run started with (world.json) when it resumes, this job's when it starts.
    starting = from_main(
        elastic.starting_world(run_dir, bool(cfg.train.resume), env.world_size)
        if env.is_main
        else None
    )
    given_batch = int(cfg.train.batch_size)
    cfg = _keep_global_batch(cfg, starting)
    elastic.check_kfac_world(cfg, env.world_size)
    tracker = open_side_channels(cfg, run_dir, env, device)
    try:
        run = build_run(
            cfg, run_dir, env, device, starting_world_size=starting, experiment_tracker=tracker
        )
    except BaseException:
        if tracker is not None:
            tracker.finish(None, None)  # the run never started: FAILED, not RUNNING forever
        raise
    facts = _batch_facts(cfg, run)
    loop, state = run.loop, run.loop.state
    loop.preempt = flag
    resumed = run.checkpoints.load() if cfg.train.resume else False
    if env.is_main:
        elastic.record_world(run_dir, run.world)
    if resumed and state.saved_world_size != env.world_size:
        # The generators restored are rank 0's (the saved ranks do not map onto these): draw apart again.
        seed_everything(
            elastic.rank_seed(int(cfg.train.seed), state.step, env.rank, env.world_size)
        )
    kept = from_main(_finished_summary(run_dir, loop) if env.is_main and resumed else None)
    if kept is not None:
        ended = str(kept["status"])
        run.recorder.leave(ended)
        if env.is_main:
            print(
                f"kfac-bench: run dir {run_dir} holds a finished run (step {state.step}): nothing to "
                "train and its summary.json is kept; raise train.epochs (or train.max_steps) to train on",
                flush=True,
            )
            print(summary.report_line(kept, run_dir), flush=True)
        return ended
    if not resumed and init_from is not None:
        started = warm_start.start_from(init_from, loop.module, loop.optimizer, loop.precond)
        if env.is_main:
            print(started, flush=True)
    if env.is_main:
        print(_start_line(cfg, run, run_dir, env, device, facts, given_batch, resumed), flush=True)
    if loop.step_timer is None:  # a benchmark has warm-up steps of its own
        warm_up(loop, run.stages)  # one step, untimed and undone: the clock counts training only
    # Records after the resumed step belong to a future this run no longer has: drop them.
    run.recorder.rewind(state.step)
    run.recorder.start(
        run.batches.global_batch,
        resumed,
        world={
            "world_size": env.world_size,
            "platform": run.recorder.mlperf.facts.platform,
            "gradient_accumulation_steps": run.batches.accumulation_steps,
        },
    )
    return _Ready(cfg, run, facts)


def _start_line(
    cfg: RunConfig,
    run: Run,
    run_dir: Path,
    env: distributed.DistEnv,
    device: torch.device,
    facts: dict[str, Any],
    given_batch: int,
    resumed: bool,
) -> str:
    """``kfac-bench: run dir R | world N on DEVICE | ARM | steps/epoch, global batch ...``."""
    state = run.loop.state
    moved = resumed and run.world.world_size != env.world_size
    return (
        f"kfac-bench: run dir {run_dir} | world {env.world_size} on {device} | "
        f"{_arm(cfg, run.loop.precond is not None)} | "
        f"{run.batches.steps_per_epoch} steps/epoch, "
        + (facts["global_batch_note"] or f"global batch {run.batches.global_batch}")
        + (
            f" ({run.batches.batch_size} per rank x {run.world.world_size}: "
            f"train.global_batch_size {cfg.train.global_batch_size} kept)"
            if run.batches.batch_size < given_batch
            else ""
        )
        + (f" | resumed at step {state.step}" if resumed else "")
        + (
            f" (run started on {run.world.world_size} ranks: "
            f"{run.batches.accumulation_steps} accumulation steps keep its global batch)"
            if moved
            else ""
        )
    )


def _report(
    ready: _Ready,
    run_dir: Path,
    env: distributed.DistEnv,
    device: torch.device,
    status: str,
    span: dict[str, float],
    flag: PreemptionFlag,
) -> None:
    """Rank 0, after the loop: ``summary.json`` and the report line, then a diverged or preempted run's
    marker (last: the checkpoint and summary are complete)."""
    run, loop = ready.run, ready.run.loop
    result = None
    try:
        result = _summarize(ready.cfg, run_dir, run, env, device, status, {**ready.facts, **span})
    finally:  # TensorBoard's HParams and the tracker get the summary; closed even if it failed
        run.recorder.finish(result, status)
    print(summary.report_line(result, run_dir), flush=True)
    if loop.divergence is not None:
        step, what = loop.divergence
        last = run.checkpoints.newest()
        rundir.mark_diverged(run_dir, step, what, last)
        print(
            f"kfac-bench: diverged at step {step} ({what}); kept "
            + (f"{last} as the last finite checkpoint" if last else "no checkpoint")
            + ": start a new run directory with a lower optimizer.lr",
            flush=True,
        )
    if status == "preempted":
        rundir.mark_preempted(run_dir, loop.state.step, flag.signum)


def open_side_channels(
    cfg: RunConfig, run_dir: Path, env: distributed.DistEnv, device: torch.device
) -> Tracker | None:
    """Before anything is built, rank 0 checks the TensorBoard folder (``train.tensorboard``) and opens
    the experiment tracker (``train.tracker``); a refusal (one line naming the fix) stops every rank.
    Returns the tracker on rank 0 (best effort from here on), None elsewhere."""
    tracker, error = None, None
    if env.is_main:
        try:
            if cfg.train.tensorboard:
                check_log_dir(run_dir / "tb", "train.tensorboard")
            kind = str(cfg.train.tracker.value)
            tracker = open_tracker(
                kind,
                run_dir,
                OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
                cfg.train.tracker_uri,
                cfg.train.tracker_project,
                environment=run_environment(device) if kind != "none" else None,
            )
        except UserError as exc:
            error = str(exc)
    error = from_main(error)
    if error is not None:
        raise UserError(error)
    return tracker


def _finished_summary(run_dir: Path, loop: Any) -> dict[str, Any] | None:
    """The summary of the finished run this resumed loop would only repeat the end of (its budget spent
    or its target met with ``stop_at_target``, the last step evaluated), or None: the loop has work, or
    there is no readable summary of that step to keep."""
    s = loop.state
    spent = s.epoch >= loop.epochs or s.step >= loop.max_steps
    stopped = loop.stop_at_target and loop.target_tracker.reached is not None
    if loop.step_timer is not None or not (spent or stopped) or s.last_eval_step != s.step:
        return None
    try:
        kept = summary.read_summary(run_dir)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(kept, dict) or kept.get("steps") != s.step:
        return None
    if kept.get("status") not in ("success", "target_not_reached"):
        return None
    try:
        summary.report_line(kept, run_dir)
    except (KeyError, TypeError, ValueError):
        return None  # not a summary this harness wrote: write a new one
    return kept


def _summarize(
    cfg: RunConfig,
    run_dir: Path,
    run: Run,
    env: distributed.DistEnv,
    device: torch.device,
    status: str,
    facts: dict[str, Any],
) -> dict[str, Any]:
    """Save the task's outputs, then write and return ``summary.json`` (rank 0) with ``facts`` (the
    batch's, and the span the run trained in) added."""
    loop, state = run.loop, run.loop.state
    save_outputs = getattr(loop.task, "save_outputs", None)  # optional (tasks/base.py)
    if save_outputs is not None:
        save_outputs(run_dir)
    result = summary.run_summary(
        name=cfg.name,
        status=status,
        tracker=loop.target_tracker,
        steps=state.step,
        steps_per_epoch=run.batches.steps_per_epoch,
        samples=state.samples,
        wall_time_s=state.wall.elapsed,
        train_time_s=state.train_clock.elapsed,
        throughput=state.throughput,
        stage_times_s=run.stages.totals(),
        precond=loop.precond,
        world_size=env.world_size,
        device=device,
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        divergence=loop.divergence,
    )
    result.update(facts)
    if loop.step_timer is not None:  # train.mode=benchmark
        result["benchmark"] = loop.step_timer.summary()
    summary.write_summary(run_dir, result)
    return result


def _keep_global_batch(cfg: RunConfig, world_size: int) -> RunConfig:
    """``cfg`` with each rank's micro-batch cut to its share of a stated global batch on ``world_size``
    ranks (the run's starting world), so that more ranks run the recipe's experiment, not a larger batch
    at the same learning rate (:func:`kfac_bench.data.batching.rank_batch`)."""
    t = cfg.train
    micro = rank_batch(int(t.batch_size), world_size, t.global_batch_size)
    if micro == t.batch_size:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.train.batch_size = micro
    return cfg


def _batch_facts(cfg: RunConfig, run: Run) -> dict[str, Any]:
    """``global_batch``, ``recipe_global_batch`` and ``global_batch_note`` (None: the recipe's batch) of
    ``summary.json``; the note is also the start line's."""
    b = run.batches
    recipe, note = global_batch_note(
        global_batch=b.global_batch,
        batch_size=b.batch_size,
        accumulation=int(cfg.train.accumulation_steps),
        world_size=run.world.world_size,
        stated_global=cfg.train.global_batch_size,
        lr_scales=bool(cfg.optimizer.scale_lr_with_world_size),
    )
    return {
        "global_batch": b.global_batch,
        "recipe_global_batch": recipe,
        "global_batch_note": note or None,
    }


def _arm(cfg: RunConfig, kfac_on: bool) -> str:
    """The run's arm as compare labels it: its optimizer and K-FAC strategy."""
    o = cfg.optimizer
    return label_of_arm(
        str(o.name.value), bool(o.nesterov), cfg.kfac.grad_worker_fraction if kfac_on else None
    )
