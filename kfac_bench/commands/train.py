"""``kfac-bench train``: validate the command line, then run it as a Hydra application.

The command line is composed once up front (:func:`kfac_bench.config.compose.compose_run`) and every value
checked against its schema's bounds, so config mistakes give one line and exit status 2 before Hydra starts;
sweeps (``-m``) are checked value by value. An explicit ``hydra.run.dir`` that another run holds, or that
records another config, is refused before Hydra writes into it. The Hydra job then checks what needs the
machine (device, the task's metrics), and either trains in this process (:func:`kfac_bench.train.run.train`)
or, with ``launcher=torchrun``, claims the run directory and starts the ranks, each of which runs this
command again. In a rank, only rank 0 prints a user error.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfac_bench.config import config_dir
from kfac_bench.config.command_line import CFG_CHOICES, INFO_CHOICES, config_dirs_of, split_args
from kfac_bench.errors import ConfigError, UserError

__all__ = ["SUMMARY", "check_overrides", "config_dirs_of", "help_text", "main"]

SUMMARY = """\
  train     train a model: kfac-bench train [+recipe=NAME] [group=option] [key=value ...]
            (kfac-bench train --help lists the config groups, options and recipes)"""

#: Hydra runs in one of these modes; naming two is an error in any Hydra application.
_MODES = {
    "--run": "--run",
    "-r": "--run",
    "--multirun": "--multirun",
    "-m": "--multirun",
    "--cfg": "--cfg",
    "-c": "--cfg",
    "--info": "--info",
    "-i": "--info",
    "--shell-completion": "--shell-completion",
    "-sc": "--shell-completion",
}
_MAX_SWEEP_CHECKS = 32
#: Write failures that are the machine's, not the program's: one line and status 2.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def help_text() -> str:
    """The config groups with their options, and the recipes."""
    # Composing imports Hydra and the engine: done on use, so `kfac-bench --help` stays instant.
    from kfac_bench.config.compose import compose_run
    from kfac_bench.config.store import recipe_names

    lines = ["usage: kfac-bench train [-m] [+recipe=NAME] [group=option ...] [key=value ...]", ""]
    lines.append("config groups (group=option; the default is marked *):")
    defaults = compose_run([], return_hydra_config=False).keys()
    root = config_dir()
    chosen = _default_choices()
    for group in sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in (root / group).glob("*.yaml"))
        shown = [o + ("*" if chosen.get(group) == o else "") for o in options]
        lines.append(f"  {group:12s} {', '.join(shown)}")
    launchers = sorted(f.stem for f in (root / "hydra" / "launcher").glob("*.yaml"))
    lines.append(
        f"  {'hydra/launcher':12s} basic*, {', '.join(launchers)} (needs 'kfac-bench[slurm]')"
    )
    lines += [
        "",
        f"recipes (+recipe=NAME; default {chosen.get('recipe')}): {', '.join(recipe_names())}",
        "",
    ]
    lines.append(f"top-level keys: {', '.join(str(k) for k in defaults)}")
    lines += [
        "",
        "examples:",
        "  kfac-bench train                                  # the bundled digits job (SGD + K-FAC, CPU)",
        "  kfac-bench train +recipe=digits_sgd train.epochs=5  # its first-order baseline, shorter",
        "  kfac-bench train +recipe=digits launcher=torchrun launcher.nproc_per_node=2 train.device=cpu",
        "  kfac-bench train -m +recipe=digits_sgd,digits train.seed=0,1,2  # a sweep (Hydra multirun)",
        "  kfac-bench demo                                   # both digits arms x 3 seeds, compared",
        "  kfac-bench train --cfg job                        # print the composed config",
        "",
        "Hydra's own options: kfac-bench train --hydra-help",
    ]
    return "\n".join(lines) + "\n"


def _default_choices() -> dict[str, str]:
    from kfac_bench.config.compose import compose_run

    cfg = compose_run([], return_hydra_config=True)
    return {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items()}


def check_overrides(
    overrides: Sequence[str], multirun: bool, config_dirs: Sequence[str] = ()
) -> Any:
    """Compose the config for ``overrides`` (each sweep value in turn when ``multirun``, with the user's
    ``config_dirs`` on the search path) and check every bounded value; returns the composed config (with
    ``hydra``) of a single run, else None.

    Raises:
        ConfigError: one line naming the problem.
    """
    from kfac_bench.config.compose import normalize_overrides

    if not multirun:
        return _compose_checked(overrides, config_dirs)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(normalize_overrides(overrides))
    base = [str(o.input_line) if not o.is_sweep_override() else _first(o) for o in parsed]
    _compose_checked(base, config_dirs)
    checks = 0
    for i, o in enumerate(parsed):
        if not o.is_sweep_override():
            continue
        for value in list(o.sweep_string_iterator())[1:]:
            if checks >= _MAX_SWEEP_CHECKS:
                return None
            variant = list(base)
            variant[i] = f"{o.get_key_element()}={value}"
            _compose_checked(variant, config_dirs)
            checks += 1
    return None


def _compose_checked(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from kfac_bench.config.bounds import validate_run
    from kfac_bench.config.compose import compose_run
    from kfac_bench.launcher.rundir import check_run_dir_path

    cfg = compose_run(overrides, return_hydra_config=True, config_dirs=config_dirs)
    validate_run(cfg)
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        try:
            path = str(OmegaConf.select(cfg, key))
        except OmegaConfBaseException:
            continue  # resolved only in the job (e.g. ${hydra.job.num}): Hydra's to report
        check_run_dir_path(path)
    return cfg


def _first(override: object) -> str:
    value = next(iter(override.sweep_string_iterator()))  # type: ignore[attr-defined]
    return f"{override.get_key_element()}={value}"  # type: ignore[attr-defined]


def main(args: Sequence[str]) -> int:
    """``kfac-bench train ARGS``; returns the exit status (the worst over a sweep's jobs)."""
    from kfac_bench.launcher.torchrun import inside_launched_worker

    if "--help" in args or "-h" in args:
        print(help_text(), end="")
        return 0
    worker = inside_launched_worker()
    if worker:
        from kfac_bench.launcher.lifeline import tie_to_agent
        from kfac_bench.launcher.signals import catch_early

        tie_to_agent()  # a rank dies with the agent that started it, even a SIGKILLed one
        catch_early()  # a preemption signal during the imports below is kept, not fatal
    from kfac_bench.config.compose import normalize_overrides

    flags, overrides = split_args(args)
    locked: Path | None = None
    try:
        names = _check_flags(flags)
        if not names & {"--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--version"}:
            cfg = check_overrides(
                overrides, bool(names & {"-m", "--multirun"}), config_dirs_of(flags)
            )
            if cfg is not None and not names & {"--cfg", "-c"}:
                from kfac_bench.launcher.preflight import check_run

                check_run(cfg)
                _check_planted(cfg, overrides)  # before Hydra writes .hydra/ there
                if not worker:
                    locked = _check_explicit_run_dir(cfg, overrides)
    except UserError as exc:
        if _secondary_rank():
            return exc.exit_code  # rank 0 says it
        raise
    shared = _run_dir_from_rank_0(overrides, multirun=bool(names & {"-m", "--multirun"}))
    if shared and _secondary_rank():
        # Hydra would create a directory of this rank's own (another time stamp and suffix) holding only
        # .hydra/; the rank trains in rank 0's instead (kfac_bench.train.run.train), so it writes none.
        overrides = [*overrides, "hydra.output_subdir=null", "hydra.run.dir=."]
    try:
        # Overrides first, then the flags with their values: Hydra's parser (argparse) takes the overrides
        # as one run of positionals and refuses an override after a flag, while the launch scripts put
        # hydra.run.dir= before the user's arguments (--config-dir DIR ...); a flag with an optional value
        # (-i) stays without one, as split_args read it.
        return _run_hydra([*normalize_overrides(overrides), *flags], shared)
    finally:
        if locked is not None:
            from kfac_bench.launcher import rundir

            rundir.release(locked)


def _run_dir_from_rank_0(overrides: Sequence[str], multirun: bool) -> bool:
    """Whether this is a rank of a job started without a run directory (a plain ``torchrun -m kfac_bench.cli
    train``): every rank would generate a name of its own, so all take rank 0's. The launchers and launch
    scripts name one (``hydra.run.dir``) for every rank."""
    from kfac_bench.launcher.distributed import detect
    from kfac_bench.launcher.torchrun import inside_launched_worker

    if multirun or not inside_launched_worker() or not detect().distributed:
        return False
    return not any(o.startswith("hydra.run.dir=") for o in overrides)


def _check_flags(flags: list[str]) -> set[str]:
    """The names of the flags given (``--cfg=job`` is ``--cfg``), after the checks Hydra makes itself, so
    that their failures are one line like every other user error.

    Raises:
        ConfigError: two of Hydra's modes at once (``-m`` with ``--cfg``, ...), or a ``--cfg`` / ``--info``
            value that is not one of Hydra's choices.
    """
    names: list[str] = []
    values: dict[str, str] = {}
    for i, flag in enumerate(flags):
        if not flag.startswith("-"):
            continue  # the value of the flag before
        name, eq, value = flag.partition("=")
        names.append(name)
        nxt = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("-") else ""
        values[name] = value if eq else nxt
    modes = sorted({_MODES[n] for n in names if n in _MODES})
    if len(modes) > 1:
        raise ConfigError(
            f"Hydra takes one of --run, --multirun, --cfg, --info, --shell-completion; got {', '.join(modes)}"
        )
    for name, choices in (("--cfg", CFG_CHOICES), ("-c", CFG_CHOICES)):
        if name in values and values[name] not in choices:
            raise ConfigError(
                f"{name} '{values[name]}' is not one of {', '.join(sorted(choices))} (e.g. {name} job)"
            )
    for name in ("--info", "-i"):
        if values.get(name) and values[name] not in INFO_CHOICES:
            raise ConfigError(
                f"{name} '{values[name]}' is not one of {', '.join(sorted(INFO_CHOICES))}"
            )
    return set(names)


def _secondary_rank() -> bool:
    from kfac_bench.launcher.distributed import detect

    return detect().rank != 0


def _check_explicit_run_dir(cfg: Any, overrides: Sequence[str]) -> Path | None:
    """A ``hydra.run.dir`` given on the command line must be writable, free, and (if it holds a run)
    record this config. Its lock is taken here, before Hydra writes its ``.hydra/`` files there, so of two
    runs started at once in one directory the loser leaves no trace (the job's claim then finds the lock
    held by this process). Returns the locked directory, for the caller to release."""
    from kfac_bench.launcher import rundir

    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        return None
    run_dir = Path(str(cfg.hydra.run.dir)).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create run dir {run_dir}: {exc.strerror or exc}; choose a writable hydra.run.dir"
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise UserError(f"run dir {run_dir} is not writable; choose a writable hydra.run.dir")
    rundir.lock(run_dir)
    try:
        rundir.check_config(run_dir, _job_part(cfg))
    except BaseException:
        rundir.release(run_dir)
        raise
    return run_dir


def _check_planted(cfg: Any, overrides: Sequence[str]) -> None:
    """Refuse a ``hydra.run.dir`` given on the command line in which a name the run or Hydra writes
    (``.hydra/config.yaml`` ...) is a symbolic link: Hydra would write through it. (A generated run
    directory is new, with a random suffix.)"""
    from kfac_bench.launcher import rundir

    if any(o.startswith("hydra.run.dir=") for o in overrides):
        rundir.check_planted(Path(str(cfg.hydra.run.dir)).resolve())


def _job_part(cfg: Any) -> Any:
    """The run's own config (everything but ``hydra``)."""
    from omegaconf import OmegaConf

    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def _run_hydra(args: list[str], run_dir_from_rank_0: bool = False) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from kfac_bench.config.compose import PRIMARY
    from kfac_bench.config.resolvers import register_resolvers
    from kfac_bench.config.store import register

    register()
    statuses: list[int] = []

    @hydra.main(config_path=str(config_dir()), config_name=PRIMARY, version_base="1.3")
    def job(cfg: DictConfig) -> None:
        # Referenced here so that a submitit job, unpickling this function in a fresh process, imports
        # the resolvers before Hydra resolves the job's directory (${uid:}).
        register_resolvers()
        hc = HydraConfig.get()
        # The directory Hydra created, read as stored: Hydra saves the resolved path, in which a literal
        # `${` of the user's path would be resolved a second time on access.
        runtime = OmegaConf.to_container(hc.runtime, resolve=False)
        assert isinstance(runtime, dict)
        run_dir = Path(str(runtime["output_dir"]))
        # The ranks of launcher=torchrun compose the same config: the user's --config-dir goes with them.
        user_dirs = [
            f"--config-dir={src.path.removeprefix('file://')}"
            for src in hc.runtime.config_sources
            if src.provider == "command-line" and src.schema == "file"
        ]
        from hydra.types import RunMode

        from kfac_bench.metrics.summary import CAMPAIGN_ENV

        if hc.mode == RunMode.MULTIRUN:  # the sweep folder is the jobs' campaign (summary.json)
            os.environ[CAMPAIGN_ENV] = str(hc.sweep.dir)
        try:
            statuses.append(
                _job(cfg, run_dir, [*user_dirs, *hc.overrides.task], run_dir_from_rank_0)
            )
        except UserError as exc:
            if not _secondary_rank():
                print(f"kfac-bench: error: {exc}", file=sys.stderr, flush=True)
            statuses.append(exc.exit_code)
        except RuntimeError as exc:
            from kfac_bench.launcher.distributed import detect, lost_peer

            reason = lost_peer(exc)
            if reason is None:
                raise
            # Not a user error: exit 1, so that torchrun restarts the ranks from the last checkpoint.
            print(
                f"kfac-bench: error: rank {detect().rank} lost another rank mid-collective ({reason}): "
                "it died or was killed; the ranks restart from the last checkpoint if "
                "launcher.max_restarts allows, else run the same command again to resume",
                file=sys.stderr,
                flush=True,
            )
            statuses.append(1)
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS:
                raise
            if not _secondary_rank():
                print(
                    f"kfac-bench: error: cannot write to {exc.filename or run_dir}: {exc.strerror}; "
                    "free space (or make the run dir writable) and run the same command to resume",
                    file=sys.stderr,
                    flush=True,
                )
            statuses.append(UserError.exit_code)
        finally:
            os.environ.pop(CAMPAIGN_ENV, None)

    saved = sys.argv
    sys.argv = ["kfac-bench-train", *args]
    try:
        job()
    finally:
        sys.argv = saved
    return max(statuses, default=0)


def _job(cfg: Any, run_dir: Path, overrides: list[str], run_dir_from_rank_0: bool = False) -> int:
    from kfac_bench.launcher import rundir
    from kfac_bench.launcher.preflight import check_run, job_world
    from kfac_bench.launcher.torchrun import inside_launched_worker, launch_torchrun

    world = job_world(cfg)  # one reading for the device check and the resume check
    check_run(cfg, world.size)
    launcher = cfg.launcher
    if str(launcher.name.value) == "torchrun" and not inside_launched_worker():
        # This process owns the run for its ranks: the lock, the recorded config, the marker.
        rundir.claim(run_dir, cfg)
        os.environ[rundir.LOCKED_ENV] = str(run_dir.resolve())
        try:
            from kfac_bench.checkpoint.elastic import check_launch

            check_launch(run_dir, cfg, world.size)  # before any rank starts
            return launch_torchrun(
                overrides,
                run_dir,
                launcher.nproc_per_node,
                launcher.max_restarts,
                launcher.monitor_interval,
            )
        finally:
            os.environ.pop(rundir.LOCKED_ENV, None)
            rundir.release(run_dir)
    from kfac_bench.train.run import train

    return int(train(cfg, run_dir, run_dir_from_rank_0=run_dir_from_rank_0))
