"""What ``kfac-bench tune`` writes outside its runs, each through :mod:`kfac_bench.safe_files` (no link
followed, atomic replace): the grid record that lets a stopped tune continue (and refuses another grid in
its folder), the lock that keeps two tunes out of one config dir, and the tuned recipe pair, written as a
unit."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kfac_bench.commands.tuning.rank import Point

__all__ = [
    "GRID_FILE",
    "LOCK_FILE",
    "claim_out",
    "config_lock",
    "held",
    "recipe_text",
    "write_pair",
]

#: The grid record in the tune's folder.
GRID_FILE = "tune.json"
#: The lock, in ``--out-config``'s ``recipe/``, held while a tune may write there.
LOCK_FILE = ".kfac-bench-tune.lock"


def claim_out(out: Path, grid: dict[str, Any]) -> bool:
    """Make (or take up again) the tune's folder: a new or empty folder gets the grid record; a folder
    holding the same grid's record is continued (returns True). Checked before any run.

    Raises:
        UserError: ``out`` is a file, cannot be made, holds another grid or something not a tune's.
    """
    from kfac_bench import safe_files
    from kfac_bench.errors import UserError

    record = out / GRID_FILE
    continuing = out.is_dir() and os.path.lexists(record)
    # The output-folder rule (missing or empty), except for a folder this tune's grid record says it
    # may continue: its runs and tables are the earlier, stopped part of the same tune.
    safe_files.output_folder(
        out,
        f"tune: --out '{out}'",
        "the tune's runs and tables",
        replaceable=(lambda name: True) if continuing else None,
        fix="name a new or empty folder, or the folder of a stopped tune to continue it",
    ).close()
    if continuing:
        text = safe_files.read_head(record, 1 << 20)
        try:
            before = json.loads(text) if text is not None else None
        except ValueError:
            before = None
        if not isinstance(before, dict):
            raise UserError(
                f"tune: {record} is not a tune's grid record; choose a new --out folder"
            )
        differ = [k for k in grid if before.get(k) != grid[k]]
        if differ:
            k = differ[0]
            raise UserError(
                f"tune: --out {out} holds a tune of another grid ({k}: {before.get(k)} there, "
                f"{grid[k]} now); run the same command to continue it, or choose a new --out folder"
            )
        return True
    safe_files.write_atomic(record, json.dumps(grid, indent=1) + "\n")
    return False


@contextlib.contextmanager
def config_lock(config_out: Path) -> Iterator[Path]:
    """``config_out/recipe`` made (not through a link) and locked for this tune: a second tune into the
    same config dir is refused at its start, in one line, before any run.

    Raises:
        UserError: the folder cannot be made, is a link or a file, or another tune holds it.
    """
    from kfac_bench import safe_files
    from kfac_bench.errors import UserError

    named = f"tune: --out-config '{config_out}'"
    # A config dir holds the user's other configs: the tuned pair joins them (written as a unit, under
    # the lock below), so the folder need not be empty.
    safe_files.output_folder(
        config_out, named, "the tuned recipes", replaceable=lambda name: True
    ).close()
    try:
        recipes = safe_files.ensure_dir(config_out / "recipe")
    except OSError as exc:
        raise UserError(f"{named}: cannot make recipe/ there ({exc.strerror})") from None
    if not os.access(recipes, os.W_OK):
        raise UserError(f"{named} is not writable: give a writable folder")
    with held(recipes / LOCK_FILE, f"{named}: another tune is writing its tuned recipes there"):
        yield recipes


@contextlib.contextmanager
def held(lock: Path, busy: str) -> Iterator[None]:
    """An exclusive lock on the file ``lock`` (made if missing, never through a link) for the block.

    Raises:
        UserError: another process holds it: ``busy``, with the lock's path and what to do.
    """
    from kfac_bench import safe_files
    from kfac_bench.errors import UserError

    fd = safe_files.open_in_place(lock, append=True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{busy} (lock {lock}); wait for it to end") from None
        yield
    finally:
        os.close(fd)


def recipe_text(
    path_stem: str,
    parent: str,
    parent_cfg: dict[str, Any],
    best: Point,
    sections: tuple[str, ...],
    arm: str,
    source: str,
    run_command: str,
) -> str:
    """The tuned recipe: ``parent`` with the values ``best``'s runs ran where they differ from the
    parent's, and a tuning record holding exactly those runs' values."""
    import yaml

    from kfac_bench.config import flat_config

    ran = best.values(sections)
    values = json.loads(json.dumps(ran))  # plain data, as summary.json holds it
    parent_flat = flat_config({k: parent_cfg.get(k) or {} for k in sections})
    tuned: dict[str, Any] = {}
    for key, value in flat_config(values).items():
        if key in parent_flat and parent_flat[key] == value:
            continue
        node = tuned
        *parts, last = key.split(".")
        for part in parts:
            node = node.setdefault(part, {})
        node[last] = value
    body = {
        "defaults": [parent, "_self_"],
        "name": path_stem,
        **tuned,
        "tuning": {"arm": arm, "source": source, "values": values},
    }
    header = (
        "# @package _global_\n"
        f"# {run_command}\n"
        f"# Written by kfac-bench tune: recipe {parent} at its best grid point (seeds reaching the target,\n"
        "# then median epochs to target; the clock only where its interval separates). The tuning record\n"
        "# holds the values its runs ran.\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False)


def write_pair(recipes: Path, texts: dict[str, str]) -> None:
    """Put the tuned recipes in place as a unit: every file written and synced under a temporary name
    first, the files it replaces kept under a second temporary name (a hard link), then the new files
    renamed over their names back to back with the stop signals held. A failed rename puts every file
    back as it was (both or neither); a kill leaves the earlier pair or the new one (a SIGKILL could only
    fall between two renames), never a part file or an empty one.

    Raises:
        LinkRefused: a recipe's name is a link (nothing is replaced).
    """
    from kfac_bench import safe_files

    staged: list[tuple[Path, Path]] = []
    kept: dict[Path, Path] = {}
    done: list[Path] = []
    try:
        for name, text in texts.items():
            target = recipes / f"{name}.yaml"
            safe_files.check_not_link(target)
            fd, tmp = safe_files.temp_file(recipes, target.name)
            staged.append((tmp, target))
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        for _, target in staged:
            if os.path.lexists(target):
                fd, old = safe_files.temp_file(recipes, target.name + ".old")
                os.close(fd)
                os.unlink(old)
                os.link(target, old, follow_symlinks=False)
                kept[target] = old
        held = signal.pthread_sigmask(
            signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2}
        )
        try:
            for tmp, target in staged:
                os.replace(tmp, target)
                done.append(target)
        except BaseException:
            for target in done:  # back as it was: the earlier file, or none
                if target in kept:
                    os.replace(kept.pop(target), target)
                else:
                    target.unlink(missing_ok=True)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    finally:
        for path in [*(tmp for tmp, _ in staged), *kept.values()]:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        dfd = os.open(recipes, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
