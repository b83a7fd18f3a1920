"""A tracker is a side channel: when its store breaks mid-run (full, read-only), the run says so in one
warning line and goes on without it; its records, checkpoints, summary and exit status (0, or 75 with the
``preempted`` marker) are what they would have been. Real CLI runs of the tiny digits job with
``train.tracker=mlflow`` and a fault hook that breaks the store (tests/harness/faulty.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.launcher.rundir import PREEMPTED_FILE
from tests.harness.fault_util import eval_steps, fault, run, summary
from tests.harness.util import TINY

pytestmark = pytest.mark.slow


def _checkpoint_step(run_dir: Path) -> int:
    saved = CheckpointManager(run_dir / CHECKPOINT_DIR, {}).read()
    assert saved is not None
    return int(saved["step"])


def _warnings(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if "train.tracker=mlflow failed" in line]


def test_a_full_store_mid_run_is_one_warning_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store back here
    run_dir = tmp_path / "run"
    result = run(
        "train",
        *TINY,
        "train.tracker=mlflow",
        "hydra.run.dir=run",
        *fault(tmp_path / "fault", at=3, action="store-ENOSPC", store=run_dir / "mlruns"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (warning,) = _warnings(result.stderr)
    assert warning.startswith("kfac-bench: warning: ") and "No space left on device" in warning
    assert eval_steps(run_dir) == [6, 12]
    s = summary(run_dir)
    assert s["status"] in ("success", "target_not_reached") and s["steps"] == 12
    assert _checkpoint_step(run_dir) == 12

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("kfac-bench").experiment_id])
    # The store broke at step 3, before the first evaluation: it holds none, and the run was not ended.
    assert client.get_metric_history(mlflow_run.info.run_id, "eval/top1") == []
    assert mlflow_run.info.status == "RUNNING"


def test_preemption_with_a_read_only_store_still_exits_75_with_the_marker(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    result = run(
        "train",
        *TINY,
        "train.tracker=mlflow",
        "hydra.run.dir=run",
        *fault(tmp_path / "fault", at=3, action="store-EROFS+TERM", store=run_dir / "mlruns"),
        cwd=tmp_path,
    )
    assert result.returncode == 75, result.stderr[-3000:]
    (warning,) = _warnings(result.stderr)
    assert "Read-only file system" in warning and "run dir" not in warning
    s = summary(run_dir)
    assert s["status"] == "preempted" and s["steps"] == 3
    assert (run_dir / PREEMPTED_FILE).read_text().startswith("step 3 ")
    assert _checkpoint_step(run_dir) == 3
