"""A run keeps its recipe's global batch on any number of ranks; where it does not (no stated global
batch), the start line and summary say how it differs and what the learning rate did."""

from __future__ import annotations

import pytest

from kfac_bench.config.compose import compose_run
from kfac_bench.data.batching import batch_layout, global_batch_note, rank_batch


@pytest.mark.parametrize(("world", "micro", "accum"), [(1, 256, 1), (2, 128, 1), (4, 64, 1)])
def test_digits_keeps_its_global_batch_of_256_on_1_2_and_4_ranks(
    world: int, micro: int, accum: int
) -> None:
    t = compose_run(["+recipe=digits"]).train
    batch = rank_batch(t.batch_size, world, t.global_batch_size)
    layout = batch_layout(
        samples_per_rank=-(-1437 // world),
        batch_size=batch,
        world_size=world,
        global_batch=t.global_batch_size,
        accumulation=t.accumulation_steps,
    )
    assert (layout.batch_size, layout.accumulation_steps, layout.global_batch) == (
        micro,
        accum,
        256,
    )
    assert layout.steps_per_epoch == 5  # the same optimizer steps per epoch as on one rank
    recipe, note = global_batch_note(
        global_batch=layout.global_batch,
        batch_size=batch,
        accumulation=t.accumulation_steps,
        world_size=world,
        stated_global=t.global_batch_size,
        lr_scales=False,
    )
    assert (recipe, note) == (256, "")


def test_a_stated_global_batch_is_made_up_by_accumulation_on_fewer_ranks() -> None:
    # Mask R-CNN's 64 (KAISA Table 2), 2 per GPU: 32 GPUs need no accumulation, 8 need 4 micro-batches.
    assert rank_batch(2, 8, 64) == 2
    assert (
        batch_layout(
            samples_per_rank=1000, batch_size=2, world_size=8, global_batch=64
        ).accumulation_steps
        == 4
    )
    assert rank_batch(2, 64, 64) == 1  # more GPUs than the batch's 32: one image each


def test_without_a_stated_global_batch_more_ranks_say_the_batch_grew_at_the_same_lr() -> None:
    recipe, note = global_batch_note(
        global_batch=512,
        batch_size=256,
        accumulation=1,
        world_size=2,
        stated_global=None,
        lr_scales=False,
    )
    assert recipe == 256
    assert note == "global batch 512 (recipe: 256), learning rate unchanged"


@pytest.mark.parametrize(
    "recipe", ["resnet32_cifar10", "resnet50_imagenet", "resnet50_imagenet_sgd"]
)
def test_the_papers_per_gpu_batch_and_linear_lr_rule_stays_the_papers(recipe: str) -> None:
    # SC20 §VI-C1: per-GPU batch 32 (ImageNet) / 128 (CIFAR-10), LR scaled by the number of GPUs.
    cfg = compose_run([f"+recipe={recipe}"])
    t = cfg.train
    assert t.global_batch_size is None and cfg.optimizer.scale_lr_with_world_size
    assert rank_batch(t.batch_size, 16, t.global_batch_size) == t.batch_size
    recipe_global, note = global_batch_note(
        global_batch=t.batch_size * 16,
        batch_size=t.batch_size,
        accumulation=1,
        world_size=16,
        stated_global=None,
        lr_scales=True,
    )
    assert recipe_global == t.batch_size * 16
    assert "learning rate x16" in note and f"{t.batch_size} per rank x 16 ranks" in note
