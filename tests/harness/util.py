"""Helpers for the harness tests: tiny run settings and running the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from kfac_bench.config.compose import compose_run
from kfac_bench.launcher.torchrun import outside_job_env
from tests.limits import hang_limit

#: A digits run of 2 epochs x 6 steps on an 8-channel CNN, single thread (the machine is shared).
TINY = [
    "+recipe=digits_smoke",
    "train.limit_train_batches=6",
    "train.limit_eval_batches=3",
    "train.cpu_threads=1",
    "train.progress=lines",
    "train.tensorboard=false",
    "train.device=cpu",  # on purpose: several ranks with device=auto on a machine without CUDA refuse
]

#: TINY without its recipe, for a run of a user's recipe that extends digits_smoke (:data:`USER_RECIPE`).
TINY_SETTINGS = [a for a in TINY if not a.startswith("+recipe=")]

REPO = Path(__file__).resolve().parents[2]

#: A user's recipe: the digits smoke run under another name, with fewer hidden units.
USER_RECIPE = """\
# @package _global_
defaults:
  - digits_smoke
  - _self_

name: mine
model:
  hidden: 16
"""


def user_config_dir(root: Path) -> Path:
    """A user's config directory (a space in its name) under ``root``, holding ``recipe/mine.yaml``
    (:data:`USER_RECIPE`)."""
    d = root / "my configs"
    (d / "recipe").mkdir(parents=True)
    (d / "recipe" / "mine.yaml").write_text(USER_RECIPE)
    return d


def tiny_cfg(*overrides: str) -> DictConfig:
    return compose_run([*TINY, *overrides])


def cli_env() -> dict[str, str]:
    env = outside_job_env()
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return env


def cli_command(*args: str) -> list[str]:
    """``python -m kfac_bench.cli ARGS`` with the tests' own interpreter."""
    return [sys.executable, "-m", "kfac_bench.cli", *args]


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m kfac_bench.cli ARGS`` to its end in ``cwd``, forked from a warm interpreter
    (:mod:`tests.harness.cli_process`): for tests that read the run's output and files. Tests of signals,
    preemption, supervision or run-directory locking start real processes (:mod:`tests.harness.fault_util`).
    ``timeout`` is stretched by :func:`tests.limits.hang_limit`."""
    from tests.harness.cli_process import run_cli_process

    return run_cli_process(args, cwd, cli_env(), hang_limit(timeout))


def console_script() -> str:
    """The installed ``kfac-bench`` console script next to the interpreter."""
    return str(Path(sys.executable).with_name("kfac-bench"))
