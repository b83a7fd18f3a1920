"""The planner's work is bounded: a world size above its documented maximum is one line and status 2 at
config time, before any model is built (a billion ranks once grew to 15 GB and was OOM-killed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_bench.cli import main
from kfac_bench.errors import ConfigError
from kfac_bench.plan.config import MAX_WORLD_SIZE, parse_plan_config


@pytest.mark.parametrize("sizes", ["[1000000000]", f"[8,{MAX_WORLD_SIZE + 1}]"])
def test_a_world_size_above_the_maximum_is_one_line_and_status_2(
    sizes: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status = main(["plan", f"plan.out={tmp_path}", f"plan.world_sizes={sizes}"])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: plan.world_sizes=")
    assert f"maximum of {MAX_WORLD_SIZE} ranks" in lines[0]
    assert not (tmp_path / "plan.json").exists()


def test_the_maximum_itself_is_accepted() -> None:
    assert parse_plan_config([f"world_sizes=[{MAX_WORLD_SIZE}]"]).world_sizes == [MAX_WORLD_SIZE]
    with pytest.raises(ConfigError):
        parse_plan_config([f"world_sizes=[{MAX_WORLD_SIZE + 1}]"])


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("bandwidth_gb_s=inf", "plan.bandwidth_gb_s=inf must be a finite number"),
        ("latency_us=nan", "plan.latency_us=nan must be a finite number"),
        ("memory_budget_gb=1e300", "plan.memory_budget_gb=1e+300 must be a finite number <= 1e+06"),
        ("kfac_epochs=0", "plan.kfac_epochs=0 must be >= 1"),
        ("baseline_max_steps=100000000000", "must be >= 1 and <= 10000000"),
        ("dataset_size=1000000000000000", "plan.dataset_size=1000000000000000 must be >= 1 and <="),
    ],
)
def test_every_plan_number_is_bounded(item: str, named: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        parse_plan_config([item])
    assert named in str(err.value) and "\n" not in str(err.value)
