"""Experiment trackers a run can also log to (``train.tracker=mlflow`` or ``wandb``, rank 0 only), and the
HParams summary of TensorBoard.

Each tracker gets the run's config as parameters (flattened: ``optimizer.lr``, ``kfac.grad_worker_fraction``,
...), every evaluation's metrics (``eval/<metric>`` at the optimizer step), and when the run ends its
time-to-target and throughput (:data:`SUMMARY_METRICS`; a measure that does not apply, such as the time of a
run that missed its target, is left out). Runs of every arm go to one MLflow experiment / W&B project
(``train.tracker_project``), labelled with their arm (``kfac_bench.metrics.summary.arm_label``), so they
compare there side by side.

- MLflow (``pip install 'kfac-bench[tracking]'``): ``train.tracker_uri`` (any MLflow tracking URI: a server,
  ``sqlite:///...``, a ``file:`` store) or, by default, a file store in the run directory (``mlruns/``:
  ``mlflow ui --backend-store-uri runs/<run>/mlruns``). MLflow 3 keeps its file store only on request, so
  kfac-bench sets ``MLFLOW_ALLOW_FILE_STORE=true`` for a ``file:`` store (unless it is set already). A resumed
  run continues the same MLflow run (its id is kept in ``tracker.json`` in the run directory).
- Weights & Biases: offline (``WANDB_MODE=offline`` unless set; ``wandb sync runs/<run>/wandb`` uploads it),
  its files under ``train.tracker_uri`` or the run directory; a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kfac_bench import safe_files
from kfac_bench.config import flat_config
from kfac_bench.errors import UserError
from kfac_bench.metrics.summary import arm_label

__all__ = [
    "SUMMARY_METRICS",
    "TRACKER_FILE",
    "MLflowTracker",
    "Tracker",
    "WandbTracker",
    "hparams",
    "open_tracker",
    "summary_metrics",
]

#: The run's id in its tracker, so that a resumed run continues it.
TRACKER_FILE = "tracker.json"
#: What a tracker gets from ``summary.json`` when the run ends (as ``summary/<key>``).
SUMMARY_METRICS = (
    "time_to_target_s",
    "train_time_to_target_s",
    "epochs_to_target",
    "steps_to_target",
    "reached_target",
    "best_metric",
    "wall_time_s",
    "train_time_s",
    "mean_step_time_s",
    "samples_per_s",
    "kfac_time_fraction",
)
#: Config keys that are not parameters of the run (where it writes, how it shows progress).
_NOT_PARAMS = ("dataset.root", "train.progress", "train.tracker_uri", "launcher.*")


class Tracker(Protocol):
    def metrics(self, values: Mapping[str, float], step: int) -> None: ...

    def finish(self, summary: Mapping[str, Any] | None, status: str | None) -> None: ...


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as ``summary.json`` holds it (enums as their values)."""
    plain: dict[str, Any] = json.loads(json.dumps(config, default=str))
    return plain


def params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config as flat parameters (lists and None as text)."""
    flat = flat_config(_plain(config), _NOT_PARAMS)
    return {
        k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flat.items()
    }


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """:data:`SUMMARY_METRICS` of a run's summary that have a finite value (booleans as 0/1)."""
    out = {}
    for key in SUMMARY_METRICS:
        value = summary.get(key)
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """TensorBoard HParams values: the flat parameters plus the arm's label."""
    return {"arm": _arm(config), **params(config)}


def _arm(config: Mapping[str, Any]) -> str:
    config = _plain(config)
    enabled = bool((config.get("kfac") or {}).get("enabled", False))
    return arm_label({"kfac_enabled": enabled, "config": config})


def _saved_id(run_dir: Path, key: str) -> str | None:
    try:
        value = json.loads((run_dir / TRACKER_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def _save_id(run_dir: Path, key: str, value: str) -> None:
    safe_files.write_atomic(run_dir / TRACKER_FILE, json.dumps({key: value}) + "\n")


class MLflowTracker:
    """One MLflow run per kfac-bench run (continued on resume), through ``MlflowClient``.

    Raises:
        UserError: mlflow is not installed, or the tracking store cannot be opened.
    """

    def __init__(
        self, run_dir: Path, config: Mapping[str, Any], uri: str | None, project: str
    ) -> None:
        try:
            from mlflow.entities import Param, RunTag
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserError(
                "train.tracker=mlflow needs MLflow: pip install 'kfac-bench[tracking]' "
                "(or mlflow-skinny), or set train.tracker=none"
            ) from None
        self.run_dir = Path(run_dir)
        uri = uri or (self.run_dir.resolve() / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = _saved_id(self.run_dir, "mlflow_run_id")
            if run_id is None:
                experiment = self.client.get_experiment_by_name(project)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(project)
                )
                run = self.client.create_run(experiment_id, run_name=self.run_dir.name)
                run_id = run.info.run_id
                flat = params(config)
                items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
                for i in range(0, len(items), 100):  # MLflow takes at most 100 per batch
                    self.client.log_batch(run_id, params=items[i : i + 100])
                tags = [RunTag("arm", _arm(config)), RunTag("run_dir", str(self.run_dir))]
                self.client.log_batch(run_id, tags=tags)
                _save_id(self.run_dir, "mlflow_run_id", run_id)
            else:
                self.client.update_run(run_id, status="RUNNING")
        except UserError:
            raise
        except Exception as exc:  # MlflowException, OSError, ...: one line either way
            raise UserError(
                f"train.tracker=mlflow: cannot open the MLflow store at '{uri}' ({exc}); "
                "set train.tracker_uri to a reachable store"
            ) from None
        self.run_id = run_id
        self.uri = uri

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in values.items() if math.isfinite(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, summary: Mapping[str, Any] | None, status: str | None) -> None:
        if summary is not None:
            step = int(summary.get("steps") or 0)
            self.metrics({f"summary/{k}": v for k, v in summary_metrics(summary).items()}, step)
            self.client.set_tag(self.run_id, "status", str(summary.get("status")))
        ended = {"success": "FINISHED", "target_not_reached": "FINISHED", "preempted": "KILLED"}
        self.client.set_terminated(self.run_id, status=ended.get(str(status), "FAILED"))


class WandbTracker:
    """One W&B run per kfac-bench run, offline unless ``WANDB_MODE`` is set (continued on resume).

    Raises:
        UserError: wandb is not installed.
    """

    def __init__(
        self, run_dir: Path, config: Mapping[str, Any], uri: str | None, project: str
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(
                "train.tracker=wandb needs Weights & Biases: pip install wandb, "
                "or set train.tracker=none"
            ) from None
        self.run_dir = Path(run_dir)
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        # W&B takes any id of [a-z0-9]; its own generator moved between releases (wandb.util.generate_id
        # is gone in 0.2x), so the id is made here.
        run_id = _saved_id(self.run_dir, "wandb_run_id") or secrets.token_hex(4)
        directory = Path(uri) if uri else self.run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=self.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(directory),
            config=params(config),
            tags=[_arm(config)],
            reinit="create_new",
        )
        _save_id(self.run_dir, "wandb_run_id", run_id)

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        self.run.log({k: float(v) for k, v in values.items() if math.isfinite(v)}, step=step)

    def finish(self, summary: Mapping[str, Any] | None, status: str | None) -> None:
        if summary is not None:
            for key, value in summary_metrics(summary).items():
                self.run.summary[key] = value
            self.run.summary["status"] = str(summary.get("status"))
        self.run.finish(exit_code=0 if status in ("success", "target_not_reached") else 1)


def open_tracker(
    kind: str, run_dir: Path, config: Mapping[str, Any], uri: str | None, project: str
) -> Tracker | None:
    """The tracker ``train.tracker`` names, or None for ``none``."""
    if kind == "mlflow":
        return MLflowTracker(run_dir, config, uri, project)
    if kind == "wandb":
        return WandbTracker(run_dir, config, uri, project)
    return None
