"""Registration of schemas and recipes with Hydra's ConfigStore.

Schemas are stored as ``schema/<group>/<name>``; every YAML option extends its schema with
``- /schema/<group>/<name>@_here_`` in its defaults list. Recipes are flat YAML files in ``recipes/`` (kept
out of ``configs/`` so the benchmarks are easy to find); each is stored as option ``recipe/<stem>`` with the
package its header declares (``# @package _global_``), so ``+recipe=NAME`` selects it like any group option.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kfac_bench.config import recipes_dir
from kfac_bench.config.families import SCHEMAS as FAMILY_SCHEMAS
from kfac_bench.config.resolvers import register_resolvers
from kfac_bench.config.schema import SCHEMAS, RunConfig
from kfac_bench.errors import ConfigError

__all__ = ["PACKAGE_HEADER", "recipe_names", "register"]

PACKAGE_HEADER = "# @package "
_registered = False


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
            raise ConfigError(
                f"recipe {path} must start with '# @package _global_' (found {package!r})"
            )
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package=package)
    _registered = True
