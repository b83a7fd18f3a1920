"""Build step: ship the top-level ``configs/`` and ``recipes/`` inside the wheel.

All metadata lives in pyproject.toml. The two folders stay at the top of the source tree, where users look
for them; building a wheel copies them to ``kfac_bench/_configs`` and ``kfac_bench/_recipes``, which
:func:`kfac_bench.config.config_dir` / ``recipes_dir`` prefer when present (a non-editable install).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"configs": "_configs", "recipes": "_recipes"}


class BuildPyWithConfigs(build_py):
    """``build_py`` that also copies the Hydra config groups and the recipes into the package."""

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
