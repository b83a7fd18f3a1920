"""Job layout from torchrun and SLURM environment variables."""

from __future__ import annotations

from kfac_bench.launcher.distributed import detect, first_host
from kfac_bench.launcher.torchrun import outside_job_env, torchrun_args


def test_torchrun_variables() -> None:
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "1234",
    }
    d = detect(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr, d.master_port) == (
        3,
        1,
        8,
        "n0",
        1234,
    )
    assert d.source == "torchrun" and d.distributed and not d.is_main


def test_slurm_variables_without_torchrun() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
    }
    d = detect(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr) == (5, 1, 8, "gpu07")
    assert d.source == "slurm"


def test_torchrun_wins_over_slurm_and_single_process_default() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect(env).source == "torchrun"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1
    assert not detect({}).distributed


def test_first_host_forms() -> None:
    assert first_host("node1") == "node1"
    assert first_host("node1,node2") == "node1"
    assert first_host("gpu[3,5-7]") == "gpu3"


def test_launcher_detects_workers_and_builds_torchrun_arguments(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert not detect({}).launched and not detect({}).elastic
    assert (
        detect({"TORCHELASTIC_RUN_ID": "x"}).launched
        and detect({"TORCHELASTIC_RUN_ID": "x"}).elastic
    )
    assert detect({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}).launched
    assert not detect(
        {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    ).launched  # a one-task job is a job
    args = torchrun_args(tmp_path, nproc_per_node=2, max_restarts=3, monitor_interval=0.5)
    assert "--nproc-per-node=2" in args and "--max-restarts=3" in args
    # Every rank trains the config the launcher recorded in the run directory: no overrides of its own.
    assert args[args.index("-m") + 1 :] == [
        "kfac_bench.cli",
        "train",
        "--rank-of",
        str(tmp_path.resolve()),
    ]


def test_a_child_started_outside_the_job_is_not_taken_for_one_of_its_ranks() -> None:
    rank_env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "r",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "MASTER_ADDR": "n0",
        "PATH": "/bin",
    }
    assert detect(rank_env).launched
    child = outside_job_env(rank_env)
    assert not detect(child).launched and detect(child).world_size == 1
    assert child == {"MASTER_ADDR": "n0", "PATH": "/bin"}  # everything else is kept
    assert "RANK" in rank_env  # the given mapping is not changed
