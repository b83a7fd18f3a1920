"""``launcher=torchrun``: start the run's ranks on this machine through ``torch.distributed.run``.

The parent process (the job) owns the run directory (it holds its lock, :mod:`kfac_bench.launcher.rundir`)
and has recorded the job's composed config there (``config.yaml``); every rank runs
``kfac-bench train --rank-of DIR``, which trains that recorded config, so all ranks share one run and one
config, and a restarted rank (``--max-restarts``) resumes from its checkpoint. Preemption signals reach
the ranks through :mod:`kfac_bench.launcher.agent`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from kfac_bench.config import hydra_quote

__all__ = [
    "JOB_ENV_KEYS",
    "RANK_OF_FLAG",
    "hydra_quote",
    "launch_torchrun",
    "outside_job_env",
    "run_dir_override",
    "torchrun_args",
]

#: The variables by which a process knows it is a rank of a torchrun or SLURM job.
JOB_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "KFAC_BENCH_AGENT_PID",  # kfac_bench.launcher.agent_tie.AGENT_PID_ENV
)


#: ``kfac-bench train --rank-of DIR``: a rank of the run its launcher prepared in DIR.
RANK_OF_FLAG = "--rank-of"


def outside_job_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) for a child that must start as a job of its own, not as
    a rank of the torchrun/SLURM job this process may belong to."""
    out = dict(os.environ if env is None else env)
    for key in JOB_ENV_KEYS:
        out.pop(key, None)
    return out


def run_dir_override(run_dir: str | Path) -> str:
    """The ``hydra.run.dir=`` override naming ``run_dir`` exactly (:func:`hydra_quote`). The launch scripts
    build theirs with ``python -m kfac_bench.launcher.torchrun DIR``. A path holding ``${`` reads back
    exactly too, but the CLI and the agent refuse it as a run directory before any rank starts
    (:func:`kfac_bench.launcher.rundir.check_run_dir_path`)."""
    return f"hydra.run.dir={hydra_quote(str(run_dir))}"


def torchrun_args(
    run_dir: Path, nproc_per_node: int, max_restarts: int, monitor_interval: float
) -> list[str]:
    """Arguments of ``torch.distributed.run`` that start ``nproc_per_node`` ranks of the run prepared in
    ``run_dir``."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={monitor_interval}",
        "-m",
        "kfac_bench.cli",
        "train",
        RANK_OF_FLAG,
        str(Path(run_dir).resolve()),
    ]


def launch_torchrun(
    run_dir: Path, nproc_per_node: int, max_restarts: int, monitor_interval: float
) -> int:
    """Run the ranks to completion under :func:`kfac_bench.launcher.agent.run_torchrun`, which forwards
    SIGTERM/SIGUSR1/SIGUSR2 to them; returns 0, 75 (:data:`kfac_bench.launcher.signals.EXIT_REQUEUE`) if
    they stopped for preemption with a checkpoint, 2 for a user error in the ranks, else 1."""
    from kfac_bench.launcher.agent import run_torchrun

    args = torchrun_args(run_dir, nproc_per_node, max_restarts, monitor_interval)
    return run_torchrun(args, Path(run_dir).resolve())


if __name__ == "__main__":
    # ``python -m kfac_bench.launcher.torchrun DIR``: print the hydra.run.dir override for DIR (launch/*.s*).
    if len(sys.argv) != 2:
        print("usage: python -m kfac_bench.launcher.torchrun RUN_DIR", file=sys.stderr)
        sys.exit(2)
    print(run_dir_override(sys.argv[1]))
