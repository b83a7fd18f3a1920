"""One reader of a job's world size (:func:`kfac_bench.launcher.preflight.job_world`): the device check and
the resume check on another world see the same number, under ``launcher=torchrun`` and under the multinode
agent (``launch/slurm.sbatch``, ``launch/torchrun_multinode.sh``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_bench.checkpoint import elastic
from kfac_bench.config.compose import compose_run
from kfac_bench.errors import UserError
from kfac_bench.launcher import preflight
from kfac_bench.launcher.preflight import JobWorld, job_world
from tests.harness.util import TINY

JOB_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


class _Stop(Exception):
    """Raised by the spied resume check: the job must not start ranks here."""


@pytest.fixture
def outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in JOB_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The world size each check was given."""
    got: dict[str, int] = {}
    device = preflight.check_device

    def check_device(cfg: Any, world_size: int = 1) -> None:
        got["device"] = world_size
        device(cfg, world_size)

    def check_launch(run_dir: Path, cfg: Any, world_size: int) -> None:
        got["launch"] = world_size
        raise _Stop

    monkeypatch.setattr(preflight, "check_device", check_device)
    monkeypatch.setattr(elastic, "check_launch", check_launch)
    return got


@pytest.mark.usefixtures("outside_a_job")
def test_the_world_of_each_way_a_job_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert job_world(compose_run(TINY)) == JobWorld(1, True)
    torchrun = compose_run([*TINY, "launcher=torchrun", "launcher.nproc_per_node=3"])
    assert job_world(torchrun) == JobWorld(3, True)
    tail = ["-m", "kfac_bench.cli", "train", "--nnodes=7"]  # after -m: not torchrun's
    assert job_world(None, ["--nnodes=2", "--nproc-per-node=4", *tail]) == JobWorld(8, True)
    assert job_world(None, ["--nnodes", "1:3", "--nproc_per_node", "2", *tail]) == JobWorld(
        6, False
    )
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert job_world(torchrun) == JobWorld(5, True)  # a rank: the job it belongs to
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--nproc-per-node=gpu"):
        job_world(None, ["--nproc-per-node=gpu", *tail])


@pytest.mark.usefixtures("outside_a_job")
def test_launcher_torchrun_checks_the_device_and_the_resume_on_one_world(
    tmp_path: Path, seen: dict[str, int]
) -> None:
    from kfac_bench.commands.train import _checked_world
    from kfac_bench.config.jobs import compose_jobs

    overrides = [*TINY, "launcher=torchrun", "launcher.nproc_per_node=3"]
    [job] = compose_jobs([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], multirun=False)
    with pytest.raises(_Stop):
        _checked_world(job.run_config, job.run_dir)
    assert seen == {"device": 3, "launch": 3}


@pytest.mark.usefixtures("outside_a_job")
@pytest.mark.parametrize(
    ("nodes", "expected"),
    [("--nnodes=2", {"device": 4, "launch": 4}), ("--nnodes=1:2", {"device": 4})],
)
def test_the_multinode_agent_checks_the_device_and_the_resume_on_one_world(
    tmp_path: Path, seen: dict[str, int], nodes: str, expected: dict[str, int]
) -> None:
    from kfac_bench.launcher.agent import _preflight

    run_dir = tmp_path / "run"
    args = [
        nodes,
        "--nproc-per-node=2",
        "-m",
        "kfac_bench.cli",
        "train",
        *TINY,
        "train.device=cpu",
        f"hydra.run.dir={run_dir}",
    ]
    if "launch" in expected:
        with pytest.raises(_Stop):
            _preflight(args, run_dir)
    else:  # an elastic range: the ranks check the world they find
        _preflight(args, run_dir)
    assert seen == expected
