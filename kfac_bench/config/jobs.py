"""The jobs of a ``kfac-bench train`` command line, each composed once, checked, with its run directory.

A command line is one job, or with ``-m`` one job per point of its sweep (Hydra's override grammar:
``a=1,2``, ``range(...)``, ``glob(...)``). Each job's config is composed here exactly once; its run
directory is resolved from that composition once (``${now:...}`` and ``${uid:}`` included) and written back
into it as a literal, so the lock, the run, the ranks (which read the run directory's ``config.yaml``) and a
SLURM job all see one directory and one config.

A sweep's jobs run interleaved: the jobs of one seed (one replicate) run back to back, one per arm, and
which arm goes first rotates from seed to seed, whatever order the overrides were given in. A comparison
then never sets one arm's seeds in one stretch of time and the other's in another, where a change of
machine load would read as a difference between the arms.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf, open_dict

from kfac_bench.config import hydra_quote
from kfac_bench.config.schema import RunConfig

__all__ = [
    "Job",
    "compose_jobs",
    "interleave",
    "job_part",
    "load_run_config",
    "sweep_points",
    "typed",
]

#: The override that makes replicates of one arm: jobs that differ only in it are one arm.
REPLICATE_KEY = "train.seed"
#: Most sweep points one command line may expand to (a typo like range(0,100000) stops in one line).
MAX_JOBS = 10_000


@dataclass(frozen=True)
class Job:
    """One run of a command line: its number in the run order, its own overrides, its composed config
    (with ``hydra``; the run directory resolved), and its run directory."""

    num: int
    overrides: tuple[str, ...]
    config: DictConfig
    run_dir: Path
    #: The sweep folder for a ``-m`` job (the jobs' campaign), else None.
    sweep_dir: Path | None = None

    @property
    def run_config(self) -> RunConfig:
        """The run's own config (no ``hydra``), typed by the run schema it was composed with."""
        return typed(job_part(self.config))


def typed(cfg: DictConfig) -> RunConfig:
    """A config composed with the run schema, seen as the :class:`RunConfig` it is built from (OmegaConf's
    structured configs keep the dataclass's fields and types)."""
    return cast(RunConfig, cfg)


def job_part(cfg: DictConfig) -> DictConfig:
    """The run's own config: everything but ``hydra``."""
    return OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """Every point of the sweep ``overrides`` describe (one list of plain overrides each), in Hydra's
    basic sweeper's order (the cartesian product, the last sweep varying fastest).

    Raises:
        ConfigError: an override does not parse, or the sweep has more than :data:`MAX_JOBS` points.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from kfac_bench.config.compose import normalize_overrides, to_config_error
    from kfac_bench.errors import ConfigError

    try:
        parsed = OverridesParser.create().parse_overrides(normalize_overrides(overrides))
    except HydraException as exc:
        raise to_config_error(exc) from None
    choices: list[list[str]] = []
    size = 1
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            values = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            values = [str(o.input_line)]
        size *= max(len(values), 1)
        if size > MAX_JOBS:
            raise ConfigError(
                f"the sweep has more than {MAX_JOBS} jobs; split it into smaller sweeps"
            )
        choices.append(values)
    return [list(point) for point in itertools.product(*choices)]


def interleave(points: Sequence[Sequence[str]]) -> list[list[str]]:
    """``points`` reordered so that a comparison's arms alternate in time: grouped by replicate (the value
    of ``train.seed``, in order of first appearance), each replicate's arms back to back, the arm that goes
    first rotating by one from replicate to replicate. An arm is the set of everything else a point
    overrides. A sweep with one arm, or one replicate, keeps its order."""
    arms: dict[tuple[str, ...], int] = {}
    replicates: dict[str, list[tuple[int, list[str]]]] = {}
    for point in points:
        arm = tuple(o for o in point if _key(o) != REPLICATE_KEY)
        seed = next((o for o in point if _key(o) == REPLICATE_KEY), "")
        index = arms.setdefault(arm, len(arms))
        replicates.setdefault(seed, []).append((index, list(point)))
    ordered: list[list[str]] = []
    for turn, members in enumerate(replicates.values()):
        members.sort(key=lambda m: (m[0] - turn) % len(arms))
        ordered += [point for _, point in members]
    return ordered


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def compose_jobs(
    overrides: Sequence[str], multirun: bool, config_dirs: Sequence[str] = ()
) -> list[Job]:
    """Compose and check every job of a command line (all before any runs), in the order they run.

    Raises:
        ConfigError: one line naming the bad key, option, value or run directory (the first bad job's).
    """
    if not multirun:
        cfg = _composed(overrides, config_dirs)
        run_dir = _resolve_dir(cfg, "hydra.run.dir").absolute()
        with open_dict(cfg):
            cfg.hydra.run.dir = str(run_dir)
            cfg.hydra.runtime.output_dir = str(run_dir)
        return [Job(0, tuple(overrides), cfg, run_dir)]
    jobs: list[Job] = []
    sweep_dir: Path | None = None
    for num, point in enumerate(interleave(sweep_points(overrides))):
        fixed = [] if sweep_dir is None else [f"hydra.sweep.dir={hydra_quote(str(sweep_dir))}"]
        cfg = _composed([*point, *fixed], config_dirs)
        if sweep_dir is None:  # the first job's, resolved once: every job's folder is inside it
            sweep_dir = _resolve_dir(cfg, "hydra.sweep.dir")
        with open_dict(cfg):
            cfg.hydra.sweep.dir = str(sweep_dir)
            cfg.hydra.job.num = num
            cfg.hydra.job.id = str(num)
            cfg.hydra.overrides.task = list(point)
            if cfg.train.get("campaign") is None:
                cfg.train.campaign = str(sweep_dir)  # compare never pools two sweeps
        run_dir = sweep_dir.absolute() / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
        jobs.append(Job(num, tuple(point), cfg, run_dir, sweep_dir))
    return jobs


def _composed(overrides: Sequence[str], config_dirs: Sequence[str]) -> DictConfig:
    from kfac_bench.config.bounds import validate_run
    from kfac_bench.config.compose import compose_run

    cfg = compose_run(overrides, return_hydra_config=True, config_dirs=config_dirs)
    validate_run(cfg)
    return cfg


def _resolve_dir(cfg: DictConfig, key: str) -> Path:
    """The directory ``key`` names, resolved now (once).

    Raises:
        ConfigError: it does not resolve.
    """
    from omegaconf.errors import OmegaConfBaseException

    from kfac_bench.errors import ConfigError

    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key} does not resolve: {str(exc).splitlines()[0]}") from None
    return Path(str(value))


def load_run_config(recorded: Mapping[str, Any] | Path) -> RunConfig:
    """A run's config as recorded in its run directory (``config.yaml``, resolved), typed by the run
    schema again (enums, bounds), so that a rank trains exactly the config its launcher composed.

    Raises:
        ConfigError: the file cannot be read or does not fit the schema.
    """
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    from kfac_bench.errors import ConfigError

    if isinstance(recorded, Path):
        try:
            recorded = yaml.safe_load(recorded.read_bytes().decode("utf-8"))
        except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
            raise ConfigError(
                f"cannot read the run's recorded config ({type(exc).__name__}: {exc}); start the run "
                "again from its command line"
            ) from None
    if not isinstance(recorded, Mapping):
        raise ConfigError("the run's recorded config is not a mapping; start the run again")
    schema = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(schema, False)  # keys a command line added with +key=...
    try:
        cfg = OmegaConf.merge(schema, recorded)
    except OmegaConfBaseException as exc:
        raise ConfigError(
            f"the run's recorded config does not fit the schema: {str(exc).splitlines()[0]}"
        ) from None
    assert isinstance(cfg, DictConfig)
    return typed(cfg)
