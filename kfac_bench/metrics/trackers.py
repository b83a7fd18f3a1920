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
  run continues the same MLflow run (its id and store are kept in ``tracker.json`` in the run directory); a
  resume with another ``train.tracker_uri`` starts a new MLflow run in that store.
- Weights & Biases: offline (``WANDB_MODE=offline`` unless set; ``wandb sync runs/<run>/wandb`` uploads it),
  its files under ``train.tracker_uri`` or the run directory; a resumed run continues the same W&B run.

A tracker is named after the run directory and the folder above it (:func:`run_name`), and tagged with the
arm, the seed, the run directory and what the run ran on (``env.<key>``:
:mod:`kfac_bench.metrics.environment`); MLflow also keeps the run's ``config.yaml`` and ``summary.json`` as
artifacts.

Trackers are best effort once open (:class:`BestEffort`): the first failure of a tracker during the run
(a full or read-only store, a server gone, any library error) is one warning line and that tracker is off
for the rest of the run; the run's own files, checkpoints and exit status are not touched by it. Opening is
strict: a store that cannot be opened when the run starts stops it with one line before training (MLflow's
HTTP client retries once with a 4 s timeout unless ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` /
``MLFLOW_HTTP_REQUEST_TIMEOUT`` are set, so an unreachable server is refused within about 10 s).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
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
    "BestEffort",
    "MLflowTracker",
    "Tracker",
    "WandbTracker",
    "hparams",
    "open_tracker",
    "run_name",
    "run_tags",
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
#: MLflow's HTTP client retries 7 times with exponential back-off and waits 120 s per request by default:
#: minutes against a server that is gone. These apply unless the environment sets them.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
}
#: Files of the run directory MLflow keeps as artifacts (the config when the run starts, the summary at
#: its end).
CONFIG_ARTIFACT = "config.yaml"
SUMMARY_ARTIFACT = "summary.json"


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


def run_name(run_dir: Path) -> str:
    """The run's name in its tracker: its directory and the folder above, e.g.
    ``multirun/2026-12-04_10-00-00_3fa2c1/0_digits_seed0`` -> ``2026-12-04_10-00-00_3fa2c1/0_digits_seed0``.
    A sweep names its jobs alike in every sweep; their sweep folders (time and a random suffix) differ."""
    path = Path(run_dir).resolve()
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def run_tags(
    run_dir: Path, config: Mapping[str, Any], environment: Mapping[str, Any] | None
) -> dict[str, str]:
    """A tracker run's tags: arm, seed, run directory, and ``env.<key>`` for each value of ``environment``
    that is present (:func:`kfac_bench.metrics.environment.run_environment`)."""
    seed = (_plain(config).get("train") or {}).get("seed")
    tags = {"arm": _arm(config), "run_dir": str(Path(run_dir).resolve()), "seed": str(seed)}
    for key, value in (environment or {}).items():
        if value is not None:
            tags[f"env.{key}"] = str(value)
    return tags


def _saved(run_dir: Path) -> dict[str, Any]:
    try:
        value = json.loads((run_dir / TRACKER_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _saved_id(run_dir: Path, key: str) -> str | None:
    value = _saved(run_dir).get(key)
    return value if isinstance(value, str) else None


def _save_id(run_dir: Path, key: str, value: str, **more: str) -> None:
    safe_files.write_atomic(run_dir / TRACKER_FILE, json.dumps({key: value, **more}) + "\n")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class BestEffort:
    """A tracker whose failures never reach the run: the first exception of any call is one warning line
    on stderr, and every later call is skipped (the tracker is off for the rest of the run)."""

    def __init__(self, tracker: Tracker, name: str) -> None:
        self.tracker: Tracker | None = tracker
        self.name = name

    @property
    def active(self) -> bool:
        return self.tracker is not None

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        if self.tracker is not None:
            self._guard(lambda t: t.metrics(values, step))

    def finish(self, summary: Mapping[str, Any] | None, status: str | None) -> None:
        if self.tracker is not None:
            self._guard(lambda t: t.finish(summary, status))

    def _guard(self, call: Any) -> None:
        try:
            call(self.tracker)
        except Exception as exc:  # the library's, the store's, the network's: none costs the run
            self.tracker = None
            print(
                f"kfac-bench: warning: {self.name} failed ({type(exc).__name__}: {_one_line(exc)}); "
                "it is off for the rest of this run, which goes on (eval.jsonl, checkpoints and "
                "summary.json are written as usual)",
                file=sys.stderr,
                flush=True,
            )


def _store_fix(uri: str) -> str:
    """What to do about an MLflow store at ``uri`` that cannot be used."""
    if uri.startswith(("http://", "https://")):
        return (
            "start the server (or check the address and network), set train.tracker_uri to a reachable "
            "store, or set train.tracker=none"
        )
    return (
        "make that store writable (or free space on its disk), set train.tracker_uri to another store, "
        "or set train.tracker=none"
    )


class MLflowTracker:
    """One MLflow run per kfac-bench run, through ``MlflowClient``, continued on resume while
    ``train.tracker_uri`` stays the same; a resume that names another store starts a new MLflow run there
    (``tracker.json`` records the store with the run's id).

    Raises:
        UserError: mlflow is not installed, or the tracking store cannot be opened (one line naming the
            store and the fix).
    """

    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        uri: str | None,
        project: str,
        environment: Mapping[str, Any] | None = None,
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
        for key, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # urllib3 logs each retry of an unreachable server as a warning, which the job's logging prints
        # on stdout among the run's lines; the failure itself is reported once, in one line.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        saved = _saved(self.run_dir)
        same_store = saved.get("mlflow_uri", uri) == uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = _saved_id(self.run_dir, "mlflow_run_id") if same_store else None
            if run_id is not None and not self._exists(run_id):
                run_id = None  # the store no longer holds it: a new run, as in another store
            tags = [RunTag(k, v) for k, v in run_tags(self.run_dir, config, environment).items()]
            if run_id is None:
                experiment = self.client.get_experiment_by_name(project)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(project)
                )
                run = self.client.create_run(experiment_id, run_name=run_name(self.run_dir))
                run_id = run.info.run_id
                flat = params(config)
                items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
                for i in range(0, len(items), 100):  # MLflow takes at most 100 per batch
                    self.client.log_batch(run_id, params=items[i : i + 100])
                _save_id(self.run_dir, "mlflow_run_id", run_id, mlflow_uri=uri)
            else:
                self.client.update_run(run_id, status="RUNNING")
            self.client.log_batch(run_id, tags=tags)  # this part's host, GPU, versions
            config_file = self.run_dir / CONFIG_ARTIFACT
            if config_file.is_file():
                self.client.log_artifact(run_id, str(config_file))
        except UserError:
            raise
        except Exception as exc:  # MlflowException, OSError, ...: one line either way
            raise UserError(
                f"train.tracker=mlflow: cannot open the MLflow store at '{uri}' "
                f"({type(exc).__name__}: {_one_line(exc)}); {_store_fix(uri)}"
            ) from None
        self.run_id = run_id
        self.uri = uri

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True

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
            summary_file = self.run_dir / SUMMARY_ARTIFACT
            if summary_file.is_file():
                self.client.log_artifact(self.run_id, str(summary_file))
        ended = {"success": "FINISHED", "target_not_reached": "FINISHED", "preempted": "KILLED"}
        self.client.set_terminated(self.run_id, status=ended.get(str(status), "FAILED"))


class WandbTracker:
    """One W&B run per kfac-bench run, offline unless ``WANDB_MODE`` is set (continued on resume).

    Raises:
        UserError: wandb is not installed, or the W&B run cannot start (one line).
    """

    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        uri: str | None,
        project: str,
        environment: Mapping[str, Any] | None = None,
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
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tags = run_tags(self.run_dir, config, environment)
            self.run = wandb.init(
                project=project,
                name=run_name(self.run_dir),
                id=run_id,
                resume="allow",
                dir=str(directory),
                config=params(config),
                # W&B tags are short labels (at most 64 characters): the arm, and key=value for the rest
                tags=[tags.pop("arm"), *(f"{k}={v}"[:64] for k, v in tags.items())],
                reinit="create_new",
            )
        except (
            Exception
        ) as exc:  # wandb's own (a bad directory, its service not starting): one line
            raise UserError(
                f"train.tracker=wandb: cannot start the W&B run in {directory} "
                f"({type(exc).__name__}: {_one_line(exc)}); fix WANDB_* settings or train.tracker_uri, "
                "or set train.tracker=none"
            ) from None
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
    kind: str,
    run_dir: Path,
    config: Mapping[str, Any],
    uri: str | None,
    project: str,
    environment: Mapping[str, Any] | None = None,
) -> BestEffort | None:
    """The tracker ``train.tracker`` names, opened and made best effort (:class:`BestEffort`), or None for
    ``none``.

    Raises:
        UserError: the tracker cannot be opened (one line naming the fix).
    """
    kinds: dict[str, type[MLflowTracker] | type[WandbTracker]] = {
        "mlflow": MLflowTracker,
        "wandb": WandbTracker,
    }
    if kind not in kinds:
        return None
    tracker = kinds[kind](run_dir, config, uri, project, environment)
    return BestEffort(tracker, f"train.tracker={kind}")
