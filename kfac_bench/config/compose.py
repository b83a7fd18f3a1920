"""Composing a run's config outside ``@hydra.main`` and turning Hydra's errors into one-line user errors.

The CLI composes the command line once before handing it to Hydra: a misspelt key, an unknown option or a
value of the wrong type then stops the run with one line (exit code 2) instead of Hydra's multi-line report.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kfac_bench.config import config_dir, hydra_quote
from kfac_bench.config.store import broken_recipe, register, yaml_error_line
from kfac_bench.errors import ConfigError, UserError

__all__ = ["PRIMARY", "compose_run", "instantiate", "to_config_error"]

PRIMARY = "train"
_MISSING = re.compile(r"Could not (?:find|load) '([^']+)'")
_OPTIONS = re.compile(r"Available options in '[^']+':\n((?:\t.*\n?)*)")
_NOT_IN_STRUCT = re.compile(r"Key '([^']+)' not in '([^']+)'")
_FULL_KEY = re.compile(r"full_key: (\S+)")
_OVERRIDE = re.compile(r"Could not override '([^']+)'")
_MERGING = re.compile(r"Error merging override (\S+)")


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """Accept ``+recipe=NAME`` (the documented form) for the ``recipe`` group, which the primary config
    already selects (``recipe: digits``, the bundled default job); Hydra itself only takes ``recipe=NAME``
    for a group in the defaults list. Selecting a recipe replaces the default one as a whole."""
    return [re.sub(r"^\+{1,2}recipe=", "recipe=", o) for o in overrides]


def compose_run(
    overrides: Sequence[str],
    return_hydra_config: bool = False,
    config_dirs: Sequence[str | Path] = (),
) -> DictConfig:
    """The composed run config for command-line ``overrides`` (``key=value`` strings), with the user's
    ``config_dirs`` (Hydra's ``--config-dir``: e.g. ``DIR/recipe/NAME.yaml`` for ``+recipe=NAME``) on
    the search path.

    Raises:
        ConfigError: with one line naming the bad key, option or value (or file, for invalid YAML).
    """
    register()
    overrides = normalize_overrides(overrides)
    _check_group_choices(overrides)
    if config_dirs:
        overrides.append(_search_path_override(config_dirs))
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="kfac_bench"):
            return compose(PRIMARY, overrides=overrides, return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        raise to_config_error(exc) from None


def _check_group_choices(overrides: Sequence[str]) -> None:
    """A config group's option names a file of that group's folder (``recipe=NAME``: ``recipe/NAME.yaml``
    on the search path): a path (``/``, ``..``) would load YAML from anywhere.

    Raises:
        ConfigError: one line naming the override.
    """
    groups = {p.name for p in config_dir().iterdir() if p.is_dir()} | {"recipe"}
    for override in overrides:
        key, eq, value = override.partition("=")
        group = key.lstrip("+~")
        if not eq or "." in group or "@" in group:
            continue
        if (group in groups or group.startswith("hydra/")) and re.search(
            r"[/\\]|(^|,)\.\.?($|,)", value
        ):
            raise ConfigError(
                f"invalid option in '{override}': a {group} option is a name from its folder, not a path; "
                f"put your own YAML in DIR/{group}/NAME.yaml and pass --config-dir DIR"
            )


def _search_path_override(config_dirs: Sequence[str | Path]) -> str:
    paths = []
    for d in config_dirs:
        path = Path(d).resolve()
        if not path.is_dir():
            raise ConfigError(
                f"config dir {path} (--config-dir) is not a directory; give one that is"
            )
        paths.append(hydra_quote(f"file://{path}"))
    return f"hydra.searchpath=[{','.join(paths)}]"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def to_config_error(exc: BaseException) -> ConfigError:
    """One-line :class:`ConfigError` for an exception raised while composing a config."""
    for cause in _chain(exc):
        if isinstance(cause, yaml.YAMLError):
            mark = getattr(cause, "problem_mark", None)
            return ConfigError("config " + yaml_error_line(getattr(mark, "name", "file"), cause))
    text = "\n".join(str(e) for e in _chain(exc))
    missing = _MISSING.search(text)
    if isinstance(exc, MissingConfigException) or missing:
        what = missing.group(1) if missing else "config"
        group, _, name = what.rpartition("/")
        options = _OPTIONS.search(text)
        valid = (
            ", ".join(o.strip() for o in options.group(1).splitlines() if o.strip())
            if options
            else ""
        )
        if group == "hydra/launcher" and name.startswith("submitit"):
            return ConfigError(
                "the SLURM sweep launcher needs hydra-submitit-launcher: pip install 'kfac-bench[slurm]'"
            )
        label = group or "config"
        broken = broken_recipe(name) if group == "recipe" else None
        if broken is not None:
            return ConfigError(broken)
        return ConfigError(f"unknown {label} '{name}'; valid names: {valid or '(none)'}")
    key = _NOT_IN_STRUCT.search(text)
    if key:
        full = _FULL_KEY.search(text)
        name = full.group(1) if full else key.group(1)
        return ConfigError(f"unknown config key '{name}' (not a field of {key.group(2)})")
    override = _OVERRIDE.search(text)
    if override:
        # A dict value merged into an existing dict (train.targets={top_1: 0.5}) fails on the inner key:
        # name that key, not the dict the override assigns.
        full = _FULL_KEY.search(text)
        name = full.group(1) if full and "is not in struct" in text else override.group(1)
        return ConfigError(f"unknown config key '{name}' (use +{name}=... only to add a new key)")
    merging = _MERGING.search(text)
    if merging:
        causes = [str(e).splitlines()[0] for e in _chain(exc)[1:] if str(e)]
        detail = causes[0] if causes else "invalid value"
        return ConfigError(f"invalid override '{merging.group(1)}': {detail}")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return ConfigError("invalid config: " + (lines[0] if lines else type(exc).__name__))


def instantiate(cfg: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (containers as plain Python), re-raising a builder's
    :class:`~kfac_bench.errors.UserError` as itself so the CLI reports it in one line."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(cfg, _convert_="all", **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, UserError):
            raise exc.__cause__ from None
        raise
