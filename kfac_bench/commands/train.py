"""``kfac-bench train``: compose the command line once, then run its jobs.

Each job of the command line (one, or with ``-m`` one per sweep point) is composed exactly once
(:func:`kfac_bench.config.jobs.compose_jobs`) and checked (bounds, device, the task's metrics, the run
directory's path) before any runs, so a mistake is one line and exit status 2. A job's run directory is
resolved once from that composition; the job claims it (lock, checks, ``config.yaml``), records Hydra's
``.hydra/`` there, and trains in this process, or with ``launcher=torchrun`` starts ranks that read the
recorded ``config.yaml`` (``kfac-bench train --rank-of DIR``). A sweep runs its jobs here one after another,
a comparison's arms interleaved, and stops at a preemption signal; with a Hydra launcher plugin
(``hydra/launcher=kfac_slurm``) each prepared job is submitted through submitit and reads its recorded
config on the node. Hydra's printing flags (``--cfg``, ``--info``, ``--hydra-help``) are Hydra's own. In a
rank, only rank 0 prints a user error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kfac_bench.config import config_dir
from kfac_bench.config.command_line import CFG_CHOICES, INFO_CHOICES, config_dirs_of, split_args
from kfac_bench.errors import ConfigError, UserError

if TYPE_CHECKING:
    from kfac_bench.config.jobs import Job
    from kfac_bench.config.schema import RunConfig

__all__ = ["SUMMARY", "PreparedRun", "config_dirs_of", "help_text", "main"]

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
        "  kfac-bench demo                                   # both digits arms x 16 seeds, compared",
        "  kfac-bench train --cfg job                        # print the composed config",
        "",
        "Hydra's own options: kfac-bench train --hydra-help",
    ]
    return "\n".join(lines) + "\n"


def _default_choices() -> dict[str, str]:
    from kfac_bench.config.compose import compose_run

    cfg = compose_run([], return_hydra_config=True)
    return {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items()}


def main(args: Sequence[str]) -> int:
    """``kfac-bench train ARGS``; returns the exit status (the worst over a sweep's jobs)."""
    from kfac_bench.launcher.distributed import detect
    from kfac_bench.launcher.torchrun import RANK_OF_FLAG

    if "--help" in args or "-h" in args:
        print(help_text(), end="")
        return 0
    worker = detect().launched
    if worker:
        from kfac_bench.launcher.agent_tie import tie_to_agent
        from kfac_bench.launcher.signals import catch_early

        tie_to_agent()  # a rank dies with the agent that started it, even a SIGKILLed one
        catch_early()  # a preemption signal during the imports below is kept, not fatal
    if args[:1] == [RANK_OF_FLAG]:
        return _rank_of_prepared_run(Path(args[1]) if len(args) == 2 else None)
    flags, overrides = split_args(args)
    try:
        names = _check_flags(flags)
        multirun = bool(names & {"-m", "--multirun"})
        if names & _HYDRA_ONLY:
            # Hydra's own flags print the config, its help or its information and run no job; what they
            # print is checked first, so a mistake is one line.
            from kfac_bench.config.compose import normalize_overrides

            if names & {"--cfg", "-c", "--info", "-i"}:
                _compose_jobs(overrides, multirun, config_dirs_of(flags), machine=False)
            return _run_hydra([*normalize_overrides(overrides), *flags])
        jobs = _compose_jobs(overrides, multirun, config_dirs_of(flags))
    except UserError as exc:
        if _secondary_rank():
            return exc.exit_code  # rank 0 says it
        raise
    if worker:
        return _as_a_rank(jobs[0], explicit_dir=_names_run_dir(overrides))
    if jobs[0].sweep_dir is not None and _plugin_launcher(jobs[0].config) is not None:
        return _submit(jobs)
    return _run_jobs(jobs)


#: Hydra's flags that print something and run no job: Hydra answers them itself.
_HYDRA_ONLY = {
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--hydra-help",
    "--shell-completion",
    "-sc",
    "--version",
}
#: The flags a run takes; Hydra's others (--config-name, --package, ...) select or print what a
#: kfac-bench run does not use.
_RUN_FLAGS = {"-m", "--multirun", "--run", "-r", "--config-dir", "-cd"}


def _compose_jobs(
    overrides: Sequence[str], multirun: bool, config_dirs: Sequence[str], machine: bool = True
) -> list[Job]:
    """Every job of the command line, composed once and checked before any runs (config bounds, each
    run directory's path, and with ``machine`` the device and the task's metrics).

    Raises:
        ConfigError: one line naming the problem.
    """
    from kfac_bench.config.jobs import compose_jobs
    from kfac_bench.launcher.preflight import check_run
    from kfac_bench.launcher.rundir import check_run_dir_path

    jobs = compose_jobs(overrides, multirun, config_dirs)
    for job in jobs:
        check_run_dir_path(job.run_dir)
        if machine:
            check_run(job.run_config)
    return jobs


def _names_run_dir(overrides: Sequence[str]) -> bool:
    return any(o.startswith("hydra.run.dir=") for o in overrides)


def _run_jobs(jobs: list[Job]) -> int:
    """Run the jobs one after another in this process: claim each job's run directory, record the job
    there (``config.yaml``, Hydra's ``.hydra/``), then train here or start its ranks. Returns the worst exit
    status (a user error is one line). A job stopped by a preemption signal (or a signal between two jobs)
    ends the sweep: no other job starts, exit 75."""
    from kfac_bench.launcher import rundir
    from kfac_bench.launcher.signals import EXIT_REQUEUE, PreemptionFlag
    from kfac_bench.train.run import train

    flag = PreemptionFlag().install()  # between jobs; each run installs its own while it trains
    statuses: list[int] = []
    try:
        for job in jobs:
            if flag.signum is not None:
                statuses.append(EXIT_REQUEUE)
                break
            _configure_logging(job.config)
            with _reported(job.run_dir) as outcome:
                _prepare(job)
                try:
                    cfg, run_dir = job.run_config, job.run_dir
                    world = _checked_world(cfg, run_dir)
                    outcome.code = _launch(cfg, run_dir, world) if world else train(cfg, run_dir)
                finally:
                    rundir.release(run_dir)
            statuses.append(outcome.code)
            if outcome.code == EXIT_REQUEUE:
                break
    finally:
        flag.restore()
    if len(statuses) < len(jobs):
        print(
            f"kfac-bench: sweep stopped by a signal: {len(jobs) - len(statuses)} of its {len(jobs)} "
            f"jobs not started; run the same command with hydra.sweep.dir={jobs[0].sweep_dir} to "
            "finish it (finished jobs are kept, the stopped one resumes)",
            flush=True,
        )
    return max(statuses, default=0)


def _prepare(job: Job) -> None:
    """Create and claim ``job.run_dir`` (lock, checks, ``config.yaml``), then write Hydra's record of the
    job (``.hydra/``): a second run started at once in the same directory leaves no trace.

    Raises:
        UserError: the directory cannot be created or written, is in use, or records another config.
    """
    from kfac_bench.launcher import rundir

    run_dir = rundir.make_run_dir(job.run_dir)
    rundir.claim(run_dir, job.run_config)
    try:
        rundir.record_hydra(run_dir, job.config)
    except BaseException:
        rundir.release(run_dir)
        raise


def _checked_world(cfg: RunConfig, run_dir: Path) -> int:
    """Check the device (and, for ``launcher=torchrun``, a resume's world) before training; returns the
    number of ranks ``launcher=torchrun`` starts, 0 when the run trains in this process."""
    from kfac_bench.launcher.preflight import check_run, job_world

    world = job_world(cfg)  # one reading for the device check and the resume check
    check_run(cfg, world.size)
    if str(cfg.launcher.name.value) != "torchrun":
        return 0
    from kfac_bench.checkpoint.elastic import check_launch

    check_launch(run_dir, cfg, world.size)  # before any rank starts
    return world.size


def _launch(cfg: RunConfig, run_dir: Path, world: int) -> int:
    """Start the ``world`` ranks of the run prepared in ``run_dir`` (each reads its recorded config) and
    supervise them to the end; returns their exit status."""
    from kfac_bench.launcher import rundir
    from kfac_bench.launcher.torchrun import launch_torchrun

    launcher = cfg.launcher
    os.environ[rundir.LOCKED_ENV] = str(run_dir.resolve())
    try:
        return launch_torchrun(
            run_dir, launcher.nproc_per_node, launcher.max_restarts, launcher.monitor_interval
        )
    finally:
        os.environ.pop(rundir.LOCKED_ENV, None)


def _rank_of_prepared_run(run_dir: Path | None) -> int:
    """A rank that ``launcher=torchrun`` started for the run it prepared in ``run_dir``: it trains the
    config recorded there, composed once by the launcher."""
    from kfac_bench.config.jobs import load_run_config
    from kfac_bench.launcher.rundir import CONFIG_FILE
    from kfac_bench.train.run import train

    if run_dir is None:
        raise UserError(f"usage: kfac-bench train {_rank_flag()} RUN_DIR (the launcher's ranks)")
    _configure_logging(None, run_dir)
    try:
        cfg = load_run_config(run_dir / CONFIG_FILE)
    except UserError as exc:
        if _secondary_rank():
            return exc.exit_code
        raise
    with _reported(run_dir) as outcome:
        outcome.code = train(cfg, run_dir)
    return outcome.code


def _rank_flag() -> str:
    from kfac_bench.launcher.torchrun import RANK_OF_FLAG

    return RANK_OF_FLAG


def _as_a_rank(job: Job, explicit_dir: bool) -> int:
    """A rank of a job its launcher did not prepare (``launch/*`` scripts name the run directory; a plain
    ``torchrun -m kfac_bench.cli train`` does not, and every rank then takes rank 0's): rank 0 claims the
    directory and records the job there."""
    from kfac_bench.launcher import rundir
    from kfac_bench.train.run import train

    def record(run_dir: Path) -> None:
        rundir.record_hydra(run_dir, job.config)

    _configure_logging(job.config)
    cfg = job.run_config
    with _reported(job.run_dir) as outcome:
        outcome.code = train(
            cfg, job.run_dir, run_dir_from_rank_0=not explicit_dir, on_claim=record
        )
    return outcome.code


def _configure_logging(cfg: Any, run_dir: Path | None = None) -> None:
    """Python logging as the job's ``hydra.job_logging`` says (the primary config sends it to stdout), as
    Hydra configures it for a job; a process that did not compose reads the job's from its run
    directory's ``.hydra/hydra.yaml``."""
    import yaml
    from hydra.core.utils import configure_log
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    hydra_cfg = None if cfg is None else OmegaConf.select(cfg, "hydra")
    if hydra_cfg is None and run_dir is not None:
        from kfac_bench.launcher.rundir import HYDRA_RECORD

        try:
            hydra_cfg = OmegaConf.select(
                OmegaConf.load(run_dir / HYDRA_RECORD / "hydra.yaml"), "hydra"
            )
        except (OSError, AttributeError, yaml.YAMLError, OmegaConfBaseException):
            # No record (hydra.output_subdir=null) or an unreadable one: the primary config's logging.
            hydra_cfg = None
    if hydra_cfg is None:
        configure_log(OmegaConf.create(_STDOUT_LOGGING))
        return
    configure_log(hydra_cfg.job_logging, hydra_cfg.verbose)


#: ``configs/train.yaml``'s ``hydra/job_logging: stdout`` (Hydra's own file), for a rank whose run
#: directory holds no ``.hydra/`` record.
_STDOUT_LOGGING = {
    "version": 1,
    "formatters": {"simple": {"format": "%(message)s"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "simple",
            "stream": "ext://sys.stdout",
        }
    },
    "root": {"level": "INFO", "handlers": ["console"]},
    "disable_existing_loggers": False,
}


@dataclass
class _Outcome:
    """A run's exit status, set by the code in a :func:`_reported` block or by the failure it reports."""

    code: int = 0


@contextlib.contextmanager
def _reported(run_dir: Path) -> Iterator[_Outcome]:
    """Run the block, reporting the failures that are not the program's as one line and an exit status in
    the outcome: a user error (exit 2, said by rank 0), a lost peer (exit 1, so that torchrun restarts the
    ranks), a full or read-only disk (exit 2). A context, not a wrapper function: the run keeps a shallow
    stack."""
    outcome = _Outcome()
    try:
        yield outcome
    except UserError as exc:
        if not _secondary_rank():
            print(f"kfac-bench: error: {exc}", file=sys.stderr, flush=True)
        outcome.code = exc.exit_code
    except RuntimeError as exc:
        from kfac_bench.launcher.distributed import detect, lost_peer

        reason = lost_peer(exc)
        if reason is None:
            raise
        print(
            f"kfac-bench: error: rank {detect().rank} lost another rank mid-collective ({reason}): "
            "it died or was killed; the ranks restart from the last checkpoint if "
            "launcher.max_restarts allows, else run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        outcome.code = 1
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
        outcome.code = UserError.exit_code


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
    other = sorted(set(names) - _RUN_FLAGS - _HYDRA_ONLY)
    if other and not set(names) & _HYDRA_ONLY:
        raise ConfigError(
            f"kfac-bench train does not take {', '.join(other)}: a run is chosen with +recipe=NAME and "
            "key=value overrides, your own config groups with --config-dir DIR"
        )
    return set(names)


def _secondary_rank() -> bool:
    from kfac_bench.launcher.distributed import detect

    return detect().rank != 0


def _plugin_launcher(cfg: Any) -> Any:
    """The ``hydra.launcher`` section of a sweep that a Hydra launcher plugin runs (SLURM through
    submitit), None for Hydra's basic launcher (the jobs run here, one after another)."""
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    return None if target.endswith("BasicLauncher") or not target else cfg.hydra.launcher


class PreparedRun:
    """A sweep job submitted through submitit: trains the run prepared in ``run_dir`` (its recorded,
    composed config). On submitit's preemption signal the run checkpoints and hands the signal back
    (:meth:`kfac_bench.launcher.signals.PreemptionFlag.hand_back`); :meth:`checkpoint` then requeues this
    same job, which resumes from that checkpoint."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def __call__(self) -> int:
        from kfac_bench.config.jobs import load_run_config
        from kfac_bench.launcher import rundir
        from kfac_bench.train.run import train

        _configure_logging(None, self.run_dir)
        with _reported(self.run_dir) as outcome:
            cfg = load_run_config(self.run_dir / rundir.CONFIG_FILE)
            rundir.claim(self.run_dir, cfg)  # a requeued job claims it again
            try:
                world = _checked_world(cfg, self.run_dir)
                outcome.code = (
                    _launch(cfg, self.run_dir, world) if world else train(cfg, self.run_dir)
                )
            finally:
                rundir.release(self.run_dir)
        return outcome.code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(PreparedRun(self.run_dir), *args, **kwargs)


def _submit(jobs: list[Job]) -> int:
    """Prepare every job's run directory here (claimed, recorded, released), then submit one job each
    through submitit with the sweep's ``hydra.launcher`` settings and wait for them; returns the worst exit
    status."""
    from kfac_bench.launcher import rundir

    try:
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    except ImportError:
        raise UserError(
            "the SLURM sweep launcher needs hydra-submitit-launcher: pip install 'kfac-bench[slurm]'"
        ) from None
    from omegaconf import OmegaConf

    for job in jobs:
        _prepare(job)
        rundir.release(job.run_dir)  # the submitted job claims it again
    settings = {
        str(k): v
        for k, v in OmegaConf.to_container(_plugin_launcher(jobs[0].config), resolve=True).items()  # type: ignore[union-attr]
    }
    cluster = "local" if str(settings.pop("_target_")).endswith("LocalLauncher") else "slurm"
    init = {"folder": settings.pop("submitit_folder")}
    if "max_num_timeout" in settings:  # as hydra-submitit-launcher maps its settings
        init[f"{cluster}_max_num_timeout"] = settings.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=cluster, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{k if k in base else f"{cluster}_{k}": v for k, v in settings.items()}
    )
    submitted = [executor.submit(PreparedRun(job.run_dir.resolve())) for job in jobs]
    print(
        f"kfac-bench: submitted {len(submitted)} jobs of sweep {jobs[0].sweep_dir} "
        f"({', '.join(str(s.job_id) for s in submitted)})",
        flush=True,
    )
    return max(int(s.result()) for s in submitted)


def _run_hydra(args: list[str]) -> int:
    """Hydra's application for its own flags (``--cfg``, ``--info``, ``--hydra-help``, ...), which
    print and run no job."""
    import hydra
    from omegaconf import DictConfig

    from kfac_bench.config.compose import PRIMARY
    from kfac_bench.config.store import register

    register()

    @hydra.main(config_path=str(config_dir()), config_name=PRIMARY, version_base="1.3")
    def job(cfg: DictConfig) -> None:
        raise AssertionError("Hydra runs no job for its printing flags")

    saved = sys.argv
    sys.argv = ["kfac-bench-train", *args]
    try:
        job()
    finally:
        sys.argv = saved
    return 0
