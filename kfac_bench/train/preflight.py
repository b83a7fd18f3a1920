"""Checks of a composed run config that need more than its schema, made once in the launching process
before any rank starts: every bound (:mod:`kfac_bench.config.bounds`), a CUDA device when one is asked for
(or, for a job of several ranks, unless the CPU is asked for), targets only on metrics the task reports, and
the library of ``train.tracker``."""

from __future__ import annotations

from typing import Any

from kfac_bench.config.bounds import validate_run
from kfac_bench.errors import ConfigError

__all__ = [
    "check_device",
    "check_run",
    "check_targets",
    "check_tracker",
    "launched_world_size",
]

#: ``train.tracker`` -> (the module it needs, how to install it).
_TRACKER_PACKAGES = {
    "mlflow": ("mlflow", "pip install 'kfac-bench[tracking]' (or mlflow-skinny)"),
    "wandb": ("wandb", "pip install wandb"),
}


def check_device(cfg: Any, world_size: int = 1) -> None:
    """``train.device=cuda`` needs a CUDA device on this machine; so does a job of ``world_size`` > 1
    ranks with ``train.device=auto``: several ranks on the CPU are almost always a GPU request that went
    missing (``sbatch`` without ``--gpus-per-node``), so they train there only when asked to
    (``train.device=cpu``).

    Raises:
        ConfigError: one line.
    """
    import torch

    device = str(getattr(cfg.train.device, "value", cfg.train.device))
    if device == "cpu" or torch.cuda.is_available():
        return
    if device == "cuda":
        raise ConfigError(
            "train.device=cuda but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False): use train.device=auto or train.device=cpu"
        )
    if world_size > 1:
        raise ConfigError(
            f"a job of {world_size} ranks with train.device=auto but this machine has no usable CUDA "
            "device, so every rank would train on the CPU: request GPUs (sbatch --gpus-per-node=N) or "
            "pass train.device=cpu to train on the CPU on purpose"
        )


def launched_world_size(cfg: Any) -> int:
    """The ranks of the job this process starts or belongs to: the job's world size inside a
    torchrun/SLURM job, ``launcher.nproc_per_node`` when this process launches ranks itself, else 1."""
    from kfac_bench.train.distributed import detect
    from kfac_bench.train.launch import inside_launched_worker

    if inside_launched_worker():
        return detect().world_size
    launcher = cfg.launcher
    if str(getattr(launcher.name, "value", launcher.name)) == "torchrun":
        return int(launcher.nproc_per_node)
    return 1


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


def check_run(cfg: Any, world_size: int | None = None) -> None:
    """All of the above, in order: bounds, device, targets, tracker. ``world_size``: the ranks of the job
    (default: :func:`launched_world_size`).

    Raises:
        ConfigError: the first problem, as one line.
    """
    validate_run(cfg)
    check_device(cfg, launched_world_size(cfg) if world_size is None else world_size)
    check_targets(cfg)
    check_tracker(cfg)
