"""What one comparison holds, on run folders written as the trainer writes them (configs composed from the
recipes, ``write_summary``, ``JsonlSink``): fairness flags from the tuning records (an untuned baseline,
values changed after tuning, no record), one campaign at a time (refused in one line, or compared by
campaign on request), benchmark-mode runs and repeated seeds left out and named, run directories without a
summary named, and where the files go."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kfac_bench.cli import main as cli_main
from kfac_bench.compare.fairness import MATCHED, SAME_DESIGN, run_flags
from kfac_bench.compare.report import Comparison, default_out, find_runs, table_rows
from kfac_bench.config.compose import compose_run
from kfac_bench.errors import UserError
from kfac_bench.metrics.summary import campaign, read_summary, write_summary
from tests.compare.test_arms import curve, make_run


def _config(*overrides: str) -> dict[str, Any]:
    """A run's config as ``summary.json`` holds it: composed, resolved, written out as JSON."""
    cfg = compose_run(list(overrides))
    return json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True), default=str))


def _run(
    path: Path, *overrides: str, reach: int | None = 3, epoch_s: float = 0.1, **summary: Any
) -> Path:
    """A digits run (the recipe's target lowered to what the curve reaches) with ``summary`` fields set."""
    config = _config(*overrides, "train.targets.top1=0.9")
    kfac = "comm_opt" if config["kfac"]["enabled"] else None
    step = 0.036 if kfac else 0.02
    make_run(
        path,
        seed=config["train"]["seed"],
        curve=curve(reach, 10),
        epoch_s=epoch_s,
        step_s=step,
        kfac=kfac,
        config=config,
    )
    if summary:
        write_summary(path, {**read_summary(path), **summary})
    return path


def _flags(path: Path) -> list[str]:
    return run_flags(read_summary(path), "baseline")


def test_a_baseline_at_the_kfac_recipes_lr_is_flagged_in_table_and_verdict(tmp_path: Path) -> None:
    # The documented mistake: +recipe=digits kfac=none runs SGD at K-FAC's tuned LR 0.8.
    dirs = [
        _run(tmp_path / f"{arm}{seed}", "+recipe=digits", f"train.seed={seed}", *extra)
        for seed in (0, 1)
        for arm, extra in (("sgd", ["kfac=none"]), ("kfac", []))
    ]
    cmp = Comparison(find_runs(dirs, on_warning=lambda _: None))
    flag = "baseline not tuned: LR 0.8 taken from the K-FAC recipe digits"
    base, kfac = cmp.rows()
    assert base["fairness"] == flag and kfac["fairness"] == f"{MATCHED}; {SAME_DESIGN}"
    (line,) = cmp.verdicts()
    assert line.endswith(f"; fairness: {flag}")


def test_tuned_recipes_raise_no_flag_and_changed_values_do(tmp_path: Path) -> None:
    sgd = _run(tmp_path / "sgd", "+recipe=digits_sgd")
    kfac = _run(tmp_path / "kfac", "+recipe=digits")
    assert _flags(sgd) == [] and _flags(kfac) == []
    # The row says what it checked, not "ok".
    base_row, kfac_row = table_rows(find_runs([sgd, kfac]))
    assert base_row["fairness"] == "tuning record present and matched"
    assert kfac_row["fairness"].startswith("tuning record present and matched; same dataset, model")
    # A first-order arm ignores the K-FAC damping its recipe inherits from digits; a K-FAC arm does not.
    damped = _run(tmp_path / "damped", "+recipe=digits", "kfac.damping=0.01")
    (flag,) = _flags(damped)
    assert flag.startswith("baseline not at its tuned values: kfac.damping 0.01 (tuned 0.003)")
    assert _flags(_run(tmp_path / "sgd_damped", "+recipe=digits_sgd", "kfac.damping=0.01")) == []
    (lr,) = _flags(_run(tmp_path / "lr", "+recipe=digits_sgd", "optimizer.lr=0.4"))
    assert "optimizer.lr 0.4 (tuned 0.1)" in lr
    (sched,) = _flags(_run(tmp_path / "ms", "+recipe=digits_sgd", "lr_schedule.milestones=[20]"))
    assert "lr_schedule.milestones [20] (tuned [25])" in sched
    # K-FAC at SGD's tuned values is unfair to K-FAC: flagged too.
    (kfac_at_sgd,) = _flags(_run(tmp_path / "k", "+recipe=digits_sgd", "kfac=comm_opt"))
    assert kfac_at_sgd == "baseline not tuned: LR 0.1 taken from the sgd recipe digits_sgd"


@pytest.mark.parametrize(
    ("override", "part", "key"),
    [
        ("dataset.val_fraction=0.3", "dataset", "dataset.val_fraction 0.3 (baseline 0.2)"),
        ("model.hidden=16", "model", "model.hidden 16 (baseline 64)"),
        ("train.epochs=12", "budget", "train.epochs 12 (baseline 30)"),
        ("train.max_steps=40", "budget", "train.max_steps 40 (baseline unset)"),
    ],
)
def test_an_arm_on_another_dataset_model_or_budget_is_flagged(
    tmp_path: Path, override: str, part: str, key: str
) -> None:
    dirs = [
        _run(tmp_path / f"{arm}{seed}", f"+recipe={recipe}", f"train.seed={seed}", *extra)
        for seed in (0, 1)
        for arm, recipe, extra in (("sgd", "digits_sgd", []), ("kfac", "digits", [override]))
    ]
    cmp = Comparison(find_runs(dirs, on_warning=lambda _: None))
    base, kfac = cmp.rows()
    assert base["fairness"] == MATCHED
    assert kfac["fairness"] == f"SGD + K-FAC (COMM-OPT) runs another {part}: {key}"
    (line,) = cmp.verdicts()
    assert line.endswith(f"; fairness: SGD + K-FAC (COMM-OPT) runs another {part}: {key}")
    # Where the data lives is not the data: another dataset.root raises no flag.
    moved = [
        _run(tmp_path / f"m{arm}", f"+recipe={recipe}", *extra)
        for arm, recipe, extra in (("sgd", "digits_sgd", []), ("k", "digits", ["dataset.root=x"]))
    ]
    assert not Comparison(find_runs(moved, on_warning=lambda _: None)).flags[1]


def test_a_recipes_own_name_makes_an_arm_and_no_run_is_dropped(tmp_path: Path) -> None:
    # A copy of the digits recipe under another name: the same optimizer and strategy, two arms.
    dirs = [
        _run(tmp_path / f"{name}{seed}", "+recipe=digits", f"train.seed={seed}", f"name={name}")
        for seed in (0, 1, 2)
        for name in ("digits", "digits_copy")
    ]
    # Written as a recipe's name (the summary's config), not given on a command line.
    assert not any((d / ".hydra").exists() for d in dirs)
    warnings: list[str] = []
    runs = find_runs(dirs, on_warning=warnings.append)
    assert len(runs) == 6 and not warnings
    cmp = Comparison(runs)
    assert [g.label for g in cmp.groups] == ["digits", "digits_copy"]
    assert [len(g.runs) for g in cmp.groups] == [3, 3]


def test_a_run_without_a_tuning_record_is_flagged(tmp_path: Path) -> None:
    run = _run(tmp_path / "a", "+recipe=digits_sgd", "tuning.source=null")
    (flag,) = _flags(run)
    assert flag.startswith("baseline has no tuning record (tuning.source unset)")


def test_two_campaigns_are_refused_in_one_line_or_compared_as_separate_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    for c in ("2026-12-01_sweep_a1b2c3", "2026-12-02_sweep_d4e5f6"):
        for seed in (0, 1):
            for recipe in ("digits_sgd", "digits"):
                _run(
                    root / c / f"{recipe}_seed{seed}",
                    f"+recipe={recipe}",
                    f"train.seed={seed}",
                    campaign=f"runs/multirun/{c}",
                )
    with pytest.raises(UserError) as err:
        find_runs([root])
    text = str(err.value)
    assert "\n" not in text and text.startswith("runs of 2 campaigns in one comparison: ")
    assert "'2026-12-01_sweep_a1b2c3' (4 run(s)" in text and "'2026-12-02_sweep_d4e5f6'" in text
    assert "--by-campaign" in text
    assert cli_main(["compare", str(root)]) == 2
    err_line = capsys.readouterr().err
    assert err_line.count("\n") == 1 and "campaigns" in err_line
    runs = find_runs([root], by_campaign=True)
    labels = [g.label for g in Comparison(runs).groups]
    assert labels[0] == "SGD @ 2026-12-01_sweep_a1b2c3"  # the first first-order arm
    assert set(labels) == {
        "SGD @ 2026-12-01_sweep_a1b2c3",
        "SGD + K-FAC (COMM-OPT) @ 2026-12-01_sweep_a1b2c3",
        "SGD @ 2026-12-02_sweep_d4e5f6",
        "SGD + K-FAC (COMM-OPT) @ 2026-12-02_sweep_d4e5f6",
    }
    assert all(len(g.runs) == 2 for g in Comparison(runs).groups)


def test_benchmark_runs_repeated_seeds_and_runs_without_a_summary_are_named(
    tmp_path: Path,
) -> None:
    root = tmp_path / "runs"
    for seed in (0, 1):
        _run(root / f"a_sgd{seed}", "+recipe=digits_sgd", f"train.seed={seed}")
        _run(root / f"b_kfac{seed}", "+recipe=digits", f"train.seed={seed}")
    again = _run(root / "c_sgd0_again", "+recipe=digits_sgd", "train.seed=0", epoch_s=0.5)
    bench = _run(
        root / "d_bench",
        "+recipe=digits",
        "train.mode=benchmark",
        reach=None,
        benchmark={"timed_steps": 10},
    )
    started = root / "e_started"
    started.mkdir()
    (started / "config.yaml").write_text("name: digits\n")
    warnings: list[str] = []
    runs = find_runs([root], on_warning=warnings.append)
    assert sorted(r.path.name for r in runs) == ["a_sgd0", "a_sgd1", "b_kfac0", "b_kfac1"]
    assert len(warnings) == 3 and all("\n" not in w for w in warnings)
    assert warnings[0].startswith(f"{started}: left out: no summary.json or eval.jsonl")
    assert "left out 1 train.mode=benchmark run(s)" in warnings[1] and str(bench) in warnings[1]
    assert warnings[2].startswith(f"{again}: left out: SGD seed 0 is also '{root / 'a_sgd0'}'")
    (row,) = table_rows(runs)[:1]
    assert row["seeds"] == "0 1" and row["reached"] == "2/2"


def test_a_run_given_twice_is_read_once(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", "+recipe=digits_sgd")
    b = _run(tmp_path / "b", "+recipe=digits")
    warnings: list[str] = []
    runs = find_runs([a, b, a], on_warning=warnings.append)
    assert len(runs) == 2 and warnings == [f"{a}: left out: given twice"]


def test_the_campaign_is_train_campaign_else_none() -> None:
    # A sweep's jobs get their folder as train.campaign when they are composed (tests/config/test_jobs.py).
    assert campaign({"train": {"campaign": None}}) is None
    assert campaign({"train": {}}) is None
    assert campaign({"train": {"campaign": "lr-study"}}) == "lr-study"


def test_output_goes_into_a_new_folder_inside_the_compared_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "sweep"
    _run(root / "sgd", "+recipe=digits_sgd")
    _run(root / "kfac", "+recipe=digits")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli_main(["compare", str(root)]) == 0
    assert cli_main(["compare", str(root)]) == 0
    capsys.readouterr()
    outs = sorted(p for p in root.iterdir() if p.name.startswith("compare_"))
    assert len(outs) == 2  # the second comparison did not overwrite the first
    assert all((o / "compare.md").is_file() and (o / "compare.png").is_file() for o in outs)
    assert list(elsewhere.iterdir()) == []
    # Run directories given one by one: their folder. The current directory itself: runs/ in it.
    assert default_out([root / "sgd", root / "kfac"]).parent == root.resolve()
    monkeypatch.chdir(root)
    assert default_out(["sgd", "kfac"]).parent == Path("runs")
    assert not os.path.exists(root / "runs")  # computed, not made
