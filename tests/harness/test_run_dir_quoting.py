"""A run directory reaches the ranks as exactly the path the user named: ``launcher=torchrun`` and the launch
scripts quote ``hydra.run.dir`` for Hydra's override grammar (spaces, non-ASCII, ``,``, ``=``, quotes); the
ranks of one such job also compose the recipe of the user's ``--config-dir``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from kfac_bench.launcher.agent import run_dir_of
from kfac_bench.launcher.torchrun import hydra_quote, run_dir_override
from tests.harness.fault_util import env, one_error_line, run, shim
from tests.harness.util import REPO, TINY_SETTINGS, user_config_dir
from tests.limits import hang_limit

HOSTILE = [
    "runs/x ünï",
    "runs/a,b=c",
    "runs/it's [1,2] {k: v}",
    "back\\slash\\",
    "q\\'q",
    'dq"x',
    "d${x}y \\${z}",
    "~ * ? # ! % ; & | < >",
]


@pytest.mark.parametrize("path", HOSTILE)
def test_a_quoted_path_reads_back_as_itself(path: str) -> None:
    # Hydra's own parser, then OmegaConf's resolution: what a rank's Hydra does with hydra.run.dir.
    value = OverridesParser.create().parse_override(f"hydra.run.dir={hydra_quote(path)}").value()
    assert OmegaConf.create({"d": value}).d == path
    assert (
        run_dir_of(["-m", "kfac_bench.cli", "train", run_dir_override(path)])
        == Path(path).resolve()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "arg", ["hydra.run.dir=/tmp/a,b", "hydra.run.dir=/tmp/ü", "hydra.run.dir=a=b"]
)
def test_an_unquoted_path_hydra_cannot_read_is_one_line(arg: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfac_bench.launcher.agent",
            "--standalone",
            "-m",
            "kfac_bench.cli",
            "train",
            arg,
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    assert result.returncode == 2
    assert "quote it" in one_error_line(result.stderr)


def _agent_args(script: str, tmp_path: Path, extra_env: dict[str, str]) -> list[str]:
    """The arguments ``launch/SCRIPT`` gives ``python -m kfac_bench.launcher.agent`` (a PYTHON shim records
    them; any other python call runs the real interpreter)."""
    log = tmp_path / "agent_args"
    python = tmp_path / "bin" / "python"
    python.parent.mkdir(exist_ok=True)
    shim(
        python,
        f'if [ "$2" = kfac_bench.launcher.agent ]; then printf "%s\\0" "$@" > {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n',
    )
    e = env(PYTHON=str(python), **extra_env)
    result = subprocess.run(
        ["bash", str(REPO / "launch" / script), "kfac=none"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return log.read_text().split("\0")[:-1]


@pytest.mark.parametrize("script", ["slurm.sbatch", "torchrun_multinode.sh"])
def test_the_launch_scripts_quote_the_run_dir(tmp_path: Path, script: str) -> None:
    run_dir = tmp_path / "runs" / "x ünï,a=b's"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim(bin_dir / "scontrol", "echo 127.0.0.1\n")
    shim(bin_dir / "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    extra = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "RUN_DIR": str(run_dir),
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "GPUS_PER_NODE": "2",
        "NNODES": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    args = _agent_args(script, tmp_path, extra)
    assert run_dir_of(args) == run_dir
    overrides = args[args.index("train") + 1 :]
    assert overrides[-1] == "kfac=none"
    OverridesParser.create().parse_overrides(overrides)  # every argument is one valid override


@pytest.mark.distributed
def test_torchrun_ranks_train_the_users_recipe_in_a_run_dir_with_spaces_non_ascii_commas_and_equals(
    tmp_path: Path,
) -> None:
    # What the user named reaches every rank as named: a run directory Hydra's grammar needs quoted for,
    # and a recipe of the user's --config-dir (a space in its path; tests/harness/test_user_config_dir.py
    # checks the CLI's side of it).
    name = "x ünï,a=b"
    result = run(
        "train",
        "-cd",
        str(user_config_dir(tmp_path)),
        *TINY_SETTINGS,
        "+recipe=mine",
        "kfac=none",
        "train.epochs=1",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={hydra_quote('runs/' + name)}",
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [name]
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["name"] == "mine"
    assert summary["config"]["model"]["hidden"] == 16  # the user's recipe, not digits_smoke


@pytest.mark.slow
def test_a_run_dir_with_now_is_one_folder_locked_and_trained_in(tmp_path: Path) -> None:
    # The config is composed once: ${now:...} resolves once, so the folder the lock is taken in is the
    # folder the run trains in (seconds apart, a second composition named another one).
    result = run(
        "train",
        "+recipe=digits_smoke",
        *TINY_SETTINGS,
        "train.epochs=1",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "hydra.run.dir=rd/${now:%H-%M-%S-%f}",
        cwd=tmp_path,
        timeout=hang_limit(120),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = (tmp_path / "rd").iterdir()
    assert {"run.lock", "config.yaml", "summary.json", ".hydra"} <= {
        p.name for p in folder.iterdir()
    }
    recorded = OmegaConf.load(folder / ".hydra" / "hydra.yaml")
    assert Path(str(recorded.hydra.run.dir)) == folder  # the resolved name, recorded once
