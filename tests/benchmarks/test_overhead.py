"""The overhead benchmark runs and reports what its table claims (no timing assertions)."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.overhead import _classification, measure, table
from kfac_bench.kfac import STAGES


def test_measure_reports_ratio_stages_and_eigh_check() -> None:
    torch.manual_seed(0)
    w = _classification(
        "tiny",
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)),
        (8, 3, 8, 8),
        5,
    )
    row = measure(w, factor_steps=1, inv_steps=2, cycles=2)
    assert row["ratio"] == row["kfac_step_s"] / row["sgd_step_s"] > 0
    assert set(row["stages_s_per_step"]) == set(STAGES)
    assert row["stages_s_per_step"]["factor"] > 0 and row["stages_s_per_step"]["decomposition"] > 0
    assert row["eigh_check"]["bare_eigh_s"] > 0
    text = table([row])
    assert "tiny" in text and "1/2" in text
