"""The overhead benchmark runs and reports what its table claims (no timing assertions)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.overhead import main, measure, parse_variant, table
from benchmarks.training_step import classification
from kfac_bench.kfac import STAGES


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_measure_reports_ratio_stages_floors_and_eigh_check() -> None:
    torch.manual_seed(0)
    w = classification("tiny", _tiny, (8, 3, 8, 8), 5)
    row = measure(
        w, factor_steps=1, inv_steps=2, cycles=2, variants=("exact", "factor_batch_fraction=0.5")
    )
    assert row["ratio"] == row["kfac_step_s"] / row["sgd_step_s"] > 0
    assert set(row["stages_s_per_step"]) == set(STAGES)
    assert row["stages_s_per_step"]["factor"] > 0 and row["stages_s_per_step"]["decomposition"] > 0
    assert row["eigh_check"]["bare_eigh_s"] > 0
    assert list(row["variants"]) == ["exact", "factor_batch_fraction=0.5"]
    for v in row["variants"].values():
        assert v["ratio"] == v["step_s"] / row["sgd_step_s"]
    assert row["variants"]["exact"]["stages_s_per_step"] == row["stages_s_per_step"]
    assert row["reference"] is None
    # Floors from the shapes: conv 3->4 (3x3, bias) on 8x8 gives 8·6·6 rows of A (28) and G (4), the
    # Linear 8 rows of A (145) and G (5); the preconditioning GEMMs 4·g·a·(g+a) per layer.
    fl, rate = row["floors_s_per_step"], row["gemm_flops_per_s"]
    factor_flops = 2 * 288 * (28**2 + 4**2) + 2 * 8 * (145**2 + 5**2)
    assert math.isclose(fl["factor"], factor_flops / rate)
    assert math.isclose(fl["precondition"], (4 * 4 * 28 * 32 + 4 * 5 * 145 * 150) / rate)
    assert math.isclose(fl["decomposition"], row["eigh_check"]["bare_eigh_s"] / 2)
    text = table([row])
    assert "tiny" in text and "1/2" in text and "fbf=0.5" in text


def test_quick_run_writes_a_consistent_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["--quick", "--rounds", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["threads"] == 1
    (row,) = data["results"]
    assert row["workload"] == "digits" and row["cycles"] == 3
    assert list(row["variants"]) == ["exact", "factor_batch_fraction=0.25"]
    assert set(row["floors_s_per_step"]) == {"factor", "decomposition", "precondition"}
    assert all(v > 0 for v in row["floors_s_per_step"].values())
    printed = capsys.readouterr().out
    assert "K-FAC/SGD" in printed and "floor" in printed and "reference" not in printed


def test_variant_specs_parse_to_engine_arguments() -> None:
    assert parse_variant("exact") == {}
    assert parse_variant("factor_batch_fraction=0.25,compute_method=inverse") == {
        "factor_batch_fraction": 0.25,
        "compute_method": "inverse",
    }
    assert parse_variant("inv_update_steps=5") == {"inv_update_steps": 5}
    with pytest.raises(ValueError, match="key=value"):
        parse_variant("fast")


def test_reference_without_kfac_pytorch_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--reference"):
        main(["--quick", "--reference", str(tmp_path / "nowhere")])
