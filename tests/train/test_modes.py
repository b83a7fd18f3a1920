"""The modes a user expects: ``train.mode=benchmark`` trains and times only (no evaluation, no checkpoint,
warm-up steps excluded, samples/s and step-time percentiles reported); ``mlperf.log`` only for MLPerf's
benchmarks unless asked for; ``kfac-bench --version``."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from kfac_bench.cli import main as cli_main
from kfac_bench.metrics.mlperf import MLPERF_FILE
from kfac_bench.metrics.timekeeping import StepTimer, percentile
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg

BENCH = ["train.mode=benchmark", "train.benchmark_warmup_steps=2", "train.benchmark_steps=9"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("bench")
    # 11 steps at 6 per epoch: the benchmark crosses an epoch end, where a training run evaluates.
    assert train(tiny_cfg(*BENCH, "train.mlperf_log=null"), run_dir) == 0
    return run_dir, ""


def test_benchmark_mode_runs_no_evaluation_and_writes_no_checkpoint(
    bench_run: tuple[Path, str],
) -> None:
    run_dir, _ = bench_run
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "success" and s["steps"] == 11
    evals = run_dir / "eval.jsonl"
    assert not evals.exists() or evals.read_text().strip() == ""
    assert s["final_metrics"] is None and s["best_metric"] is None
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert not (run_dir / MLPERF_FILE).exists()  # auto: a benchmark is not a timed MLPerf run


def test_benchmark_mode_reports_throughput_and_step_time_percentiles(
    bench_run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = bench_run
    b = json.loads((run_dir / "summary.json").read_text())["benchmark"]
    assert b["warmup_steps"] == 2 and b["timed_steps"] == 9 and b["samples"] == 9 * 32
    t = b["step_time_s"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"]
    # samples/s is the timed samples over the timed steps' total time.
    assert b["samples_per_s"] == pytest.approx(b["samples"] / (t["mean"] * b["timed_steps"]))


def test_the_benchmark_line_names_the_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    torch.set_num_threads(1)
    overrides = ["train.benchmark_warmup_steps=1", "train.benchmark_steps=2", "kfac=none"]
    assert train(tiny_cfg("train.mode=benchmark", *overrides), tmp_path) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("kfac-bench: success | benchmark: 2 steps timed after 1 warm-up: ")
    assert "samples/s, step time p50 " in last and " ms, p90 " in last and " ms, p99 " in last


def test_step_timer_excludes_the_warm_up() -> None:
    timer = StepTimer(warmup=2)
    clock = iter([0.0, 5.0, 9.0, 10.0, 10.5, 12.5])
    import kfac_bench.metrics.timekeeping as tracker

    real = tracker.time.perf_counter
    tracker.time.perf_counter = lambda: next(clock)  # type: ignore[assignment]
    try:
        timer.start()
        for _ in range(5):
            timer.tick(4)
    finally:
        tracker.time.perf_counter = real  # type: ignore[assignment]
    # Steps end at 5, 9 (warm-up), then 10, 10.5, 12.5: timed steps of 1, 0.5 and 2 s.
    s = timer.summary()
    assert s["warmup_steps"] == 2 and s["timed_steps"] == 3 and s["samples"] == 12
    assert s["samples_per_s"] == pytest.approx(12 / 3.5)
    assert s["step_time_s"]["p50"] == 1.0 and s["step_time_s"]["mean"] == pytest.approx(3.5 / 3)


def test_percentile_interpolates_like_numpy() -> None:
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    import numpy as np

    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize(
    ("overrides", "written"),
    [
        ((), False),  # digits is no MLPerf benchmark: its log would fail the checker (no ruleset)
        (("train.benchmark_name=resnet",), True),
        (("train.mlperf_log=true",), True),
        (("train.benchmark_name=resnet", "train.mlperf_log=false"), False),
    ],
    ids=["digits", "mlperf_name", "forced", "off"],
)
def test_mlperf_log_only_for_mlperf_benchmarks_by_default(
    tmp_path: Path, overrides: tuple[str, ...], written: bool
) -> None:
    torch.set_num_threads(1)
    cfg = tiny_cfg("kfac=none", "train.epochs=1", "train.limit_train_batches=2", *overrides)
    assert train(cfg, tmp_path) == 0
    assert (tmp_path / MLPERF_FILE).exists() is written


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out == f"kfac-bench {version('kfac-bench')}\n"
