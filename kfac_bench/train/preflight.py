"""Checks of a composed run config that need more than its schema, made once in the launching process
before any rank starts: every bound (:mod:`kfac_bench.config.bounds`), a CUDA device when one is asked for,
targets only on metrics the task reports, and the library of ``train.tracker``."""

from __future__ import annotations

from typing import Any

from kfac_bench.config.bounds import validate_run
from kfac_bench.errors import ConfigError

__all__ = ["check_device", "check_run", "check_targets", "check_tracker"]

#: ``train.tracker`` -> (the module it needs, how to install it).
_TRACKER_PACKAGES = {
    "mlflow": ("mlflow", "pip install 'kfac-bench[tracking]' (or mlflow-skinny)"),
    "wandb": ("wandb", "pip install wandb"),
}


def check_device(cfg: Any) -> None:
    """``train.device=cuda`` needs a CUDA device on this machine.

    Raises:
        ConfigError: one line.
    """
    import torch

    if str(getattr(cfg.train.device, "value", cfg.train.device)) == "cuda" and not (
        torch.cuda.is_available()
    ):
        raise ConfigError(
            "train.device=cuda but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False): use train.device=auto or train.device=cpu"
        )


def check_targets(cfg: Any) -> None:
    """Every key of ``train.targets`` (and ``task.target_metric``) is a metric the task reports, when the
    task says which it reports (``metric_names``).

    Raises:
        ConfigError: one line naming the metric and the task's metrics.
    """
    from kfac_bench.train.build import instantiate

    task = instantiate(cfg.task)
    names = getattr(task, "metric_names", None)
    if not names:
        return
    reported = ", ".join(names)
    for metric in cfg.train.targets:
        if metric not in names:
            raise ConfigError(
                f"train.targets.{metric}: the task never reports '{metric}', so the target could never "
                f"be met; its metrics are {reported}"
            )
    if task.target_metric not in names:
        raise ConfigError(
            f"task.target_metric={task.target_metric}: the task never reports it; its metrics are {reported}"
        )


def check_tracker(cfg: Any) -> None:
    """``train.tracker`` names a tracker whose library is installed.

    Raises:
        ConfigError: one line naming the package to install.
    """
    import importlib.util

    kind = str(getattr(cfg.train.tracker, "value", cfg.train.tracker))
    if kind not in _TRACKER_PACKAGES:
        return
    module, install = _TRACKER_PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"train.tracker={kind} needs the {module} package, which is not installed: {install}, "
            "or set train.tracker=none"
        )


def check_run(cfg: Any) -> None:
    """All of the above, in order: bounds, device, targets, tracker.

    Raises:
        ConfigError: the first problem, as one line.
    """
    validate_run(cfg)
    check_device(cfg)
    check_targets(cfg)
    check_tracker(cfg)
