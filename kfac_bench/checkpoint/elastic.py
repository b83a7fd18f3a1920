"""Resuming a run on another number of ranks: the same run, or a one-line refusal before training.

A run's *global batch* (examples per optimizer step over all ranks) and the world size it started with are
properties of the run, like its seed: a resume on ``N'`` ranks keeps both, as torchrun's elastic agent and
``torch.distributed.checkpoint`` users expect. It keeps the per-rank micro-batch (``train.batch_size``: it
sets what BatchNorm and K-FAC's factors see) and makes up the rest with gradient accumulation, so an
optimizer step still averages the gradient of the same ``global batch`` examples:

* accumulation steps ``global batch / (batch_size x N')``, which must be a whole number, otherwise the
  resume stops with one line naming the world sizes that keep it (before any rank is started under
  ``launcher=torchrun``; before training elsewhere);
* steps per epoch, the LR (its linear scaling and ``1 / world`` warm-up start), the K-FAC update intervals
  (``kfac.reference_world_size`` scaling) and every other hyperparameter stay those of the starting world;
* the data order continues at the example where the run stopped: the checkpoint records the position in
  the epoch's global order (:class:`kfac_bench.data.loader.ResumableSampler`), which any number of ranks
  continues from, so no example is repeated or skipped and the epoch ends where it would have;
* the K-FAC state is saved gathered (complete on every rank) and restored into the new world's layer
  assignment; ``kfac.grad_worker_fraction`` itself may not change (:mod:`kfac_bench.launcher.rundir`);
* the random generators of the new ranks are seeded from (seed, step, rank, world), distinct per rank;
* ``mlperf.log`` keeps its header (the run's global batch) and marks the resume with the new world size,
  platform and accumulation (``kfac_bench_resume``).

The starting world is recorded in ``<run dir>/world.json`` when a run starts from scratch (rank 0), read
when it resumes from a checkpoint, and checked against the checkpoint's own record (its train state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_bench import safe_files
from kfac_bench.errors import ConfigError

__all__ = [
    "WORLD_FILE",
    "World",
    "accumulation_for",
    "check_kfac_world",
    "check_launch",
    "rank_seed",
    "read_world",
    "record_world",
    "starting_world",
]

WORLD_FILE = "world.json"


@dataclass(frozen=True)
class World:
    """The world a run started with.

    Attributes:
        world_size: its ranks (the hyperparameters' world size, kept on resume).
        global_batch: examples per optimizer step over all ranks.
        batch_size: examples per micro-batch on one rank.
    """

    world_size: int
    global_batch: int
    batch_size: int


def read_world(run_dir: Path) -> World | None:
    """The world recorded in ``run_dir`` (None: none, or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / WORLD_FILE).read_text())
        return World(int(data["world_size"]), int(data["global_batch"]), int(data["batch_size"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def record_world(run_dir: Path, world: World) -> None:
    """Write ``world.json`` atomically."""
    safe_files.write_atomic(
        Path(run_dir) / WORLD_FILE, json.dumps(world.__dict__, sort_keys=True) + "\n"
    )


def _has_checkpoint(run_dir: Path) -> bool:
    from kfac_bench.checkpoint.files import candidates
    from kfac_bench.checkpoint.manager import CHECKPOINT_DIR

    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return False
    found, unreadable = candidates(folder)
    return bool(found or unreadable)


def starting_world(run_dir: Path, resume: bool, world_size: int) -> int:
    """The world size the run's hyperparameters use: the recorded one when the run will resume from a
    checkpoint, else ``world_size`` (this job's; a run without ``world.json``, from before it existed,
    too: its checkpoint then refuses another world size itself). Call on rank 0."""
    if resume and _has_checkpoint(run_dir):
        world = read_world(run_dir)
        if world is not None:
            return world.world_size
    return world_size


def valid_world_sizes(global_batch: int, batch_size: int) -> list[int]:
    """The numbers of ranks on which ``global_batch`` is a whole number of micro-batches."""
    per_rank_steps = global_batch // batch_size
    return [d for d in range(1, per_rank_steps + 1) if per_rank_steps % d == 0]


def accumulation_for(world: World, world_size: int) -> int:
    """Micro-batches per optimizer step on ``world_size`` ranks that keep the run's global batch.

    Raises:
        ConfigError: ``world_size`` cannot keep it (one line naming the world sizes that can).
    """
    per_step = world.batch_size * world_size
    if world.global_batch % per_step == 0:
        return world.global_batch // per_step
    sizes = valid_world_sizes(world.global_batch, world.batch_size)
    shown = ", ".join(str(n) for n in sizes[:-1]) + f" or {sizes[-1]}" if len(sizes) > 1 else "1"
    if len(sizes) > 12:
        shown = ", ".join(str(n) for n in sizes[:12]) + ", ..."
    raise ConfigError(
        f"this run has global batch {world.global_batch} (train.batch_size {world.batch_size} x "
        f"{_plural(world.world_size, 'rank')} x "
        f"{_plural(world.global_batch // (world.batch_size * world.world_size), 'accumulation step')}"
        f"), which {world_size} ranks cannot keep ({world.global_batch} is not a "
        f"multiple of {world.batch_size} x {world_size}): resume on {shown} "
        f"{'rank' if sizes == [1] else 'ranks'}, or start a new run"
    )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_launch(run_dir: Path, cfg: Any, world_size: int) -> None:
    """Refuse, before any rank starts, a resume on ``world_size`` ranks that cannot keep the run's
    global batch (the launching process of ``launcher=torchrun``).

    Raises:
        ConfigError: one line (see :func:`accumulation_for`).
    """
    check_kfac_world(cfg, world_size)
    if not cfg.train.resume or not _has_checkpoint(run_dir):
        return
    world = read_world(run_dir)
    if world is not None and world.world_size != world_size:
        accumulation_for(world, world_size)


def check_kfac_world(cfg: Any, world_size: int) -> None:
    """``kfac.grad_worker_fraction`` places on ``world_size`` ranks (its gradient workers per layer divide
    the world size): a run resumed on another world re-places the K-FAC state with the same fraction.

    Raises:
        ConfigError: one line naming the fractions that fit.
    """
    if not cfg.kfac.enabled:
        return
    from kfac_bench.kfac.assignment import grad_workers_per_layer

    try:
        grad_workers_per_layer(str(cfg.kfac.grad_worker_fraction), world_size)
    except ValueError as exc:
        raise ConfigError(f"kfac.{exc}") from None


def rank_seed(seed: int, step: int, rank: int, world_size: int) -> int:
    """A seed for rank ``rank``'s generators after a resume on ``world_size`` ranks at ``step``: distinct
    per rank, the same on every rerun of that resume."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, rank, world_size]).generate_state(1)[0])
