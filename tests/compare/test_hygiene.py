"""What ``kfac-bench compare`` reads is finite, paired only by integer seeds, shown without the control
characters of the names it reads, found in time linear in the number of runs, and a run still going is
*running*: each case a summary or run folder as something other than the trainer could leave it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.cli import main as cli_main
from kfac_bench.compare import runs as runs_module
from kfac_bench.compare.plot import comparison_figure
from kfac_bench.compare.report import Comparison, find_runs, render
from kfac_bench.compare.runs import LOCK_FILE, RUNNING, read_run, run_dirs
from kfac_bench.launcher import rundir
from tests.compare.test_arms import curve, make_run


def _edit(run: Path, change: Any) -> None:
    summary = json.loads((run / "summary.json").read_text())
    change(summary)
    (run / "summary.json").write_text(json.dumps(summary))  # json.dumps writes NaN as NaN


def _pair(root: Path, **kfac_config: Any) -> tuple[Path, Path]:
    sgd = make_run(root / "sgd", seed=0, curve=curve(4), epoch_s=0.1, step_s=0.02)
    kfac = make_run(
        root / "kfac", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.03, kfac="comm_opt"
    )
    return sgd, kfac


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.update(time_to_target_s=float("nan")), "'time_to_target_s'"),
        (lambda s: s.update(epochs_to_target="NaN"), "'epochs_to_target'"),
        (lambda s: s.update(best_metric=float("inf")), "'best_metric'"),
        (lambda s: s.update(target_value=float("-inf")), "'target_value'"),
        (lambda s: s["final_metrics"].update(top1=float("nan")), "'final_metrics.top1'"),
        (lambda s: s.update(samples_per_s="NaN"), "'samples_per_s'"),
    ],
)
def test_a_non_finite_number_leaves_its_run_out_naming_file_and_field(
    tmp_path: Path, change: Any, named: str
) -> None:
    sgd, kfac = _pair(tmp_path)
    extra = make_run(
        tmp_path / "kfac1", seed=1, curve=curve(2), epoch_s=0.1, step_s=0.03, kfac="comm_opt"
    )
    _edit(extra, change)
    warnings: list[str] = []
    found = find_runs([sgd, kfac, extra], on_warning=warnings.append)
    assert [r.path for r in found] == [sgd, kfac]
    line = next(w for w in warnings if "summary.json" in w)
    assert line.startswith(f"{extra / 'summary.json'}: field {named}") and "finite" in line


def test_an_evaluation_record_with_a_non_finite_metric_is_an_unreadable_line(
    tmp_path: Path,
) -> None:
    sgd, _ = _pair(tmp_path)
    with (sgd / "eval.jsonl").open("a") as f:
        f.write('{"step": 999, "epoch": 31.0, "wall_time_s": 4.0, "metrics": {"top1": NaN}}\n')
    notes: list[str] = []
    run = read_run(sgd, notes.append)
    assert run is not None and len(run.evals) == 30
    assert notes and "1 unreadable line" in notes[0]


def test_a_boolean_seed_is_refused_and_a_string_seed_is_named_unpaired(tmp_path: Path) -> None:
    sgd, kfac = _pair(tmp_path)
    sgd1 = make_run(tmp_path / "sgd1", seed=1, curve=curve(4), epoch_s=0.1, step_s=0.02)
    kfac1 = make_run(
        tmp_path / "kfac1", seed=1, curve=curve(2), epoch_s=0.1, step_s=0.03, kfac="comm_opt"
    )
    _edit(kfac, lambda s: s["config"]["train"].update(seed=True))  # JSON true is not seed 1
    _edit(kfac1, lambda s: s["config"]["train"].update(seed="1"))
    warnings: list[str] = []
    found = find_runs([sgd, sgd1, kfac, kfac1], on_warning=warnings.append)
    assert [r.path for r in found] == [sgd, sgd1, kfac1]
    assert any(
        w.startswith(f"{kfac / 'summary.json'}: field 'config.train.seed' (must be an integer")
        for w in warnings
    )
    assert any(str(kfac1) in w and "not an integer" in w and "unpaired" in w for w in warnings)
    cmp = Comparison(found)
    assert cmp.groups[1].seeds == [None]  # the string seed pairs with nothing


def test_a_boolean_seed_in_the_config_of_a_run_without_summary_is_refused(tmp_path: Path) -> None:
    sgd, _ = _pair(tmp_path)
    (sgd / "summary.json").unlink()
    (sgd / "config.yaml").write_text("train:\n  seed: true\n  targets: {top1: 0.9}\n")
    warnings: list[str] = []
    assert read_run(sgd, warnings.append) is None
    assert warnings[0].startswith(f"{sgd / 'config.yaml'}: field 'config.train.seed'")


HOSTILE = "camp\x1b[2J\x07|x$y"


def test_control_characters_and_pipes_of_names_are_escaped_in_every_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    sgd, kfac = _pair(root)
    other = make_run(root / "other", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    for run in (sgd, kfac):
        _edit(run, lambda s: s.update(campaign="a"))
    _edit(other, lambda s: s.update(campaign=HOSTILE))
    found = find_runs([root], by_campaign=True)
    for fmt in ("terminal", "markdown"):
        text = render(found, fmt)
        assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J\\x07" in text
    table = [line for line in render(found, "markdown").splitlines() if line.startswith("|")]
    cells = {line.replace("\\|", "").count("|") for line in table}
    assert len(cells) == 1  # every row of the table has as many cells as its head
    comparison_figure(Comparison(found))  # `$` is no mathtext, control characters no glyph error
    assert cli_main(["compare", str(root), "--by-campaign", "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    written = (tmp_path / "out" / "compare.md").read_text()
    for shown in (out, err, written):
        assert "\x1b" not in shown and "\x07" not in shown
    # The refusal of mixed campaigns (a UserError) is escaped too.
    assert cli_main(["compare", str(root), "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b" in err and err.count("\n") == 1


def test_finding_runs_resolves_each_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 400
    for i in range(n):
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "summary.json").write_text("{}")
    calls = 0
    resolve = Path.resolve

    def counted(self: Path, strict: bool = False) -> Path:
        nonlocal calls
        calls += 1
        return resolve(self, strict)

    monkeypatch.setattr(Path, "resolve", counted)
    warnings: list[str] = []
    found = run_dirs([tmp_path, tmp_path / "run7"], warnings.append)
    assert len(found) == n and warnings == [f"{tmp_path / 'run7'}: left out: given twice"]
    assert calls <= n + 2  # linear: once per directory found, never once per pair


def test_a_run_that_holds_its_lock_is_running_not_broken(tmp_path: Path) -> None:
    assert LOCK_FILE == rundir.LOCK_FILE
    sgd, _ = _pair(tmp_path)
    (sgd / "summary.json").unlink()
    (sgd / "config.yaml").write_text(
        "train:\n  seed: 0\n  targets: {top1: 0.9}\ntask:\n  target_metric: top1\n"
    )
    rundir.lock(sgd)
    try:
        notes: list[str] = []
        run = read_run(sgd, notes.append)
        assert run is not None and run.summary["status"] == RUNNING
        assert "still running" in notes[0] and "did not end cleanly" not in notes[0]
    finally:
        rundir.release(sgd)
    notes = []
    run = read_run(sgd, notes.append)
    assert run is not None and run.summary["status"] == runs_module.NO_SUMMARY
    assert "did not end cleanly" in notes[0]


def test_a_chain_name_with_control_characters_and_pipes_is_escaped(tmp_path: Path) -> None:
    from kfac_bench.compare.chain import compare_chains, render_chains
    from tests.compare.test_chain import _chain

    runs = ",".join(str(p) for p in _chain(tmp_path / "a", (3.0, 4.0, 5.0), 91.0))
    chains = compare_chains([f"{HOSTILE}={runs}"], tmp_path / "out")
    for fmt in ("terminal", "markdown"):
        text = render_chains(chains, fmt)
        assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text
    rows = [ln for ln in render_chains(chains, "markdown").splitlines() if ln.startswith("|")]
    assert len({ln.replace("\\|", "").count("|") for ln in rows}) == 1
    assert "\x1b" not in (tmp_path / "out" / "chains.md").read_text()
