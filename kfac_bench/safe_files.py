"""Writing files inside a run directory without following links: the one way every harness writer creates,
replaces, appends to or truncates a file there.

A run directory may be shared (a group-writable project folder, a scratch space): whoever can write it can
plant a symbolic link named like a file the run writes (``run.lock``, ``summary.json``, ``mlperf.log``, a
temporary file) pointing at a file of the job's user. Every write therefore goes through one of

* :func:`write_atomic`: a new file from :func:`tempfile.mkstemp` in the same folder (an unpredictable name,
  created with ``O_EXCL``, so never through a link), fsynced if asked, then renamed over the name (a rename
  replaces a link, it never writes through one). A name that is a link is refused first.
* :func:`open_in_place`: a file kept open and written where it is (the lock, an append-only log), opened
  with ``O_NOFOLLOW`` and refused unless it is a regular file with one name (a hard link to another file
  is refused too);
* :func:`ensure_dir`: a folder the run writes into (``checkpoints/``, ``tb/``), refused if it is a link.

Outside run directories, :func:`output_folder` is the folder a command writes its results into (``compare``,
``plan``), made or refused in one line.

A refusal is a :class:`LinkRefused`: one line naming the planted path and what it points at; the target is
never opened for writing. The run directory's own path, and the folders above it, are the user's to choose
and are not checked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kfac_bench.errors import UserError

__all__ = [
    "LinkRefused",
    "check_not_link",
    "ensure_dir",
    "open_in_place",
    "output_folder",
    "read_head",
    "refusal",
    "replace_file",
    "temp_file",
    "write_atomic",
]


class LinkRefused(UserError):
    """A path the run would write is a symbolic link, a hard link or not a regular file (one line)."""


def _describe(path: Path) -> str:
    try:
        return f"a symbolic link to {os.readlink(path)}"
    except OSError:
        pass
    try:
        st = os.lstat(path)
    except OSError:
        return "not a regular file"
    if stat.S_ISREG(st.st_mode):
        return f"a file with {st.st_nlink} hard links" if st.st_nlink > 1 else "a regular file"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "not a regular file"


def _umask() -> int:
    """This process's umask, read without changing it (``/proc``; 0o022 where that is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _new_temp(folder: Path | str, name: str) -> tuple[int, Path]:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    with contextlib.suppress(OSError):  # as open() would create it (mkstemp makes it 0600)
        os.fchmod(fd, 0o666 & ~_umask())
    return fd, Path(tmp)


def refusal(path: Path | str) -> LinkRefused:
    """The one-line error for ``path``, which the run will not write through."""
    path = Path(path)
    return LinkRefused(
        f"refusing to write {path}: it is {_describe(path)}, which the run did not create; remove it "
        "(the run dir may be writable by others: use a private hydra.run.dir)"
    )


def check_not_link(path: Path | str) -> None:
    """Raise :class:`LinkRefused` if ``path`` is a symbolic link (a missing path is fine)."""
    if os.path.islink(path):
        raise refusal(path)


def ensure_dir(path: Path | str) -> Path:
    """``path`` as a folder of the run (created if missing, with its parents).

    Raises:
        LinkRefused: ``path`` is a symbolic link or not a folder.
    """
    path = Path(path)
    if os.path.lexists(path) and (os.path.islink(path) or not path.is_dir()):
        raise refusal(path)
    path.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path) or not path.is_dir():
        raise refusal(path)
    return path


def output_folder(out: Path | str, named: str, what: str) -> Path:
    """``out``, created with its parents, for a command's results (``what``, e.g. "the comparison's
    files"); ``named`` is how the error names it (``--out 'DIR'``, ``plan.out=DIR``).

    Raises:
        UserError: ``out`` is a file, or cannot be created (one line).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{named} is a file, not a folder: give a folder for {what}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"{named} cannot be created ({exc.strerror}): give a writable folder"
        ) from None
    return out


def replace_file(
    path: Path | str, write: Callable[[BinaryIO], object], *, fsync: bool = False
) -> Path:
    """Replace ``path`` with a file that ``write`` fills (given the open binary file), so that readers see
    the old or the new content, never a part, and nothing is written through a link.

    Raises:
        LinkRefused: ``path`` is a symbolic link (its target is left as it was).
        OSError: the folder cannot take the file (nothing is left behind).
    """
    path = Path(path)
    check_not_link(path)
    fd, tmp = _new_temp(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_atomic(path: Path | str, data: bytes | str, *, fsync: bool = False) -> Path:
    """Replace ``path`` with a file holding ``data`` (text is UTF-8): :func:`replace_file`."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return replace_file(path, lambda f: f.write(raw), fsync=fsync)


def temp_file(folder: Path | str, name: str) -> tuple[int, Path]:
    """(open descriptor, path) of a new, empty file in ``folder`` with an unpredictable name starting
    ``.NAME.`` and ending ``.tmp``, for a writer that streams into it and renames it into place."""
    return _new_temp(folder, name)


def open_in_place(path: Path | str, *, append: bool = True, create: bool = True) -> int:
    """A descriptor of ``path`` open for writing where it is (``append``: at its end, else read-write from
    the start), created if ``create`` and missing; never through a link.

    Raises:
        LinkRefused: ``path`` is a symbolic link, has another hard link, or is not a regular file (a FIFO,
            a device): nothing is written.
        FileNotFoundError: ``path`` is missing and not ``create``.
        OSError: it cannot be opened.
    """
    path = Path(path)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO must not block
    flags |= (os.O_WRONLY | os.O_APPEND) if append else os.O_RDWR
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise refusal(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise refusal(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_head(path: Path | str, limit: int = 4096) -> str | None:
    """The first ``limit`` bytes of the regular file ``path`` as text (undecodable bytes replaced), or None
    if it is missing, a link or unreadable: for small markers whose content is only shown to the user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
