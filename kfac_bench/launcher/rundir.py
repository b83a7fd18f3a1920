"""A run directory belongs to one run: an exclusive lock, the recorded config, and the preemption marker.

Files it keeps in the run directory:
    ``run.lock``: ``flock``-ed exclusively for the run's life by the process that owns the run (the
        launching process under ``launcher=torchrun``, else rank 0). The kernel drops the lock when that
        process exits, however it exits (SIGKILL included), so a stale lock cannot block a resume. Its text
        names the holder (pid, host, start time) for the message a second run prints.
    ``config.yaml``: the composed, resolved config, written when the run is claimed. Resuming checks the
        new config against it: keys other than :data:`MAY_CHANGE_ON_RESUME` must be equal.
    ``preempted``: written by rank 0 after a preemption checkpoint (and the summary), removed when the
        run starts again. It carries "preempted" across torchrun, which turns a rank's exit status into
        its own: launchers requeue when it is there, and only then.
    ``diverged``: written by rank 0 when the run diverged (a non-finite loss, or non-finite weights,
        optimizer or K-FAC state at a checkpoint, which is then not written): the step and what was
        non-finite. Running the same command again stops with one line instead of resuming into NaN
        (``train.resume=false`` starts the run over and removes it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from kfac_bench import safe_files
from kfac_bench.config import flat_config
from kfac_bench.config.schema import RunConfig
from kfac_bench.errors import ConfigError, UserError

__all__ = [
    "CONFIG_FILE",
    "DIVERGED_FILE",
    "LOCKED_ENV",
    "LOCK_FILE",
    "MAY_CHANGE_ON_RESUME",
    "PREEMPTED_FILE",
    "WRITTEN",
    "check_config",
    "check_not_diverged",
    "check_planted",
    "check_run_dir_path",
    "claim",
    "clear_preempted",
    "config_drift",
    "lock",
    "locked_by_launcher",
    "make_run_dir",
    "mark_diverged",
    "mark_preempted",
    "probe_lock",
    "record_config",
    "record_hydra",
    "release",
    "was_preempted",
]

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"
PREEMPTED_FILE = "preempted"
#: Hydra's record of the job (config, Hydra's own config, the command line's overrides), as Hydra writes it.
HYDRA_RECORD = ".hydra"
DIVERGED_FILE = "diverged"
#: Set by a launching process that holds the lock for its ranks (the value is the run directory).
LOCKED_ENV = "KFAC_BENCH_LOCKED_RUN_DIR"

#: Config keys a resumed run may change (``*`` matches any key below a section). Everything else defines
#: the run (model, data, optimizer, schedule, K-FAC, seed, batch sizes, targets, evaluation cadence: they
#: change its numbers or its time to target) and must stay as recorded.
MAY_CHANGE_ON_RESUME: tuple[str, ...] = (
    # Extend (or shorten) the budget of a run that has not finished; a schedule whose length is the run's
    # follows the new length from the resumed step on.
    "train.epochs",
    "train.max_steps",
    # How the run is displayed and logged, not what it computes.
    "train.progress",
    "train.log_every_steps",
    "train.tensorboard",
    "train.tracker",
    "train.tracker_uri",
    "train.tracker_project",
    "kfac.track_stage_times",
    # Checkpoint cadence and retention: what a preemptible queue tunes.
    "train.checkpoint_every_epochs",
    "train.checkpoint_every_steps",
    "train.keep_checkpoints",
    "train.checkpoint_at_end",
    "train.resume",
    # Where and how the same computation runs: input workers, CPU threads, evaluation batch (evaluation
    # sums over examples), DDP's unused-parameter search, stopping once the target is met.
    "train.num_workers",
    "train.cpu_threads",
    "train.eval_batch_size",
    "train.find_unused_parameters",
    "train.stop_at_target",
    # How the ranks are started (torchrun restarts, monitor interval, ranks per node).
    "launcher.*",
)

#: What a run writes in its directory (files, then folders), and Hydra's record of the job (``.hydra/``,
#: written before the job starts): a link planted at one of these names is refused when the run starts.
WRITTEN: tuple[str, ...] = (
    LOCK_FILE,
    CONFIG_FILE,
    PREEMPTED_FILE,
    DIVERGED_FILE,
    "summary.json",
    "eval.jsonl",
    "mlperf.log",
    "tracker.json",
    "world.json",
    "predictions.json",
    "checkpoints",
    "tb",
    "mlruns",
    "wandb",
    ".hydra",
    ".hydra/config.yaml",
    ".hydra/hydra.yaml",
    ".hydra/overrides.yaml",
)

_held: dict[Path, int] = {}


def check_run_dir_path(path: str | Path) -> None:
    """Refuse a run directory whose path holds ``${``: Hydra stores the directory it creates in its config,
    where the ranks and Hydra's own ``.hydra/`` writer would read it as an interpolation, so the run would
    not land (whole) in the directory named.

    Raises:
        UserError: one line.
    """
    if "${" in str(path):
        raise UserError(
            f"run dir {path} contains '${{', which Hydra would resolve as an interpolation in the ranks "
            "(the run would land elsewhere); choose a path without '${'"
        )


def check_planted(run_dir: Path) -> None:
    """Refuse a run directory in which a name the run (or Hydra) writes is a symbolic link.

    Raises:
        UserError: one line naming the link and its target (which is left as it was).
    """
    for name in WRITTEN:
        safe_files.check_not_link(Path(run_dir) / name)


def _holder_text(path: Path) -> str:
    text = (safe_files.read_head(path, 200) or "").strip()
    return text.splitlines()[0] if text else "another process"


def lock(run_dir: Path) -> None:
    """Take the run directory's exclusive lock for this process (a no-op if it holds it already).

    Raises:
        UserError: another run holds it, or the directory cannot be written (one line).
    """
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = safe_files.open_in_place(path, append=False)  # never through a planted link
    except OSError as exc:
        raise UserError(
            f"cannot write to run dir {run_dir}: {exc.strerror or exc}; "
            "choose a writable hydra.run.dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"run dir {run_dir} is in use by another run ({_holder_text(path)}); wait for it to "
            "end or choose another hydra.run.dir"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        print(
            f"kfac-bench: warning: the filesystem of {run_dir} does not support locks "
            f"({exc.strerror}): a second run in this directory would not be stopped",
            file=sys.stderr,
            flush=True,
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode())
    _held[run_dir] = fd


def release(run_dir: Path) -> None:
    """Drop this process's lock on ``run_dir`` (process exit does it too)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def probe_lock(run_dir: Path) -> None:
    """Fail if another process holds ``run_dir``'s lock, without taking it (a launcher whose ranks will
    take it; never creates anything).

    Raises:
        UserError: another run holds it.
    """
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_FILE
    if run_dir in _held:
        return
    if safe_files.lock_held(path):
        raise UserError(
            f"run dir {run_dir} is in use by another run ({_holder_text(path)}); wait for it to "
            "end or choose another hydra.run.dir"
        )


def locked_by_launcher(run_dir: Path, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process's launcher holds ``run_dir``'s lock for it (``launcher=torchrun``)."""
    env = os.environ if env is None else env
    held = env.get(LOCKED_ENV)
    return held is not None and Path(held).resolve() == Path(run_dir).resolve()


def _plain(cfg: RunConfig | DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        return dict(cfg)
    # A composed config (typed as RunConfig), or a RunConfig built in code.
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def config_drift(
    recorded: Mapping[str, Any], current: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, current value) of every key that differs, other than
    :data:`MAY_CHANGE_ON_RESUME` (a key only one side has counts, with ``<unset>`` on the other)."""
    old = flat_config(recorded, MAY_CHANGE_ON_RESUME)
    new = flat_config(current, MAY_CHANGE_ON_RESUME)
    drift = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if a != b:
            drift.append((key, a, b))
    return drift


def check_config(run_dir: Path, cfg: RunConfig | DictConfig | Mapping[str, Any]) -> None:
    """Stop if ``run_dir`` records a run with another config.

    Raises:
        ConfigError: one line naming the differing keys (recorded -> now); or the directory holds
            checkpoints without a recorded config and the run would resume from them.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        resume = (_plain(cfg).get("train") or {}).get("resume", True)
        if resume and _holds_checkpoints(Path(run_dir)):
            raise ConfigError(
                f"run dir {Path(run_dir).resolve()} holds checkpoints but no {CONFIG_FILE}: the config "
                "they were trained with is unknown, so a resume could mix two configs. Restore "
                f"{path}, or start the run over with train.resume=false, or choose another hydra.run.dir"
            )
        return
    try:
        recorded = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"cannot read the recorded config {path} ({type(exc).__name__}); restore it or choose "
            "another hydra.run.dir"
        ) from None
    drift = config_drift(recorded if isinstance(recorded, dict) else {}, _plain(cfg))
    if not drift:
        return
    shown = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in drift[:6])
    more = f" and {len(drift) - 6} more" if len(drift) > 6 else ""
    raise ConfigError(
        f"run dir {Path(run_dir).resolve()} holds a run with another config: {shown}{more}; resume with "
        f"the values in {path} or choose another hydra.run.dir"
    )


def _holds_checkpoints(run_dir: Path) -> bool:
    """Whether a resume would read a checkpoint here (a manifest, or a legacy ``last.pt``)."""
    folder = run_dir / "checkpoints"
    return any(
        next(folder.glob(pattern), None) is not None for pattern in ("step-*.json", "last.pt")
    )


def record_config(run_dir: Path, cfg: DictConfig | RunConfig) -> None:
    """Write ``config.yaml`` (resolved), atomically."""
    safe_files.write_atomic(Path(run_dir) / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))


def make_run_dir(run_dir: Path) -> Path:
    """``run_dir``, created with its parents if missing, checked writable; returns it resolved.

    Raises:
        UserError: it cannot be created, or is not writable (one line).
    """
    run_dir = Path(run_dir).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create run dir {run_dir}: {exc.strerror or exc}; choose a writable hydra.run.dir"
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise UserError(f"run dir {run_dir} is not writable; choose a writable hydra.run.dir")
    return run_dir


def record_hydra(run_dir: Path, cfg: DictConfig) -> None:
    """Write Hydra's record of the job (``cfg`` with its ``hydra`` section) into ``hydra.output_subdir``
    (``.hydra/``; none when it is null): ``config.yaml`` (the job's config as composed, unresolved),
    ``hydra.yaml`` and ``overrides.yaml``, as Hydra's own runner writes them, through
    :mod:`kfac_bench.safe_files` (no link followed). Call it once the directory is claimed."""
    subdir = OmegaConf.select(cfg, "hydra.output_subdir")
    if subdir is None:
        return
    folder = safe_files.ensure_dir(Path(run_dir) / str(subdir))
    job = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
    safe_files.write_atomic(folder / "config.yaml", OmegaConf.to_yaml(job))
    safe_files.write_atomic(folder / "hydra.yaml", OmegaConf.to_yaml({"hydra": cfg.hydra}))
    overrides = OmegaConf.to_container(cfg.hydra.overrides.task)
    safe_files.write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(overrides))


def claim(run_dir: Path, cfg: DictConfig | RunConfig) -> None:
    """Make ``run_dir`` this run's: take the lock, check that no name it writes is a planted link and that
    ``checkpoints/`` holds only the run's own checkpoints, that the run there did not diverge and that the
    config is the recorded one, remove temporary files a killed writer left, record the config, and remove
    an earlier attempt's preemption marker.

    Raises:
        UserError: the directory is in use, not writable, holds a diverged run, or records another config
            (one line).
    """
    check_planted(run_dir)  # before the lock file too: a refused run dir is left as it was
    lock(run_dir)
    try:
        check_planted(run_dir)  # again, under the lock
        from kfac_bench.checkpoint.files import check_folder

        check_folder(Path(run_dir) / "checkpoints")  # one the run did not write: before any work
        if (_plain(cfg).get("train") or {}).get("resume", True):
            check_not_diverged(run_dir)
        else:
            (Path(run_dir) / DIVERGED_FILE).unlink(missing_ok=True)  # the run starts over
        check_config(run_dir, cfg)
        for orphan in Path(run_dir).glob(".*.tmp"):  # left by a writer that was killed mid-write
            orphan.unlink(missing_ok=True)
        record_config(run_dir, cfg)
        clear_preempted(run_dir)
    except OSError as exc:
        release(run_dir)
        raise UserError(f"cannot write to run dir {run_dir}: {exc.strerror or exc}") from None
    except BaseException:
        release(run_dir)
        raise


def mark_preempted(run_dir: Path, step: int, signum: int | None) -> None:
    """Record that the run stopped for preemption at ``step`` with its checkpoint written."""
    name = f"signal {signum}" if signum is not None else "signal"
    safe_files.write_atomic(Path(run_dir) / PREEMPTED_FILE, f"step {step} {name}\n")


def mark_diverged(run_dir: Path, step: int, what: str, last_checkpoint: Path | None) -> None:
    """Record that the run diverged at ``step`` (``what``: which values were non-finite) and which
    checkpoint is its last finite one."""
    kept = f"last finite checkpoint {last_checkpoint}" if last_checkpoint else "no checkpoint"
    safe_files.write_atomic(Path(run_dir) / DIVERGED_FILE, f"step {step}: {what}; {kept}\n")


def check_not_diverged(run_dir: Path) -> None:
    """Stop if the run in ``run_dir`` diverged: resuming it would continue into NaN.

    Raises:
        UserError: one line naming the step, what diverged and how to go on.
    """
    path = Path(run_dir) / DIVERGED_FILE
    if not os.path.lexists(path):
        return
    text = "".join(
        c if c.isprintable() else " " for c in (safe_files.read_head(path) or "")
    ).strip()
    text = text or "unreadable marker"
    raise UserError(
        f"run dir {Path(run_dir).resolve()} holds a run that diverged ({text}): resuming would diverge "
        "again. Start a new hydra.run.dir with a lower optimizer.lr (or train.resume=false to start this "
        f"one over); to resume from its last finite checkpoint anyway, delete {path}"
    )


def clear_preempted(run_dir: Path) -> None:
    (Path(run_dir) / PREEMPTED_FILE).unlink(missing_ok=True)


def was_preempted(run_dir: Path) -> bool:
    path = Path(run_dir) / PREEMPTED_FILE
    return path.is_file() and not path.is_symlink()
