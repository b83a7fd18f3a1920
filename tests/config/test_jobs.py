"""A command line's jobs: each composed once with its run directory resolved once, a sweep's arms
interleaved in time whatever the override order, the sweep folder as campaign, and a recorded config read
back typed as the launcher composed it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kfac_bench.config.jobs import compose_jobs, interleave, job_part, load_run_config
from kfac_bench.config.schema import DeviceKind, OptimizerName
from kfac_bench.errors import ConfigError


def test_a_run_dir_with_now_and_uid_resolves_once(tmp_path: Path) -> None:
    [job] = compose_jobs([f"hydra.run.dir={tmp_path}/rd/${{now:%H-%M-%S-%f}}_${{uid:}}"], False)
    # Written back as a literal: every later reading is the same folder.
    assert str(job.run_dir) == job.config.hydra.run.dir == job.config.hydra.runtime.output_dir
    assert str(job.run_dir) == OmegaConf.select(job.config, "hydra.run.dir")
    assert "${" not in str(job.run_dir) and job.run_dir.parent == tmp_path / "rd"


def _arms(jobs: list) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    return [(j.config.name, int(j.config.train.seed)) for j in jobs]


@pytest.mark.parametrize(
    "overrides",
    [
        ["+recipe=digits_sgd,digits", "train.seed=0,1,2"],  # arm-first, as the docs used to sweep
        ["train.seed=0,1,2", "+recipe=digits_sgd,digits"],
    ],
)
def test_a_sweeps_arms_alternate_whatever_the_override_order(
    overrides: list[str], tmp_path: Path
) -> None:
    jobs = compose_jobs([*overrides, f"hydra.sweep.dir={tmp_path}/sw"], True)
    assert _arms(jobs) == [
        ("digits_sgd", 0),
        ("digits", 0),
        ("digits", 1),  # which arm goes first rotates
        ("digits_sgd", 1),
        ("digits_sgd", 2),
        ("digits", 2),
    ]
    # Numbered in the order they run; one folder, every job inside it, the folder as campaign.
    assert [j.num for j in jobs] == list(range(6))
    assert [j.run_dir.name for j in jobs][:2] == ["0_digits_sgd_seed0", "1_digits_seed0"]
    assert {j.run_dir.parent for j in jobs} == {tmp_path / "sw"}
    assert {j.config.train.campaign for j in jobs} == {str(tmp_path / "sw")}


def test_a_generated_sweep_folder_is_resolved_once_for_every_job() -> None:
    jobs = compose_jobs(
        ["train.seed=0,1,2,3", "hydra.sweep.dir=sw/${now:%H-%M-%S-%f}_${uid:}"], True
    )
    assert len({j.sweep_dir for j in jobs}) == 1
    assert len({j.run_dir for j in jobs}) == 4


def test_a_campaign_given_on_the_command_line_is_kept() -> None:
    jobs = compose_jobs(["train.seed=0,1", "train.campaign=lr-study"], True)
    assert {j.config.train.campaign for j in jobs} == {"lr-study"}


def test_interleave_keeps_a_sweep_without_replicates_or_arms() -> None:
    one_arm = [["train.seed=0"], ["train.seed=1"]]
    assert interleave(one_arm) == one_arm
    no_seeds = [["optimizer.lr=0.1"], ["optimizer.lr=0.2"], ["optimizer.lr=0.4"]]
    assert interleave(no_seeds) == no_seeds


def test_every_job_is_checked_before_any_runs() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        compose_jobs(["optimizer.lr=0.1,-1"], True)


def test_a_sweep_too_large_to_run_is_one_line() -> None:
    with pytest.raises(ConfigError, match="more than"):
        compose_jobs(["train.seed=range(0,200)", "optimizer.lr=range(1,100)"], True)


def test_a_recorded_config_reads_back_typed_as_composed(tmp_path: Path) -> None:
    [job] = compose_jobs(["+recipe=resnet32_cifar10_smoke", "train.device=cpu"], False)
    composed = job_part(job.config)
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(composed, resolve=True))
    loaded = load_run_config(path)
    assert loaded.train.device == DeviceKind.cpu and loaded.optimizer.name == OptimizerName.sgd
    assert OmegaConf.to_container(loaded, resolve=True) == OmegaConf.to_container(
        composed, resolve=True
    )


def test_a_recorded_config_that_does_not_fit_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("train:\n  device: quantum\n")
    with pytest.raises(ConfigError, match="does not fit"):
        load_run_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        load_run_config(path)
