"""A Hydra sweep over two arms and two seeds, run as a user runs it, is one folder that ``kfac-bench compare``
reads as one comparison of both arms; and the inputs compare refuses or leaves out (runs of different
targets, a summary field of the wrong type, ``--out`` naming a file) give one line, never a traceback."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from kfac_bench.cli import main as cli_main
from kfac_bench.compare.report import find_runs
from kfac_bench.errors import UserError
from tests.compare.test_arms import curve, make_run
from tests.harness.util import run_cli

#: Both digits arms cut to 3 steps and one evaluation each (the full recipes' models, so a few seconds).
SHORT = [
    "train.epochs=1",
    "train.limit_train_batches=3",
    "train.limit_eval_batches=2",
    "train.cpu_threads=1",
    "train.progress=none",
    "train.tensorboard=false",
    "train.targets.top1=0.0",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kfac-bench train -m +recipe=digits_sgd,digits train.seed=0,1`` with the default sweep folder."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = run_cli(
        "train", "-m", "+recipe=digits_sgd,digits", "train.seed=0,1", *SHORT, cwd=cwd, timeout=180
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return cwd


@pytest.mark.slow
def test_a_sweep_over_recipes_writes_one_folder_with_a_job_per_arm_and_seed(sweep: Path) -> None:
    (folder,) = (sweep / "runs" / "multirun").iterdir()
    jobs = sorted(p.name for p in folder.iterdir() if p.is_dir())
    # Numbered in the order they ran: a seed's arms back to back, the first arm alternating.
    assert jobs == ["0_digits_sgd_seed0", "1_digits_seed0", "2_digits_seed1", "3_digits_sgd_seed1"]
    assert all((folder / j / "summary.json").is_file() for j in jobs)
    # The sweep folder is the jobs' campaign: compare reads them as one comparison.
    campaigns = {json.loads((folder / j / "summary.json").read_text())["campaign"] for j in jobs}
    assert campaigns == {f"runs/multirun/{folder.name}"}


@pytest.mark.slow
def test_compare_of_the_sweep_folder_shows_both_arms_over_both_seeds(
    sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (folder,) = (sweep / "runs" / "multirun").iterdir()
    out = sweep / "cmp"
    assert cli_main(["compare", str(folder), "--out", str(out), "--format", "csv"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # two arms: no one-arm warning
    rows = list(csv.DictReader(io.StringIO(printed.out.split("wrote ")[0])))
    assert [r["run"] for r in rows] == ["SGD", "SGD + K-FAC (COMM-OPT)"]
    assert [r["seeds"] for r in rows] == ["0 1", "0 1"]
    assert [r["reached"] for r in rows] == ["2/2", "2/2"]


@pytest.mark.slow
def test_one_arm_alone_is_compared_with_a_warning(sweep: Path) -> None:
    (folder,) = (sweep / "runs" / "multirun").iterdir()
    warnings: list[str] = []
    runs = find_runs(
        [folder / "0_digits_sgd_seed0", folder / "3_digits_sgd_seed1"], on_warning=warnings.append
    )
    assert len(runs) == 2
    (line,) = warnings
    assert line.startswith("only one arm (SGD, 2 run(s))") and "nothing to compare" in line


def test_runs_with_different_targets_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    b = make_run(tmp_path / "b", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.02, kfac="comm_opt")
    summary = json.loads((b / "summary.json").read_text())
    # A SQuAD run among image runs: another metric, another scale.
    summary.update(target_metric="f1", targets={"f1": 90.1}, target_value=90.1)
    (b / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError, match="different targets") as err:
        find_runs([a, b])
    assert "top1 >= 0.9 in" in str(err.value) and "f1 >= 90.1 in" in str(err.value)
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different targets" in err
    assert not (tmp_path / "cmp" / "compare.md").exists()


def test_other_target_values_of_one_metric_are_refused_too(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    b = make_run(tmp_path / "b", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.02, kfac="comm_opt")
    summary = json.loads((b / "summary.json").read_text())
    summary.update(targets={"top1": 0.5}, target_value=0.5)
    (b / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError, match=r"top1 >= 0.9 in .*; top1 >= 0.5 in"):
        find_runs([a, b])


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("time_to_target_s", "fast", "'time_to_target_s' (must be a finite number"),
        ("config", ["sgd"], "'config' (must be a mapping"),
        ("final_metrics", {"top1": "high"}, "'final_metrics.top1' (must be a finite number"),
        ("reached_target", "yes", "'reached_target' (must be true or false"),
    ],
)
def test_a_wrongly_typed_summary_field_leaves_the_run_out_with_one_warning(
    tmp_path: Path, field: str, value: object, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_run(tmp_path / "runs" / "good", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    kfac = make_run(
        tmp_path / "runs" / "kfac", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.02, kfac="mem_opt"
    )
    bad = make_run(tmp_path / "runs" / "bad", seed=1, curve=curve(3), epoch_s=0.1, step_s=0.02)
    summary = json.loads((bad / "summary.json").read_text())
    summary[field] = value
    (bad / "summary.json").write_text(json.dumps(summary))
    warnings: list[str] = []
    runs = find_runs([good, kfac, bad], on_warning=warnings.append)
    assert [r.path for r in runs] == [good, kfac]
    (line,) = warnings
    assert line.startswith(f"{bad / 'summary.json'}: field {named}") and "left out" in line
    if field != "config":
        return  # one run of the command is enough
    assert cli_main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "cmp")]) == 0
    (shown,) = capsys.readouterr().err.splitlines()
    assert (
        shown.startswith("kfac-bench: warning: ") and named in shown and "bad/summary.json" in shown
    )


def test_non_finite_numbers_written_as_strings_leave_the_run_out(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    b = make_run(tmp_path / "b", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.02, kfac="comm_opt")
    summary = json.loads((b / "summary.json").read_text())
    summary["samples_per_s"] = "NaN"  # kfac-bench writes a non-finite number as null
    (b / "summary.json").write_text(json.dumps(summary))
    warnings: list[str] = []
    runs = find_runs([a, b], on_warning=warnings.append)
    assert [r.path for r in runs] == [a]
    assert warnings[0].startswith(f"{b / 'summary.json'}: field 'samples_per_s' (must be a finite")


def test_out_naming_a_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    assert cli_main(["compare", str(a), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out '{taken}' is a file" in err
    assert taken.read_text() == "mine\n"
    assert cli_main(["compare", "--chain", f"x={a},{a},{a}", "--out", str(taken)]) == 2
    assert f"--out '{taken}' is a file" in capsys.readouterr().err
