"""Batch arithmetic, in one place: global batch -> accumulation steps, examples -> steps per epoch.

``global batch = batch_size x world_size x accumulation_steps`` exactly: NVIDIA's BERT recipe and the TPDS
paper (§6.3.3) fix the global batch (65536 in phase 1, 32768 in phase 2), KAISA's Mask R-CNN runs fix 64
(KAISA Table 2); the local batch is what fits on a device, and accumulation makes up the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from kfac_bench.errors import ConfigError

__all__ = ["BatchLayout", "accumulation_steps", "batch_layout", "global_batch_note", "rank_batch"]


def accumulation_steps(
    batch_size: int, world_size: int, global_batch: int | None, default: int
) -> int:
    """Micro-batches per optimizer step: ``global_batch / (batch_size * world_size)``, or ``default`` when
    no global batch is set (e.g. local 64 on 16 GPUs for a global 65536 gives 64 micro-steps).

    Raises:
        ConfigError: a non-positive size, or ``global_batch`` not a multiple of ``batch_size * world_size``
            (the message names the nearest local batches that fit).
    """
    if global_batch is None:
        return default
    if min(global_batch, batch_size, world_size) < 1:
        raise ConfigError(
            f"batch sizes and world size must be positive, got train.global_batch_size={global_batch}, "
            f"train.batch_size={batch_size}, world_size={world_size}"
        )
    per_step = batch_size * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    if global_batch % world_size:
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not a multiple of world size {world_size}: "
            "choose a global batch or a number of processes that divides it"
        )
    per_rank = global_batch // world_size
    fits = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    below = max((d for d in fits if d < batch_size), default=None)
    above = min((d for d in fits if d > batch_size), default=None)
    options = " or ".join(str(d) for d in (below, above) if d is not None)
    raise ConfigError(
        f"train.global_batch_size={global_batch} is not a multiple of local batch {batch_size} x world "
        f"size {world_size} = {per_step}: use a train.batch_size that divides {per_rank}, e.g. {options}"
    )


@dataclass(frozen=True)
class BatchLayout:
    """How one epoch of one rank splits into micro-batches and optimizer steps.

    Attributes:
        batch_size: examples per micro-batch on one rank.
        world_size: ranks.
        accumulation_steps: micro-batches per optimizer step.
        micro_per_epoch: micro-batches one rank runs per epoch (a multiple of ``accumulation_steps``).
    """

    batch_size: int
    world_size: int
    accumulation_steps: int
    micro_per_epoch: int

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return self.micro_per_epoch // self.accumulation_steps

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step over all ranks."""
        return self.batch_size * self.accumulation_steps * self.world_size


def batch_layout(
    *,
    samples_per_rank: int,
    batch_size: int,
    world_size: int,
    global_batch: int | None = None,
    accumulation: int = 1,
    limit_micro_batches: int | None = None,
) -> BatchLayout:
    """The epoch layout for ``samples_per_rank`` training examples on each rank.

    Args:
        samples_per_rank: examples the training sampler gives one rank per epoch.
        batch_size: the per-rank micro-batch (``train.batch_size``).
        world_size: ranks.
        global_batch: ``train.global_batch_size``; derives the accumulation (see
            :func:`accumulation_steps`).
        accumulation: ``train.accumulation_steps``, used when ``global_batch`` is None.
        limit_micro_batches: ``train.limit_train_batches``: cut each epoch to this many micro-batches.

    Raises:
        ConfigError: the batch sizes do not fit (see :func:`accumulation_steps`), or an epoch holds no
            complete optimizer step.
    """
    accum = accumulation_steps(batch_size, world_size, global_batch, accumulation)
    micro = samples_per_rank // batch_size
    if limit_micro_batches is not None:
        micro = min(micro, limit_micro_batches)
    micro -= micro % accum
    if micro == 0:
        raise ConfigError(
            f"an epoch has no optimizer step: {samples_per_rank} examples per rank, batch_size "
            f"{batch_size}, accumulation {accum}"
        )
    return BatchLayout(batch_size, world_size, accum, micro)


def rank_batch(batch_size: int, world_size: int, global_batch: int | None) -> int:
    """The per-rank micro-batch: ``batch_size``, or each rank's share of ``global_batch`` where that share is
    smaller. A recipe that states its global batch keeps it on more ranks by splitting it (digits' 256 is
    128 per rank on 2, 64 on 4) and on fewer by accumulating (:func:`accumulation_steps`)."""
    if global_batch is None or world_size < 1 or global_batch % world_size:
        return batch_size
    return min(batch_size, global_batch // world_size)


def global_batch_note(
    *,
    global_batch: int,
    batch_size: int,
    accumulation: int,
    world_size: int,
    stated_global: int | None,
    lr_scales: bool,
) -> tuple[int, str]:
    """(the recipe's global batch, a note for the start line) for a run of ``global_batch`` on
    ``world_size`` ranks. A stated ``train.global_batch_size`` is the recipe's and is kept: no note. A
    recipe without one whose LR scales with the world size (``optimizer.scale_lr_with_world_size``, the
    papers' per-GPU batch and linear scaling rule, SC20 §VI-C1) grows both, as it says. Otherwise the
    recipe's global batch is its one-rank batch (``batch_size x accumulation``): more ranks (the user set
    ``train.global_batch_size=null``) make a larger batch at the same learning rate, and the note says so.
    """
    if stated_global is not None:
        return stated_global, ""
    if lr_scales:
        note = (
            f"global batch {global_batch} ({batch_size} per rank x {world_size} ranks), learning rate "
            f"x{world_size} (the recipe's rule: optimizer.scale_lr_with_world_size)"
        )
        return global_batch, note if world_size > 1 else ""
    recipe = batch_size * accumulation
    if global_batch == recipe:
        return recipe, ""
    return recipe, f"global batch {global_batch} (recipe: {recipe}), learning rate unchanged"
