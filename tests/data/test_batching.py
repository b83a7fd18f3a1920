"""Batch arithmetic: global batch -> accumulation steps, examples per rank -> optimizer steps per epoch."""

from __future__ import annotations

import pytest

from kfac_bench.data.batching import accumulation_steps, batch_layout
from kfac_bench.errors import ConfigError


@pytest.mark.parametrize(
    ("global_batch", "local_batch", "world_size", "steps"),
    [
        (65536, 64, 16, 64),  # BERT phase 1 on the paper's 16 A100 (TPDS §6.3.3)
        (65536, 128, 16, 32),
        (65536, 32, 128, 16),
        (32768, 16, 16, 128),  # phase 2
        (32768, 8, 8, 512),  # KAISA's phase 2: local 8 on 8 A100
        (32768, 32768, 1, 1),
        (256, 16, 4, 4),
    ],
)
def test_accumulation_makes_up_the_global_batch(
    global_batch: int, local_batch: int, world_size: int, steps: int
) -> None:
    assert accumulation_steps(local_batch, world_size, global_batch, default=1) == steps
    assert steps * local_batch * world_size == global_batch


def test_without_a_global_batch_the_configured_accumulation_is_kept() -> None:
    assert accumulation_steps(16, 4, None, default=3) == 3


def test_batches_that_do_not_fit_are_one_line_errors_naming_a_fix() -> None:
    # The paper's phase-1 local batch of 96 on 16 GPUs does not divide 65536 exactly.
    with pytest.raises(
        ConfigError, match=r"local batch 96 x world size 16 = 1536.*e\.g\. 64 or 128"
    ):
        accumulation_steps(96, 16, 65536, default=1)
    with pytest.raises(ConfigError, match="not a multiple of world size 3"):
        accumulation_steps(64, 3, 65536, default=1)
    with pytest.raises(ConfigError, match="must be positive"):
        accumulation_steps(0, 16, 65536, default=1)


def test_plan_counts_whole_optimizer_steps_per_epoch() -> None:
    # 1437 digits training examples on 2 ranks: 719 per rank (DistributedSampler pads), 22 batches of 32.
    layout = batch_layout(samples_per_rank=719, batch_size=32, world_size=2, accumulation=4)
    assert (layout.accumulation_steps, layout.micro_per_epoch, layout.steps_per_epoch) == (4, 20, 5)
    assert layout.global_batch == 32 * 4 * 2
    cut = batch_layout(samples_per_rank=719, batch_size=32, world_size=2, limit_micro_batches=7)
    assert (cut.micro_per_epoch, cut.steps_per_epoch) == (7, 7)
    derived = batch_layout(samples_per_rank=100, batch_size=8, world_size=1, global_batch=16)
    assert (derived.accumulation_steps, derived.micro_per_epoch, derived.steps_per_epoch) == (
        2,
        12,
        6,
    )


def test_an_epoch_without_a_step_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="an epoch has no optimizer step"):
        batch_layout(samples_per_rank=10, batch_size=8, world_size=1, accumulation=2)
