"""``train.tracker`` and TensorBoard's HParams, read back from what a real tiny run wrote: the MLflow store
(params, metrics per evaluation, time-to-target; a resumed run continues the same MLflow run), W&B's offline
files, and the HParams in the run's TensorBoard event file; the run's record in MLflow (environment tags,
seed, config.yaml and summary.json as artifacts, names unique across sweeps); side channels that fail
mid-run (one warning, then off) or cannot be used at start (refused before training, a dead server within
seconds); a resume into another store. Tests of a tracker whose library is not installed are skipped
(``pip install 'kfac-bench[tracking]'``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.errors import ConfigError, UserError
from kfac_bench.launcher.preflight import check_tracker
from kfac_bench.metrics.sinks import TensorBoardSink, check_log_dir, read_jsonl
from kfac_bench.metrics.trackers import MLFLOW_HTTP_DEFAULTS, BestEffort, open_tracker
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg
from tests.limits import hang_limit

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
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"{mlflow_run.parent.name}/{mlflow_run.name}"
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


# --- run records ------------------------------------------------------------------------------------


def test_mlflow_run_carries_the_environment_seed_and_the_runs_files(mlflow_run: Path) -> None:
    summary = json.loads((mlflow_run / "summary.json").read_text())
    env = summary["environment"]
    client = _client(mlflow_run)
    (run,) = client.search_runs([client.get_experiment_by_name("kfac-bench").experiment_id])
    tags = run.data.tags
    assert tags["seed"] == str(summary["config"]["train"]["seed"])
    assert tags["env.host"] == env["host"] and tags["env.torch"] == env["torch"]
    assert tags["env.git_dirty"] == str(env["git_dirty"]) or env["git_dirty"] is None
    absent = [
        k for k, v in env.items() if v is None
    ]  # on this CPU machine: gpu, gpu_driver at least
    assert "gpu" in absent and not any(f"env.{k}" in tags for k in absent)
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(mlflow_run.parent / "dl")))
    for name in ("config.yaml", "summary.json"):
        assert (artifacts / name).read_bytes() == (mlflow_run / name).read_bytes(), name


def test_runs_named_alike_in_two_sweeps_get_distinct_tracker_names(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    store = (tmp_path / "shared").as_uri()
    config = {"train": {"seed": 0}, "kfac": {"enabled": False}, "optimizer": {"name": "sgd"}}
    for sweep in ("2026-12-01_10-00-00_aaaaaa", "2026-12-01_11-00-00_bbbbbb"):
        job = tmp_path / "multirun" / sweep / "0_digits_seed0"
        job.mkdir(parents=True)
        tracker = open_tracker("mlflow", job, config, store, "sweeps")
        assert tracker is not None
        tracker.finish(None, "success")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [
        "2026-12-01_10-00-00_aaaaaa/0_digits_seed0",
        "2026-12-01_11-00-00_bbbbbb/0_digits_seed0",
    ]


# --- best effort ------------------------------------------------------------------------------------


class _Flaky:
    """A tracker whose store fails from the second call on, counting the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    def metrics(self, values: Any, step: int) -> None:
        self.calls += 1
        if self.calls > 1:
            raise OSError(28, "No space left on device", "/store/metrics/eval/top1")

    def finish(self, summary: Any, status: Any) -> None:
        self.calls += 1


def test_a_failing_tracker_warns_once_and_is_off(capsys: pytest.CaptureFixture[str]) -> None:
    inner = _Flaky()
    tracker = BestEffort(inner, "train.tracker=mlflow")
    tracker.metrics({"eval/top1": 0.5}, 6)
    tracker.metrics({"eval/top1": 0.6}, 12)  # fails
    tracker.metrics({"eval/top1": 0.7}, 18)
    tracker.finish({"status": "success"}, "success")
    assert inner.calls == 2 and not tracker.active
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kfac-bench: warning: train.tracker=mlflow failed (OSError")
    assert "No space left on device" in line and "off for the rest of this run" in line


def test_tensorboard_writer_failing_mid_run_warns_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "tb"
    check_log_dir(log_dir, "train.tensorboard")  # usable at start
    sink = TensorBoardSink(log_dir)
    log_dir.rmdir()
    log_dir.write_text("not a folder")  # gone before the writer opens its event file
    sink.scalars({"train/loss": 1.0}, 1)
    sink.scalars({"train/loss": 0.9}, 2)
    sink.hparams({"arm": "SGD"}, {"time_to_target_s": 1.0}, 2)
    sink.close()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kfac-bench: warning: TensorBoard's writer failed") and sink.failed


# --- refusals at start ------------------------------------------------------------------------------


def test_an_unusable_tensorboard_dir_is_refused_before_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tb").write_text("a file where the event folder goes")
    with pytest.raises(UserError, match=r"tb cannot hold TensorBoard.*train\.tensorboard=false"):
        train(tiny_cfg("train.tensorboard=true"), run_dir)
    assert not (run_dir / "eval.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_an_unreachable_mlflow_server_is_refused_quickly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import socket
    import time

    pytest.importorskip("mlflow")
    for key in MLFLOW_HTTP_DEFAULTS:  # the tracker's own defaults, restored after the test
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError) as info:
        train(
            tiny_cfg("train.tracker=mlflow", f"train.tracker_uri=http://127.0.0.1:{port}"), tmp_path
        )
    # MLflow's own defaults (7 retries with back-off) take over four minutes here.
    assert time.monotonic() - started < hang_limit(30)
    message = str(info.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "start the server" in message
    assert not (tmp_path / "eval.jsonl").exists()
    # The refusal is the one line: urllib3's retry warnings do not reach the job's log (stdout).
    assert "Retrying" not in caplog.text


def test_a_resume_may_move_to_another_mlflow_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    assert train(tiny_cfg("train.epochs=1", "train.tracker=mlflow"), run_dir) == 0
    other = (tmp_path / "other").as_uri()
    cfg = tiny_cfg("train.epochs=2", "train.tracker=mlflow", f"train.tracker_uri={other}")
    assert train(cfg, run_dir) == 0  # resumes, in a new MLflow run of the other store
    saved = json.loads((run_dir / "tracker.json").read_text())
    assert saved["mlflow_uri"] == other
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=other)
    (run,) = client.search_runs([client.get_experiment_by_name("kfac-bench").experiment_id])
    assert run.info.run_id == saved["mlflow_run_id"] and run.info.status == "FINISHED"
    last = read_jsonl(run_dir / "eval.jsonl")[-1]["step"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/top1")] == [last]
