"""``kfac-bench compare`` on tiny real runs: table values, formats, the PNG, multirun folders."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import matplotlib.image
import pytest

from kfac_bench.compare.report import (
    COLUMNS,
    CSV_COLUMNS,
    RATIO_NOTE,
    find_runs,
    render,
    table_rows,
)
from kfac_bench.errors import UserError
from kfac_bench.train.run import train
from tests.compare.test_arms import arms
from tests.harness.util import run_cli, tiny_cfg


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    base, kfac = root / "sgd", root / "kfac"
    assert train(tiny_cfg("kfac=none", "train.targets.top1=0.0"), base) == 0
    assert train(tiny_cfg("kfac=comm_opt", "train.targets.top1=0.0"), kfac) == 0
    return base, kfac


def test_rows_compute_time_ratios_against_the_first_run(two_runs: tuple[Path, Path]) -> None:
    runs = find_runs(list(two_runs))
    rows = table_rows(runs)
    summaries = [json.loads((p / "summary.json").read_text()) for p in two_runs]
    base_t, kfac_t = summaries[0]["time_to_target_s"], summaries[1]["time_to_target_s"]
    assert rows[0]["time_ratio"] == pytest.approx(1.0)
    assert rows[1]["time_ratio"] == pytest.approx(kfac_t / base_t)
    assert rows[1]["kfac"] == "comm_opt" and rows[0]["kfac"] == "off"
    assert rows[1]["kfac_overhead_pct"] > 0 and rows[0]["kfac_overhead_pct"] is None
    assert rows[1]["mean_step_time_ms"] == pytest.approx(1000 * summaries[1]["mean_step_time_s"])


def test_formats(two_runs: tuple[Path, Path]) -> None:
    runs = find_runs(list(two_runs))
    sgd, kfac = "SGD", "SGD + K-FAC (COMM-OPT)"  # labelled by arm
    terminal = render(runs, "terminal").splitlines()
    assert "baseline: " + sgd in terminal[0]
    assert terminal[1].split() == ["arm", *sgd.split(), *kfac.split()]
    assert terminal[-1].startswith(f"verdict: {kfac} reached top1 >= 0 in 1/1 seeds")
    markdown = render(runs, "markdown").splitlines()
    assert markdown[2] == f"| arm | {sgd} | {kfac} |"
    # title, blank, header, rule, a row per measure, blank, the ratio's definition, blank, the verdict
    assert len(markdown) == 4 + len(COLUMNS) - 1 + 3 + 1
    assert markdown[-3] == f"*{RATIO_NOTE}*" and markdown[-1].startswith("**Verdict:** ")
    parsed = list(csv.DictReader(io.StringIO(render(runs, "csv"))))
    assert [r["run"] for r in parsed] == [sgd, kfac] and list(parsed[0]) == CSV_COLUMNS
    # One run per arm: no interval, so no claim; the baseline makes none.
    assert [(r["claim"], r["epochs_claim"]) for r in parsed] == [("none", "none")] * 2


def test_the_claim_columns_say_what_the_verdict_says(tmp_path: Path) -> None:
    # K-FAC reaches in 3 epochs of 0.1 s, SGD in 9 of 0.1 s, over 3 seeds: faster, fewer epochs.
    runs = find_runs(arms(tmp_path / "a", [(9, 0.1), (9, 0.11), (8, 0.1)], [(3, 0.1)] * 3))
    rows = list(csv.DictReader(io.StringIO(render(runs, "csv"))))
    assert [(r["claim"], r["epochs_claim"]) for r in rows] == [
        ("none", "none"),
        ("faster", "fewer"),
    ]
    assert "K-FAC faster on the clock" in render(runs, "terminal")
    # The other way round (K-FAC as slow in epochs, its steps dearer): slower, more epochs.
    slow = find_runs(arms(tmp_path / "b", [(3, 0.1)] * 3, [(9, 0.1), (9, 0.11), (8, 0.1)]))
    rows = list(csv.DictReader(io.StringIO(render(slow, "csv"))))
    assert [(r["claim"], r["epochs_claim"]) for r in rows][1] == ("slower", "more")
    # Identical arms: no claim either way, and a power figure from their spread instead.
    same = find_runs(
        arms(tmp_path / "c", [(5, 0.1), (5, 0.12), (5, 0.09)], [(5, 0.11), (5, 0.1), (5, 0.1)])
    )
    rows = list(csv.DictReader(io.StringIO(render(same, "csv"))))
    assert rows[1]["claim"] == "none" and int(rows[1]["seeds_for_power"]) >= 2
    assert "to detect a ratio of 0.9 with 80 % power: about" in render(same, "terminal")


@pytest.mark.slow
def test_cli_writes_table_and_a_png_that_opens(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    result = run_cli(
        "compare", *map(str, two_runs), "--out", "out", "--format", "markdown", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("**target: top1 0.0")
    image = matplotlib.image.imread(tmp_path / "out" / "compare.png")
    assert image.shape[0] > 100 and image.shape[1] > 200
    assert (tmp_path / "out" / "compare.csv").read_text().startswith("run,kfac,status")


@pytest.mark.slow
def test_missing_or_empty_paths_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        find_runs([tmp_path / "nope"])
    with pytest.raises(UserError, match="no run under"):
        find_runs([tmp_path])
    result = run_cli("compare", str(tmp_path / "nope"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
