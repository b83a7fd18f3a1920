"""A user's ``--config-dir`` on the SLURM / multinode path, in each of Hydra's forms (``--config-dir DIR``,
``--config-dir=DIR``, ``-cd DIR``): ``launch/slurm.sbatch`` hands it to the agent unchanged, the agent's
checks before any rank starts compose the user's recipe with it, and a rank's command line (with
``hydra.run.dir=`` before the flag) composes it too. A two-rank SLURM job that trains it is
tests/harness/test_slurm.py's."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from kfac_bench.cli import main
from kfac_bench.errors import ConfigError
from kfac_bench.launcher.agent import _preflight
from tests.harness.fault_util import sbatch, slurm_env
from tests.harness.util import TINY_SETTINGS, user_config_dir
from tests.limits import hang_limit

FORMS = ["--config-dir", "--config-dir=", "-cd"]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    return user_config_dir(tmp_path)


def _flag(form: str, directory: str) -> list[str]:
    return [form + directory] if form.endswith("=") else [form, directory]


def _agent_args(train_args: list[str], run_dir: Path) -> list[str]:
    """The agent's command line as launch/slurm.sbatch builds it (one node, two ranks)."""
    return [
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29500",
        "--rdzv-id=1",
        "--max-restarts=0",
        "-m",
        "kfac_bench.cli",
        "train",
        f"hydra.run.dir={run_dir}",
        *train_args,
    ]


@pytest.mark.parametrize("form", FORMS)
def test_the_agent_checks_compose_the_users_recipe(
    form: str, user_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(user_dir.parent)  # a relative DIR, as typed on the submit node
    run_dir = tmp_path / "run"
    args = _agent_args([*_flag(form, user_dir.name), *TINY_SETTINGS, "+recipe=mine"], run_dir)
    cfg = _preflight(args, run_dir)
    assert cfg.name == "mine" and cfg.model.hidden == 16
    assert cfg.model.channels == 8  # from digits_smoke, the bundled recipe it extends


@pytest.mark.parametrize("form", FORMS)
def test_a_flag_between_overrides_is_taken(
    form: str, user_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a rank runs: ``train hydra.run.dir=... --config-dir DIR ...`` (Hydra's own parser refuses an
    override after a flag)."""
    args = ["+recipe=mine", *_flag(form, str(user_dir)), "train.epochs=3", "--cfg", "job"]
    status = main(["train", *args])
    out = capsys.readouterr()
    assert status == 0, out.err
    printed = yaml.safe_load(out.out)
    assert printed["name"] == "mine" and printed["train"]["epochs"] == 3


@pytest.mark.parametrize("form", FORMS)
def test_the_agent_checks_a_missing_config_dir_in_one_line(form: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = _agent_args([*_flag(form, str(tmp_path / "nope")), *TINY_SETTINGS], run_dir)
    with pytest.raises(ConfigError, match=r"nope \(--config-dir\) is not a directory"):
        _preflight(args, run_dir)


@pytest.mark.parametrize("form", FORMS)
def test_the_sbatch_script_hands_the_flag_to_the_agent_unchanged(
    form: str, user_dir: Path, tmp_path: Path
) -> None:
    # srun records the command it would start on every node instead of starting it.
    record = tmp_path / "srun.args"
    e = slurm_env(tmp_path, srun=f'printf "%s\\n" "$@" > {shlex.quote(str(record))}\n')
    train_args = [*_flag(form, str(user_dir)), *TINY_SETTINGS, "+recipe=mine"]
    job = sbatch(tmp_path, e, *train_args)
    _, err = job.communicate(timeout=hang_limit(60))
    assert job.returncode == 0, err[-3000:]
    command = record.read_text().splitlines()
    tail = command[command.index("kfac_bench.cli") :]
    assert tail[1] == "train" and tail[2].startswith("hydra.run.dir=")
    assert tail[3:] == train_args
