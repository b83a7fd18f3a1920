"""configs/, recipes/ and launch/ ship in the wheel: a non-editable install composes and runs a recipe and
says where its launch scripts are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness.util import REPO, cli_env
from tests.limits import hang_limit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy of the tracked sources so the test leaves no build/ folder in the checkout.
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=hang_limit(300),
    )
    (found,) = out.glob("kfac_bench-*.whl")
    return found


def test_wheel_contains_configs_and_recipes(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "configs").rglob("*.yaml"):
        assert f"kfac_bench/_configs/{path.relative_to(REPO / 'configs')}" in names
    for path in (REPO / "recipes").glob("*.yaml"):
        assert f"kfac_bench/_recipes/{path.name}" in names
    assert "kfac_bench/_recipes/README.md" in names


def test_wheel_contains_the_launch_scripts(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    scripts = {p.name for p in (REPO / "launch").iterdir() if p.is_file()}
    assert {"slurm.sbatch", "torchrun_multinode.sh", "bert_chain.sh"} <= scripts
    assert {f"kfac_bench/_launch/{name}" for name in scripts} <= names


def test_installed_wheel_runs_a_recipe_outside_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=hang_limit(300),
    )
    env = cli_env()
    env["PYTHONPATH"] = str(target) + os.pathsep + env.get("PYTHONPATH", "")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kfac_bench.config as c; print(c.config_dir()); print(c.recipes_dir())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split() == [
        str(target / "kfac_bench" / "_configs"),
        str(target / "kfac_bench" / "_recipes"),
    ]
    where = subprocess.run(
        [sys.executable, "-m", "kfac_bench.cli", "launch-scripts"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    launch = Path(where.stdout.strip())
    assert launch == target / "kfac_bench" / "_launch"
    assert (launch / "slurm.sbatch").read_text() == (REPO / "launch" / "slurm.sbatch").read_text()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfac_bench.cli",
            "train",
            "+recipe=digits_smoke",
            "kfac=none",
            "train.limit_train_batches=2",
            "train.epochs=1",
            "train.cpu_threads=1",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
