"""The real ``kfac-bench`` command in a subprocess: help, one-line errors with status 2, the digits job in
both arms, and SIGTERM then resume giving the same result as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kfac_bench.launcher.signals import EXIT_REQUEUE
from tests.harness.fault_util import run, start
from tests.harness.util import TINY, cli_env, console_script, run_cli
from tests.limits import hang_limit

pytestmark = pytest.mark.slow


def test_help_lists_subcommands_and_config_groups(tmp_path: Path) -> None:
    top = subprocess.run(
        [console_script(), "--help"], capture_output=True, text=True, env=cli_env()
    )
    assert top.returncode == 0 and "train" in top.stdout and "compare" in top.stdout
    train = run_cli("train", "--help", cwd=tmp_path)
    assert train.returncode == 0
    for text in (
        "kfac ",
        "comm_opt*",
        "mem_opt",
        "hybrid_opt",
        "none",
        "optimizer",
        "lamb",
        "digits_smoke",
    ):
        assert text in train.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "+recipe=nope"], "unknown recipe 'nope'; valid names: "),
        (["train", "model=resnet9000"], "unknown model 'resnet9000'; valid names: "),
        (["train", "train.epochz=1"], "unknown config key 'train.epochz'"),
        (["train", "dataset.root=/nonexistent/digits"], "/nonexistent/digits/digits.csv.gz"),
        (["train", "-m", "kfac=none,bogus"], "unknown kfac 'bogus'"),
        (["fly"], "unknown command 'fly'; valid commands: train, compare"),
    ],
)
def test_bad_inputs_give_one_line_and_status_2(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("kfac", ["none", "comm_opt"])
def test_the_digits_job_trains_through_the_console_script_and_with_kfac(
    tmp_path: Path, kfac: str
) -> None:
    args = ["train", *TINY, f"kfac={kfac}", "train.targets.top1=0.2", "hydra.run.dir=run"]
    if kfac == "none":  # the installed console script, a fresh interpreter
        result = subprocess.run(
            [console_script(), *args],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=hang_limit(120),
        )
    else:  # the same entry point (kfac_bench.cli:main), forked from the warm server
        result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert "time-to-target:" in last and f"run dir {tmp_path / 'run'}" in last
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "success" and summary["kfac_enabled"] is (kfac != "none")
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    coverage = summary["kfac_coverage"]
    if kfac == "none":
        assert coverage is None
    else:
        # The digits CNN: two convolutions and two linear layers hold every trainable parameter.
        assert coverage["share"] == 1.0 and coverage["layers"] == 4, coverage
        assert "K-FAC preconditions 4 layers: 100.0%" in result.stdout + result.stderr


def _wait_for(path: Path, lines: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    end = time.monotonic() + hang_limit(timeout)
    while time.monotonic() < end and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not get {lines} lines (exit {proc.poll()})")


def test_sigterm_checkpoints_requeues_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    # Many short epochs so the signal lands mid-run; evaluation every 5 steps shows progress.
    args = [
        *TINY,
        "kfac.inv_update_steps=3",
        "train.epochs=6",
        "train.limit_train_batches=10",
        "train.eval_every_steps=5",
        "train.checkpoint_every_epochs=0",
    ]
    whole = run("train", *args, "hydra.run.dir=whole", cwd=tmp_path, env=cli_env())
    assert whole.returncode == 0, whole.stderr
    proc = start("train", *args, "hydra.run.dir=parts", cwd=tmp_path, env=cli_env())
    _wait_for(tmp_path / "parts" / "eval.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=hang_limit(60))
    assert proc.returncode == EXIT_REQUEUE, err
    stopped = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert stopped["status"] == "preempted" and 10 <= stopped["steps"] < 60
    resumed = run("train", *args, "hydra.run.dir=parts", cwd=tmp_path, env=cli_env())
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {stopped['steps']}" in resumed.stdout
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert b["steps"] == a["steps"] == 60 and b["samples"] == a["samples"]
    assert b["final_metrics"] == a["final_metrics"]
    assert b["train_time_s"] >= stopped["train_time_s"]


def test_multirun_sweep_then_compare_the_sweep_folder(tmp_path: Path) -> None:
    sweep = run_cli(
        "train",
        "-m",
        *TINY,
        "kfac=none,comm_opt",
        "train.targets.top1=0.0",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
        timeout=180,
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    result = run_cli("compare", "sweep", "--out", "cmp", "--format", "csv", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()
    # Labelled by arm; the first-order arm is the baseline.
    assert rows[1].startswith("SGD,off,success,") and rows[2].startswith(
        "SGD + K-FAC (COMM-OPT),comm_opt,success,"
    )
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
