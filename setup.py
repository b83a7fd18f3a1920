"""Build step: ship the top-level ``configs/``, ``recipes/`` and ``launch/`` inside the wheel.

All metadata lives in pyproject.toml. The folders stay at the top of the source tree, where users look
for them; building a wheel copies them to ``kfac_bench/_configs``, ``kfac_bench/_recipes`` and
``kfac_bench/_launch``, which :func:`kfac_bench.config.config_dir` / ``recipes_dir`` / ``launch_dir`` prefer
when present (a non-editable install; ``kfac-bench launch-scripts`` prints where the scripts are).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"configs": "_configs", "recipes": "_recipes", "launch": "_launch"}


class BuildPyWithConfigs(build_py):
    """``build_py`` that also copies the Hydra config groups, the recipes and the launch scripts into the
    package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the folders in the source tree
        for source, target in SHIPPED.items():
            destination = Path(self.build_lib) / "kfac_bench" / target
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(
                ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )


setup(cmdclass={"build_py": BuildPyWithConfigs})
