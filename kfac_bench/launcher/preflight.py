"""Checks of a composed run config that need more than its schema, made once in the launching process
before any rank starts: every bound (:mod:`kfac_bench.config.bounds`), a CUDA device when one is asked for
(or, for a job of several ranks, unless the CPU is asked for), targets only on metrics the task reports, and
the library of ``train.tracker``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from kfac_bench.config.bounds import validate_run
from kfac_bench.errors import ConfigError, UserError

__all__ = [
    "JobWorld",
    "check_device",
    "check_run",
    "check_targets",
    "check_tracker",
    "job_world",
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


class JobWorld(NamedTuple):
    """The ranks of a job, as the process that checks it before they start sees them.

    Attributes:
        size: how many (the most of an elastic ``--nnodes=MIN:MAX``).
        fixed: one fixed number; False for an elastic range, whose ranks check the world they find.
    """

    size: int
    fixed: bool = True


def job_world(cfg: Any, torchrun_args: Sequence[str] | None = None) -> JobWorld:
    """The one reader of a job's world size, for the device check (:func:`check_run`) and the resume check
    on another world (:func:`kfac_bench.checkpoint.elastic.check_launch`) alike.

    Args:
        cfg: the composed run config (unused with ``torchrun_args``).
        torchrun_args: torchrun's command line, for the agent that starts a node's ranks
            (:mod:`kfac_bench.launcher.agent`, under ``launch/slurm.sbatch`` / ``torchrun_multinode.sh``):
            ``--nnodes`` × ``--nproc-per-node`` (``gpu``: this node's CUDA devices, as torchrun counts).
            Without it: the job's world size inside a torchrun/SLURM job, ``launcher.nproc_per_node``
            when this process launches the ranks itself (``launcher=torchrun``), else 1.

    Raises:
        UserError: ``--nproc-per-node=gpu`` on a machine without a CUDA device.
    """
    if torchrun_args is not None:
        return _torchrun_world(torchrun_args)
    from kfac_bench.launcher.distributed import detect

    env = detect()
    if env.launched:
        return JobWorld(env.world_size)
    launcher = cfg.launcher
    if str(getattr(launcher.name, "value", launcher.name)) == "torchrun":
        return JobWorld(int(launcher.nproc_per_node))
    return JobWorld(1)


def _torchrun_world(args: Sequence[str]) -> JobWorld:
    nnodes = _option(args, "--nnodes", "1")
    nodes = int(nnodes.split(":")[-1])
    fixed = ":" not in nnodes
    nproc = _option(args, "--nproc-per-node", _option(args, "--nproc_per_node", "1"))
    if nproc in ("gpu", "auto"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 and nproc == "gpu":
            raise UserError(
                "--nproc-per-node=gpu (one rank per GPU) but this machine has no usable CUDA device: "
                "run on a GPU node, or set the ranks per node (GPUS_PER_NODE=N) and pass train.device=cpu"
            )
        return JobWorld(nodes * max(count, 1 if nproc == "gpu" else os.cpu_count() or 1), fixed)
    return JobWorld(nodes * int(nproc), fixed)


def _option(args: Sequence[str], name: str, default: str) -> str:
    """The value of torchrun's option ``--name=V`` / ``--name V`` before ``-m`` (the last one wins)."""
    value = default
    head = list(args[: args.index("-m")] if "-m" in args else args)
    for i, arg in enumerate(head):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(head):
            value = head[i + 1]
    return value


def check_targets(cfg: Any) -> None:
    """Every key of ``train.targets`` (and ``task.target_metric``) is a metric the task reports, when the
    task says which it reports (``metric_names``).

    Raises:
        ConfigError: one line naming the metric and the task's metrics.
    """
    from kfac_bench.config.compose import instantiate

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
    (default: :func:`job_world`'s).

    Raises:
        ConfigError: the first problem, as one line.
    """
    validate_run(cfg)
    check_device(cfg, job_world(cfg).size if world_size is None else world_size)
    check_targets(cfg)
    check_tracker(cfg)
