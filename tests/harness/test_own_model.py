"""docs/own_model.md holds: its files, written out as the page shows them, and its commands, run as the page
gives them (``kfac-bench`` as ``python -m kfac_bench.cli``), train, tune and compare a user's own model and
dataset from a config dir of theirs, with no change to the package and the one PYTHONPATH step the page
gives."""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.util import REPO, cli_env
from tests.limits import hang_limit

PAGE = REPO / "docs" / "own_model.md"
FILE = re.compile(r"^File `([^`]+)`:\n\n```\w*\n(.*?)^```", re.MULTILINE | re.DOTALL)
BASH = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)


def page_files() -> dict[str, str]:
    return dict(FILE.findall(PAGE.read_text()))


def page_commands() -> list[str]:
    (block,) = BASH.findall(PAGE.read_text())
    return [line for line in block.splitlines() if line.strip()]


def test_the_page_shows_its_files_and_commands() -> None:
    files = page_files()
    assert {
        "my_project/wine_bench.py",
        "my_project/conf/model/wine_mlp.yaml",
        "my_project/conf/dataset/wine.yaml",
        "my_project/conf/recipe/wine.yaml",
        "my_project/conf/recipe/wine_sgd.yaml",
    } == set(files)
    commands = page_commands()
    assert commands[:2] == ["cd my_project", "export PYTHONPATH=$PWD"]
    assert [c.split()[1] for c in commands[2:]] == ["train", "tune", "train", "compare"]


@pytest.mark.slow
def test_own_model_is_trained_tuned_and_compared_as_the_page_says(tmp_path: Path) -> None:
    for name, text in page_files().items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    project = tmp_path / "my_project"
    env = cli_env()
    # The package as installed (this checkout first), plus the page's one step: the project's folder.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(project)])
    for command in page_commands()[2:]:
        args = shlex.split(command)
        assert args[0] == "kfac-bench"
        done = subprocess.run(
            [sys.executable, "-m", "kfac_bench.cli", *args[1:]],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=hang_limit(300),
            check=False,
        )
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        if args[1] == "tune":
            printed = done.stdout
    recipes = project / "conf" / "recipe"
    assert {p.name for p in recipes.glob("*_tuned.yaml")} == {
        "wine_tuned.yaml",
        "wine_sgd_tuned.yaml",
    }
    # The follow-up tune printed is the one the page runs, up to the config dir's absolute path.
    follow = next(line.strip() for line in printed.splitlines() if "train -m" in line)
    sweep = "kfac-bench train -m train.seed=2,3,4 +recipe=wine_sgd_tuned,wine_tuned"
    assert follow == f"{sweep} --config-dir {project / 'conf'}"
    rows = list(csv.DictReader((project / "runs" / "compare" / "compare.csv").open()))
    assert [r["run"] for r in rows] == ["SGD", "SGD + K-FAC (COMM-OPT)"]
    assert [r["seeds"] for r in rows] == ["2 3 4", "2 3 4"]
    assert rows[0]["fairness"] == "tuning record present and matched"
    assert rows[1]["fairness"].startswith("tuning record present and matched; same dataset")
    assert rows[1]["claim"] in ("faster", "slower", "none")
