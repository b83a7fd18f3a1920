"""``train.tracker`` and TensorBoard's HParams, read back from what a real tiny run wrote: the MLflow store
(params, metrics per evaluation, time-to-target; a resumed run continues the same MLflow run), W&B's offline
files, and the HParams in the run's TensorBoard event file. Tests of a tracker whose library is not installed
are skipped (``pip install 'kfac-bench[tracking]'``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.errors import ConfigError
from kfac_bench.launcher.preflight import check_tracker
from kfac_bench.metrics.sinks import read_jsonl
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg

#: Met at the first evaluation, so the run has a time to target.
REACHED = ("train.targets.top1=0.0", "train.epochs=1")


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mlflow")
    run_dir = tmp_path_factory.mktemp("mlflow") / "run"
    cfg = tiny_cfg(*REACHED, "train.tracker=mlflow", "train.tensorboard=true")
    assert train(cfg, run_dir) == 0
    return run_dir


def _client(run_dir: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run_dir.resolve() / "mlruns").as_uri())


def test_mlflow_store_holds_the_config_the_eval_metrics_and_time_to_target(
    mlflow_run: Path,
) -> None:
    summary = json.loads((mlflow_run / "summary.json").read_text())
    client = _client(mlflow_run)
    experiment = client.get_experiment_by_name("kfac-bench")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == json.loads((mlflow_run / "tracker.json").read_text())["mlflow_run_id"]
    assert run.info.status == "FINISHED" and run.info.run_name == mlflow_run.name
    config = summary["config"]
    params = run.data.params
    assert float(params["optimizer.lr"]) == config["optimizer"]["lr"]
    assert params["kfac.enabled"] == "True" and int(params["train.seed"]) == config["train"]["seed"]
    assert run.data.tags["arm"] == "SGD + K-FAC (COMM-OPT)"
    records = read_jsonl(mlflow_run / "eval.jsonl")
    history = client.get_metric_history(run.info.run_id, "eval/top1")
    assert [(m.step, m.value) for m in history] == [
        (r["step"], r["metrics"]["top1"]) for r in records
    ]
    metrics = run.data.metrics
    assert summary["reached_target"] and metrics["summary/reached_target"] == 1.0
    assert metrics["summary/time_to_target_s"] == pytest.approx(summary["time_to_target_s"])
    assert metrics["summary/epochs_to_target"] == summary["epochs_to_target"]


def test_a_resumed_run_continues_its_mlflow_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    assert train(tiny_cfg("train.epochs=1", "train.tracker=mlflow"), run_dir) == 0
    first = json.loads((run_dir / "tracker.json").read_text())["mlflow_run_id"]
    assert train(tiny_cfg("train.epochs=2", "train.tracker=mlflow"), run_dir) == 0  # resumes
    client = _client(run_dir)
    (run,) = client.search_runs([client.get_experiment_by_name("kfac-bench").experiment_id])
    assert run.info.run_id == first
    steps = [m.step for m in client.get_metric_history(first, "eval/top1")]
    assert steps == [
        r["step"] for r in read_jsonl(run_dir / "eval.jsonl")
    ]  # both epochs, once each


def test_tensorboard_holds_the_runs_hparams_and_time_to_target(mlflow_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    summary = json.loads((mlflow_run / "summary.json").read_text())
    events = EventAccumulator(str(mlflow_run / "tb"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["arm"].string_value == "SGD + K-FAC (COMM-OPT)"
    assert hparams["optimizer.lr"].number_value == summary["config"]["optimizer"]["lr"]
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    tags = {m.name.tag for m in experiment.metric_infos}
    assert {"hparams/time_to_target_s", "hparams/epochs_to_target"} <= tags
    (point,) = events.Scalars("hparams/time_to_target_s")
    assert point.value == pytest.approx(summary["time_to_target_s"])
    assert point.step == summary["steps"]


def test_wandb_offline_files_hold_the_config_and_time_to_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    assert train(tiny_cfg(*REACHED, "train.tracker=wandb"), run_dir) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    # Recent wandb releases keep an offline run's config and summary only in its protobuf record log
    # (run-<id>.wandb, read by `wandb sync`), with no Python reader: its strings are stored as they are.
    (records,) = offline.glob("run-*.wandb")
    data = records.read_bytes()
    assert b"time_to_target_s" in data
    assert json.dumps(summary["time_to_target_s"]).encode() in data  # the value, as W&B's JSON
    assert b"optimizer.lr" in data


@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_tracker_whose_library_is_missing_is_refused_before_the_run(kind: str) -> None:
    import importlib.util

    if importlib.util.find_spec(kind) is not None:
        pytest.skip(f"{kind} is installed")
    with pytest.raises(ConfigError, match=f"train.tracker={kind} needs the {kind} package"):
        check_tracker(tiny_cfg(f"train.tracker={kind}"))
