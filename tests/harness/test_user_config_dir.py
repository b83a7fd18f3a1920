"""A user's own configs through Hydra's ``--config-dir`` (``DIR/recipe/NAME.yaml`` for ``+recipe=NAME``) pass
the CLI's checks (the ranks of ``launcher=torchrun`` training one: tests/harness/test_run_dir_quoting.py);
a config file that is not valid YAML (the user's, or one in ``recipes/``) is one line naming the file and
line, exit 2, and leaves the rest working."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kfac_bench.cli import main
from kfac_bench.commands.train import config_dirs_of
from kfac_bench.config import recipes_dir
from tests.harness.fault_util import env, one_error_line
from tests.harness.util import user_config_dir
from tests.limits import hang_limit

BROKEN = "# @package _global_\nname: [oops\nmodel: {hidden: 16}\n"


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    d = user_config_dir(tmp_path)
    (d / "recipe" / "broken.yaml").write_text(BROKEN)
    return d


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["train", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_config_dir_flags_in_every_form() -> None:
    assert config_dirs_of(
        ["--config-dir", "a", "-cd", "b", "--config-dir=c=d", "--cfg", "job"]
    ) == [
        "a",
        "b",
        "c=d",
    ]


@pytest.mark.parametrize("form", ["--config-dir", "--config-dir=", "-cd"])
def test_a_recipe_of_the_users_config_dir_is_composed(
    form: str, user_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(user_dir.parent)
    flag = [form + user_dir.name] if form.endswith("=") else [form, user_dir.name]
    status, out, err = _main([*flag, "+recipe=mine", "--cfg", "job"], capsys)
    assert status == 0, err
    printed = yaml.safe_load(out)
    assert printed["name"] == "mine" and printed["model"]["hidden"] == 16
    assert printed["model"]["channels"] == 8  # from digits_smoke, the bundled recipe it extends


def test_the_users_invalid_yaml_and_a_missing_dir_are_one_line(
    user_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _main(["-cd", str(user_dir), "+recipe=broken", "--cfg", "job"], capsys)
    assert status == 2
    line = one_error_line(err)
    assert f"{user_dir / 'recipe' / 'broken.yaml'}, line 3" in line and "not valid YAML" in line

    status, _, err = _main(["-cd", str(user_dir / "nope"), "+recipe=mine"], capsys)
    assert status == 2 and "is not a directory" in one_error_line(err)


_WITH_BROKEN_RECIPES = """
import contextlib, io, json, sys
from pathlib import Path
import kfac_bench.config as config
config.recipes_dir = lambda: Path(sys.argv[1])
from kfac_bench.cli import main
out = {}
for args in (["--help"], ["train", "--help"], ["train", "+recipe=zz_broken"],
             ["train", "+recipe=zz_headless"], ["train", "+recipe=digits_smoke", "--cfg", "job"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(args)
    out[" ".join(args)] = [status, err.getvalue()]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_invalid_bundled_recipe_is_one_line_and_the_others_still_work(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    shutil.copytree(recipes_dir(), recipes)
    (recipes / "zz_broken.yaml").write_text(BROKEN)
    (recipes / "zz_headless.yaml").write_text("name: x\n")
    result = subprocess.run(
        [sys.executable, "-c", _WITH_BROKEN_RECIPES, str(recipes)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)
    for ok in ("--help", "train --help", "train +recipe=digits_smoke --cfg job"):
        assert got[ok] == [0, ""], ok
    status, err = got["train +recipe=zz_broken"]
    assert status == 2
    line = one_error_line(err)
    assert f"recipe {recipes / 'zz_broken.yaml'}, line 3, column 6 is not valid YAML" in line
    status, err = got["train +recipe=zz_headless"]
    assert status == 2 and "must start with '# @package _global_'" in one_error_line(err)
