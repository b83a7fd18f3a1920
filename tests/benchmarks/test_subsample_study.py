"""``benchmarks.subsample_study`` on a tiny budget: its tables come from real runs; no timing is asserted."""

from __future__ import annotations

import pytest
import torch

from benchmarks.digits_grid import Arm, Setting
from benchmarks.subsample_study import (
    RESNET_VARIANTS,
    digits_study,
    digits_table,
    resnet_study,
    resnet_table,
)


def test_digits_arms_pair_by_seed_and_the_fraction_changes_the_trajectory() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arms = [Arm(), Arm(True, 1, 10), Arm(True, 1, 10, factor_batch_fraction=0.25)]
        runs = digits_study(arms, [0], Setting(epochs=2, target=0.0))
    finally:
        torch.set_num_threads(threads)
    assert [r.arm for r in runs] == ["sgd", "kfac 1/10 d0.003", "kfac 1/10 d0.003 b0.25"]
    assert runs[1].top1 != runs[2].top1 or runs[1].step_times_s != runs[2].step_times_s
    table = digits_table(runs)
    assert "| kfac 1/10 d0.003 b0.25 | 1/1 | 1 [1–1] |" in table  # target 0: reached after epoch 1
    row = [c.strip() for c in table.splitlines()[4].split("|")]
    assert row[1] == "kfac 1/10 d0.003 b0.25" and row[6] in (
        "0/1",
        "1/1",
    )  # one race paired with SGD


@pytest.mark.slow
def test_resnet_variants_share_gradients_and_only_the_fractions_err() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        variants = [RESNET_VARIANTS[0], RESNET_VARIANTS[1], RESNET_VARIANTS[3], RESNET_VARIANTS[5]]
        stats = resnet_study(variants, steps=10, batch=4)
    finally:
        torch.set_num_threads(threads)
    assert stats["sgd"]["grad_error"] is None and stats["kfac exact"]["grad_error"] == 0.0
    for label in ("kfac b0.25", "kfac p0.25"):
        assert 0.0 < stats[label]["grad_error"] < 1.0, label
    assert all(len(s["step_s"]) == 10 for s in stats.values())
    assert "| kfac p0.25 |" in resnet_table(stats)
