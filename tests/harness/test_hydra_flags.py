"""``kfac-bench train`` takes every Hydra flag as any Hydra application does: the flags are split from the
overrides exactly as Hydra's own command-line parser splits them, and each flag does what Hydra documents
(https://hydra.cc/docs/advanced/hydra-command-line-flags/), checked against the composed config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra._internal.utils import get_args_parser
from omegaconf import OmegaConf

from kfac_bench.cli import main
from kfac_bench.config.command_line import split_args as _split
from kfac_bench.config.compose import compose_run
from tests.harness.util import run_cli

COMMAND_LINES = [
    ["--cfg", "job"],
    ["--cfg=job"],
    ["--cfg", "hydra", "kfac=none"],
    ["-c", "all", "+recipe=digits_smoke", "train.epochs=3"],
    ["--cfg", "job", "--package", "train", "kfac=none"],
    ["--cfg", "job", "-p", "optimizer", "--resolve"],
    ["--info"],
    ["kfac=none", "--info"],
    ["--info", "defaults", "kfac=none"],
    ["-i", "config", "+recipe=digits_smoke"],
    ["-m", "kfac=none,comm_opt", "--cfg", "job"],
    ["--multirun", "train.seed=1,2"],
    ["--hydra-help"],
    ["--run", "--config-name", "train", "kfac=none"],
    ["-cd", "/tmp", "kfac=none"],
    ["--experimental-rerun", "x.pickle"],
    ["--shell-completion", "kfac=none"],
]


@pytest.mark.parametrize("argv", COMMAND_LINES, ids=" ".join)
def test_flags_and_overrides_split_as_hydras_parser_splits_them(argv: list[str]) -> None:
    flags, overrides = _split(argv)
    parsed = get_args_parser().parse_args(argv)
    assert overrides == parsed.overrides
    assert sorted(flags + overrides) == sorted(argv)


def _run(args: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[int, str]:
    try:
        status = main(["train", *args, f"hydra.run.dir={tmp_path / 'run'}"])
    except SystemExit as exc:  # Hydra exits after --hydra-help as after --help
        status = int(exc.code or 0)
    out = capsys.readouterr()
    return status, out.out + out.err


def _composed(*overrides: str, resolve: bool = False) -> dict:
    cfg = compose_run(list(overrides))
    container = OmegaConf.to_container(cfg, resolve=resolve)
    assert isinstance(container, dict)
    return container


@pytest.mark.parametrize("form", [["--cfg", "job"], ["--cfg=job"], ["-c", "job"]])
def test_cfg_job_prints_the_composed_config_and_trains_nothing(
    form: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out = _run([*form, "+recipe=digits_smoke", "kfac=none"], capsys, tmp_path)
    assert status == 0
    printed = yaml.safe_load(out)
    printed.pop("hydra", None)
    assert printed == _composed("+recipe=digits_smoke", "kfac=none")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_cfg_hydra_all_package_and_resolve(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out = _run(["--cfg", "hydra"], capsys, tmp_path)
    assert status == 0 and set(yaml.safe_load(out)) == {"hydra"}
    status, out = _run(["--cfg", "all", "kfac=none"], capsys, tmp_path)
    printed = yaml.safe_load(out)
    assert status == 0 and "hydra" in printed and printed["kfac"]["enabled"] is False
    status, out = _run(["--cfg", "job", "--package", "train", "train.epochs=3"], capsys, tmp_path)
    assert status == 0 and out.startswith("# @package train")
    assert yaml.safe_load(out) == _composed("train.epochs=3")["train"]
    # --resolve replaces interpolations by their values (the ResNet-50 smoke twin's model.num_classes is
    # ${dataset.classes}).
    recipe = "+recipe=resnet50_imagenet_smoke"
    status, out = _run(["--cfg", "job", "-p", "model", recipe], capsys, tmp_path)
    assert status == 0 and "${dataset.classes}" in out
    status, out = _run(["--cfg", "job", "-p", "model", "--resolve", recipe], capsys, tmp_path)
    assert status == 0 and yaml.safe_load(out) == _composed(recipe, resolve=True)["model"]
    assert "${" not in out


@pytest.mark.slow
def test_info_hydra_help_and_a_bad_cfg_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # --info reports through Hydra's logging: run the real CLI to see it on the console.
    done = run_cli("train", "--info", "defaults", "+recipe=digits_smoke", cwd=tmp_path)
    assert done.returncode == 0 and "Defaults List" in done.stdout
    assert "recipe/digits_smoke" in done.stdout and not (tmp_path / "runs").exists()
    done = run_cli("train", "kfac=none", "-i", cwd=tmp_path)
    assert done.returncode == 0 and "Installed Hydra Plugins" in done.stdout
    assert "Defaults List" in done.stdout and "kfac/none" in done.stdout
    status, out = _run(["--hydra-help"], capsys, tmp_path)
    assert status == 0 and "--cfg,-c" in out and "--multirun,-m" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Hydra rejects these too (its parser, or "Only one of --run, --multirun, --cfg, --info and
        # --shell_completion can be specified"), with a usage text or a traceback: here one line.
        (["--cfg", "everything"], "--cfg 'everything' is not one of all, hydra, job"),
        (["--cfg=everything"], "--cfg 'everything' is not one of"),
        (["--cfg"], "is not one of all, hydra, job"),  # the next argument is its value
        (["--info=bogus"], "--info 'bogus' is not one of"),
        (["-m", "kfac=none,comm_opt", "--cfg", "job"], "one of --run, --multirun, --cfg"),
        (["--info", "-c", "job"], "got --cfg, --info"),
    ],
)
def test_what_hydra_rejects_is_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out = _run(args, capsys, tmp_path)
    lines = out.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], out
