"""Run folders no trainer writes, read by ``kfac-bench compare`` without a crash: files nested 100,000
deep, negative or absurd numbers, a baseline at 0 epochs, labels a spreadsheet would run as formulas, and
labels too long for the plot's legend."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from kfac_bench.cli import main as cli_main
from kfac_bench.compare.plot import comparison_figure
from kfac_bench.compare.report import Comparison, find_runs, render, table_rows
from kfac_bench.metrics.summary import read_summary, write_summary
from tests.compare.test_arms import curve, make_run

DEEP = 100_000


def _pair(root: Path) -> tuple[Path, Path]:
    sgd = make_run(root / "sgd", seed=0, curve=curve(4), epoch_s=0.1, step_s=0.02)
    kfac = make_run(
        root / "kfac", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.03, kfac="comm_opt"
    )
    return sgd, kfac


def test_a_summary_nested_100k_deep_leaves_its_run_out_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sgd, kfac = _pair(tmp_path / "runs")
    bad = make_run(tmp_path / "runs" / "deep", seed=1, curve=curve(3), epoch_s=0.1, step_s=0.02)
    summary = read_summary(bad)
    (bad / "summary.json").write_text("[" * DEEP + "]" * DEEP)
    warnings: list[str] = []
    runs = find_runs([sgd, kfac, bad], on_warning=warnings.append)
    assert [r.path for r in runs] == [sgd, kfac]
    (line,) = warnings
    assert (
        line
        == f"{bad / 'summary.json'}: nested deeper than 64 levels; left out (not a summary kfac-bench writes)"
    )
    # Valid JSON of a summary's shape, with a field nested deep inside: the same.
    (bad / "summary.json").write_text(
        json.dumps({**summary, "config": {}})[:-1] + ', "x": ' + "[" * 70 + "]" * 70 + "}"
    )
    assert len(find_runs([sgd, kfac, bad], on_warning=lambda _: None)) == 2
    assert cli_main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert "nested deeper" in capsys.readouterr().err


def test_an_evaluation_line_and_a_config_nested_100k_deep_are_unreadable_lines(
    tmp_path: Path,
) -> None:
    sgd, kfac = _pair(tmp_path)
    with (kfac / "eval.jsonl").open("a") as f:
        f.write("[" * DEEP + "]" * DEEP + "\n")
    (sgd / "summary.json").unlink()  # compared from eval.jsonl and the config
    (sgd / "config.yaml").write_text("a: " + "[" * DEEP + "]" * DEEP + "\n")
    other = make_run(tmp_path / "sgd1", seed=1, curve=curve(4), epoch_s=0.1, step_s=0.02)
    warnings: list[str] = []
    runs = find_runs([sgd, kfac, other], on_warning=warnings.append)
    assert [r.path for r in runs] == [kfac, other] and all("\n" not in w for w in warnings)
    assert any("kfac/eval.jsonl: 1 unreadable line(s) skipped" in w for w in warnings)
    assert f"{sgd}: no readable summary.json or config.yaml" in warnings[0]
    assert table_rows(runs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_to_target_s", -3.0),
        ("epochs_to_target", -1),
        ("mean_step_time_s", 1e12),
        ("steps", -5),
    ],
)
def test_negative_or_absurd_numbers_leave_the_run_out_named(
    tmp_path: Path, field: str, value: float
) -> None:
    sgd, kfac = _pair(tmp_path)
    bad = make_run(tmp_path / "bad", seed=1, curve=curve(3), epoch_s=0.1, step_s=0.02)
    write_summary(bad, {**read_summary(bad), field: value})
    warnings: list[str] = []
    runs = find_runs([sgd, kfac, bad], on_warning=warnings.append)
    assert [r.path for r in runs] == [sgd, kfac]
    (line,) = warnings
    assert line.startswith(f"{bad / 'summary.json'}: field '{field}' (must be between 0 and 1e+09")


def test_a_baseline_at_zero_epochs_gives_no_ratio_and_no_crash(tmp_path: Path) -> None:
    sgd, kfac = _pair(tmp_path)
    write_summary(sgd, {**read_summary(sgd), "epochs_to_target": 0, "time_to_target_s": 0.0})
    cmp = Comparison(find_runs([sgd, kfac]))
    _, row = cmp.rows()
    assert row["epochs_ratio"] is None and "1 run(s) at 0 left out" in row["ci_method"]
    (line,) = cmp.verdicts()
    assert "no clear difference in epochs (no run to compare)" in line


def test_formula_like_labels_are_quoted_in_the_csv(tmp_path: Path) -> None:
    sgd, kfac = _pair(tmp_path)
    for run, name in ((sgd, "=HYPERLINK(1)"), (kfac, "@SUM(1)")):
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(f"- name={name}\n")
    parsed = list(csv.DictReader(io.StringIO(render(find_runs([sgd, kfac]), "csv"))))
    assert [r["run"] for r in parsed] == ["'=HYPERLINK(1)", "'@SUM(1)"]
    assert float(parsed[1]["time_ratio"]) > 0  # numbers stay numbers


def test_long_labels_stay_inside_the_plot(tmp_path: Path) -> None:
    sgd, kfac = _pair(tmp_path)
    (kfac / ".hydra").mkdir()
    (kfac / ".hydra" / "overrides.yaml").write_text("- name=" + "a_very_long_arm_label_" * 6 + "\n")
    fig = comparison_figure(Comparison(find_runs([sgd, kfac])))
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert legend.x0 >= 0 and legend.x1 <= fig.bbox.x1
