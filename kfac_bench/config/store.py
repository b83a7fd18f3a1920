"""Registration of schemas and recipes with Hydra's ConfigStore.

Schemas are stored as ``schema/<group>/<name>``; every YAML option extends its schema with
``- /schema/<group>/<name>@_here_`` in its defaults list. Recipes are flat YAML files in ``recipes/`` (kept
out of ``configs/`` so the benchmarks are easy to find); each is stored as option ``recipe/<stem>`` with the
package its header declares (``# @package _global_``), so ``+recipe=NAME`` selects it like any group option.
A recipe file that is not valid YAML is left out, and selecting it gives one line naming the file and line
(:func:`broken_recipe`): every other recipe, and ``--help``, still work.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kfac_bench.config import recipes_dir
from kfac_bench.config.families import SCHEMAS as FAMILY_SCHEMAS
from kfac_bench.config.resolvers import register_resolvers
from kfac_bench.config.schema import SCHEMAS, RunConfig

__all__ = ["PACKAGE_HEADER", "broken_recipe", "recipe_names", "register", "yaml_error_line"]

PACKAGE_HEADER = "# @package "
_registered = False
#: Recipe name -> why its file cannot be read (one line), filled by :func:`register`.
_broken: dict[str, str] = {}


def yaml_error_line(path: Path | str, exc: BaseException) -> str:
    """One line for a YAML file that does not parse: the file, the line and column, and the problem."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = (
        f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    )
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where} is not valid YAML ({problem}); fix the file or move it away"


def broken_recipe(name: str) -> str | None:
    """Why recipe ``name``'s file cannot be read, if it is one that :func:`register` left out."""
    return _broken.get(name)


def recipe_names() -> list[str]:
    """Names accepted by ``+recipe=NAME``, sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def _recipe_package(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith(PACKAGE_HEADER):
            return line[len(PACKAGE_HEADER) :].strip()
        if line.strip() and not line.startswith("#"):
            break
    return None


def register() -> None:
    """Store every schema and recipe, and register the config resolvers (idempotent)."""
    global _registered
    register_resolvers()
    if _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, name, schema in [*SCHEMAS, *FAMILY_SCHEMAS]:
        cs.store(group=f"schema/{group}", name=name, node=schema)
    for path in sorted(recipes_dir().glob("*.yaml")):
        package = _recipe_package(path)
        if package != "_global_":
            _broken[path.stem] = (
                f"recipe {path} must start with '# @package _global_' (found {package!r})"
            )
            continue
        try:
            node = OmegaConf.load(path)
        except yaml.YAMLError as exc:
            _broken[path.stem] = f"recipe {yaml_error_line(path, exc)}"
            continue
        cs.store(group="recipe", name=path.stem, node=node, package=package)
    _registered = True
