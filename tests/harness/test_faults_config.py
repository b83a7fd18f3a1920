"""Bad values are refused before anything starts: every schema bound, a CUDA device that is not there, a
target on a metric the task never reports. One line, exit status 2, no traceback, printed once even under
torchrun (the launching process checks; no rank starts)."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kfac_bench import cli
from kfac_bench.config import schema
from kfac_bench.config.bounds import Bounds, bounds_of
from kfac_bench.config.compose import compose_run
from kfac_bench.launcher.preflight import check_run
from tests.harness.util import TINY, cli_env, run_cli
from tests.limits import hang_limit

GROUPS = {
    name: t
    for name, t in typing.get_type_hints(schema.RunConfig).items()
    if isinstance(t, type) and hasattr(t, "__dataclass_fields__")
}
#: The builder schemas the default job composes (digits, small CNN, classification).
BUILDERS = {"dataset": schema.DigitsConfig, "task": schema.ClassificationTaskConfig}


def _is_int(cls: type, name: str) -> bool:
    return typing.get_type_hints(cls)[name] in (int, int | None)


def _outside(bounds: Bounds, integer: bool) -> float:
    """A value just outside ``bounds``."""
    if bounds.gt is not None:
        value = bounds.gt
    elif bounds.ge is not None:
        value = bounds.ge - (1 if integer else 0.5)
    elif bounds.lt is not None:
        value = bounds.lt
    else:
        assert bounds.le is not None
        value = bounds.le + (1 if integer else 0.5)
    return int(value) if integer else float(value)


BOUNDED = sorted(
    (f"{section}.{name}", b, _is_int(cls, name))
    for section, cls in {**GROUPS, **BUILDERS}.items()
    for name, b in bounds_of(cls)
)


def test_the_key_hyperparameters_declare_bounds() -> None:
    keys = {key for key, _, _ in BOUNDED}
    assert {
        "optimizer.lr",
        "kfac.factor_update_steps",
        "kfac.inv_update_steps",
        "kfac.damping",
        "kfac.factor_decay",
        "train.batch_size",
        "train.accumulation_steps",
        "train.keep_checkpoints",
        "launcher.nproc_per_node",
        "launcher.max_restarts",
    } <= keys


def _one_error_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    status = cli.main(["train", *args])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize(("key", "bounds", "integer"), BOUNDED, ids=[k for k, _, _ in BOUNDED])
def test_every_bound_is_checked_before_the_run(
    key: str, bounds: Bounds, integer: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _outside(bounds, integer)
    line = _one_error_line(capsys, [f"{key}={bad}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert f"invalid value {key}={bad}: must be {bounds.describe()}" in line
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run directory


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimizer.lr=-0.1", "must be in (0, 1e+06]"),
        ("kfac.factor_update_steps=0", "must be >= 1"),
        ("kfac.inv_update_steps=-1", "must be >= 1"),
        ("train.batch_size=0", "must be >= 1"),
        ("train.accumulation_steps=0", "must be >= 1"),
        ("launcher.nproc_per_node=0", "must be >= 1"),
        ("launcher.max_restarts=-1", "must be >= 0"),
        ("kfac.damping=-1", "must be >= 0"),
        ("kfac.factor_decay=1.5", "must be in [0, 1)"),
        ("+train.targets.top9=0.5", "the task never reports 'top9'"),
        ("task.target_metric=top3", "task.target_metric=top3: the task never reports it"),
        ("train.targets={top_1: 0.5}", "unknown config key 'train.targets.top_1'"),
        ("train.targets.top1=nan", "train.targets.top1=nan: a target must be a finite number"),
        ("train.targets.top1=-inf", "train.targets.top1=-inf: a target must be a finite number"),
        ("optimizer.lr=1e300", "invalid value optimizer.lr=1e+300: must be in (0, 1e+06]"),
        ("optimizer.lr=inf", "optimizer.lr=inf: must be a finite number in (0, 1e+06]"),
        ("train.seed=99999999999999999999", "train.seed=99999999999999999999: must be in [0, "),
        ("lr_schedule.milestones=[-1]", "lr_schedule.milestones=[-1.0]: milestones must be finite"),
        (
            "name=../../x",
            "invalid value name='../../x': a run's name becomes part of its directory",
        ),
        (
            "+recipe=../../x",
            "invalid option in 'recipe=../../x': a recipe option is a name from its",
        ),
        (
            "model=/etc/x",
            "invalid option in 'model=/etc/x': a model option is a name from its folder",
        ),
    ],
)
def test_common_bad_values_are_one_line_naming_the_rule(
    override: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_error_line(capsys, ["+recipe=digits_smoke", override])
    assert expected in line and "Traceback" not in line
    if "targets" in override and "finite" not in expected:
        assert "loss, top1, top5" in line or "unknown config key" in line


def test_a_recipe_path_never_loads_yaml_outside_the_recipe_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside.yaml"
    outside.write_text("# @package _global_\nname: planted\n")
    relative = "../" * 40 + str(outside.with_suffix("")).lstrip("/")
    line = _one_error_line(capsys, [f"+recipe={relative}", "--cfg", "job"])
    assert "a recipe option is a name from its folder, not a path" in line
    assert capsys.readouterr().out == ""  # nothing composed from it


def test_a_run_dir_holding_an_interpolation_is_refused_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfac_bench.launcher.agent import main as agent_main
    from kfac_bench.launcher.torchrun import run_dir_override

    for path in (tmp_path / "r${name}x", tmp_path / "r${nokey}x"):
        line = _one_error_line(capsys, ["+recipe=digits_smoke", run_dir_override(path)])
        assert line == (
            f"kfac-bench: error: run dir {path} contains '${{', which Hydra would resolve as an "
            "interpolation in the ranks (the run would land elsewhere); choose a path without '${'"
        )
        # launch/slurm.sbatch and torchrun_multinode.sh start the agent: it refuses before any rank
        args = ["--standalone", "-m", "kfac_bench.cli", "train", run_dir_override(path)]
        assert agent_main(args) == 2
        assert capsys.readouterr().err.count("contains '${'") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no directory, resolved or literal


def test_cuda_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _one_error_line(capsys, ["+recipe=digits_smoke", "train.device=cuda"])
    assert "train.device=cuda but this machine has no usable CUDA device" in line


def test_targets_on_reported_metrics_pass() -> None:
    check_run(compose_run(["+recipe=digits_smoke", "+train.targets.top5=0.9"]))


@pytest.mark.slow
def test_under_torchrun_the_error_is_printed_once_and_no_rank_starts(tmp_path: Path) -> None:
    result = run_cli(
        "train",
        *TINY,
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=2",
        "+train.targets.top9=0.5",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kfac-bench: error: train.targets.top9: the task never reports 'top9', so the target could "
        "never be met; its metrics are loss, top1, top5"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_launch_scripts_agent_checks_before_starting_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfac_bench.launcher.agent",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "kfac_bench.cli",
            "train",
            *TINY,
            "kfac.factor_decay=1.5",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kfac-bench: error: invalid value kfac.factor_decay=1.5: must be in [0, 1)"
    ]
    assert not (tmp_path / "run").exists()
