"""Writing files without following links: the one way every harness writer creates, replaces, appends to or
truncates a file, inside a run directory or a command's output folder.

A run directory may be shared (a group-writable project folder, a scratch space): whoever can write it can
plant a symbolic link named like a file the run writes (``run.lock``, ``summary.json``, ``mlperf.log``, a
temporary file) pointing at a file of the job's user, or swap a folder the run writes (``checkpoints/``) for
a link to another folder after the run looked at it. Every write therefore names its file *inside a folder
opened once*, by descriptor (:class:`Folder`; ``dir_fd`` for open, rename, link, unlink, stat), and is
one of

* :meth:`Folder.replace` / :meth:`Folder.write` (:func:`replace_file` / :func:`write_atomic` by path): a new
  file under an unpredictable temporary name in the same folder (created with ``O_EXCL|O_NOFOLLOW``, so never
  through a link), fsynced if asked, then renamed over the name (a rename replaces a link, it never writes
  through one). A name that is a link is refused first.
* :meth:`Folder.open_in_place` (:func:`open_in_place`): a file kept open and written where it is (the lock,
  an append-only log), opened with ``O_NOFOLLOW`` and refused unless it is a regular file with one name (a
  hard link to another file is refused too);
* :meth:`Folder.sub` / :meth:`Folder.open` (:func:`ensure_dir`): a folder the run writes into
  (``checkpoints/``, ``tb/``), opened with ``O_NOFOLLOW|O_DIRECTORY``: a link is refused, and a folder
  swapped for a link after it was opened is never followed (the open descriptor still names the folder
  that was opened, wherever it was moved).

A writer that writes several files, or checks a folder and then writes into it, opens the folder once
(``with Folder.open(path, create=True) as d:``) and does everything through ``d``: a path checked once is not
trusted again.

Outside run directories, :func:`output_folder` is the folder a command writes its results into (``compare
--out``, ``plan.out``, ``demo --out``, ``prepare-bert --output-dir``, ``tune --out``), under one rule
(docs/operations.md): the folder is missing (it is made) or empty; anything else is refused in one line before
the command does any work. It returns the open :class:`Folder` that the command writes every file through::

    with output_folder(out, f"--out {out}", "the tune's files") as d:  # before any work
        ...
        d.write("tune.md", text)  # replaced atomically, never through a link
        d.replace("tune.png", lambda f: fig.savefig(f, format="png"))  # any writer of a binary file
        d.create("NAME_tuned.yaml", text)  # a new name only: FileExistsError where it is taken
        with d.sub("runs") as runs: ...  # a folder it makes, opened O_NOFOLLOW

A file that must appear only whole or not at all, beside others (a pair written as a unit), is written to
:meth:`Folder.temp` names first and :meth:`Folder.rename`/:meth:`Folder.link`-ed into place last.

A refusal is a :class:`LinkRefused`: one line naming the planted path and what it was; the target is never
opened for writing. The run directory's (or output folder's) own path, and the folders above it, are the
user's to choose and may be links; everything the tool makes inside them is checked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from kfac_bench.errors import UserError

__all__ = [
    "Folder",
    "LinkRefused",
    "check_not_link",
    "ensure_dir",
    "lock_held",
    "open_in_place",
    "output_folder",
    "read_head",
    "refusal",
    "replace_file",
    "temp_file",
    "write_atomic",
]

#: Errors of an ``O_NOFOLLOW`` open that mean "the name is a link" (or not what was asked for).
_REFUSED = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EMLINK)


class LinkRefused(UserError):
    """A path the tool would write is a symbolic link, a hard link or not a regular file (one line)."""


def _describe(path: Path, dir_fd: int | None = None) -> str:
    try:
        return f"a symbolic link to {os.readlink(path, dir_fd=dir_fd)}"
    except OSError:
        pass
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "not a regular file"
    if stat.S_ISREG(st.st_mode):
        return f"a file with {st.st_nlink} hard links" if st.st_nlink > 1 else "a regular file"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "not a regular file"


def refusal(
    path: Path | str, dir_fd: int | None = None, *, shown: Path | None = None
) -> LinkRefused:
    """The one-line error for ``path`` (inside the folder ``dir_fd`` if given; ``shown`` is how the message
    names it), which the tool will not write through."""
    what = _describe(Path(path), dir_fd)
    if what == "a directory":  # a folder was refused: it was a link when opened, swapped back since
        what = "not a folder when it was opened (a link or a file)"
    return LinkRefused(
        f"refusing to write {shown or path}: it is {what}, which the run did not create; remove it "
        "(the run dir may be writable by others: use a private hydra.run.dir)"
    )


def _open_dir(path: Path | str, dir_fd: int | None, follow: bool, shown: Path) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _REFUSED:
            raise refusal(path, dir_fd, shown=shown) from None
        raise


class Folder:
    """A folder opened once, by descriptor (``O_DIRECTORY``, and ``O_NOFOLLOW`` unless its path is the
    user's): every method names a file *inside the folder that was opened*, so renaming the folder or
    swapping its path for a link afterwards changes nothing. Names are plain file names (no ``/``).

    Use as a context manager (``with Folder.open(path, create=True) as d: d.write("a.json", text)``); the
    descriptor closes on exit. ``path`` is kept for messages only.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: Path | str, *, create: bool = False, follow: bool = False) -> Folder:
        """The folder ``path``; ``create``: made first if missing (with its parents, which are the user's
        path); ``follow``: the path may itself be a link (a folder the user named), else a link is refused.

        Raises:
            LinkRefused: ``path`` is a link (unless ``follow``), a file, or not a folder.
            OSError: it cannot be made or opened (missing without ``create``, permissions).
        """
        path = Path(path)
        if create and not (follow and path.is_dir()):
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # mkdir never follows a link at the name
                os.mkdir(path, 0o777)
        return cls(_open_dir(path, None, follow, path), path)

    def sub(self, name: str, *, create: bool = True) -> Folder:
        """The folder ``name`` inside this one (made if missing and ``create``), never through a link."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=self.fd)
        return Folder(_open_dir(name, self.fd, False, self.path / name), self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __truediv__(self, name: str) -> Path:
        """The path of ``name`` for messages (``d / "compare.md"``)."""
        return self.path / name

    def refusal(self, name: str) -> LinkRefused:
        return refusal(name, self.fd, shown=self.path / name)

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status (a link is not followed), or None if it is missing."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_file(self, name: str) -> bool:
        """``name`` is a regular file (not a link)."""
        st = self.lstat(name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def names(self) -> list[str]:
        """The names in the folder, sorted."""
        return sorted(os.listdir(self.fd))

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The content of the regular file ``name`` (at most ``limit`` bytes).

        Raises:
            LinkRefused: it is a link or not a regular file. OSError: it cannot be read.
        """
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise self.refusal(name) from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self.refusal(name)
            return f.read() if limit is None else f.read(limit)

    def temp(self, name: str, *, read: bool = False) -> tuple[int, str]:
        """(open descriptor, name) of a new, empty file with an unpredictable name ``.NAME.<hex>.tmp``,
        created with ``O_EXCL|O_NOFOLLOW`` and the umask's mode (``read``: open for reading too, for a
        writer that seeks back), for a writer that streams into it and renames it into place
        (:meth:`rename`)."""
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        flags |= os.O_RDWR if read else os.O_WRONLY
        for _ in range(100):
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            try:
                return os.open(tmp, flags, 0o666, dir_fd=self.fd), tmp
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(self.path / name))

    def replace(
        self, name: str, write: Callable[[BinaryIO], object], *, fsync: bool = False
    ) -> Path:
        """Replace ``name`` with a file that ``write`` fills (given the open binary file), so that readers
        see the old or the new content, never a part, and nothing is written through a link.

        Raises:
            LinkRefused: ``name`` is a symbolic link (its target is left as it was).
            OSError: the folder cannot take the file (nothing is left behind).
        """
        st = self.lstat(name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self.refusal(name)
        fd, tmp = self.temp(name)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self.rename(tmp, name)
        except BaseException:
            self.unlink(tmp)
            raise
        return self.path / name

    def write(self, name: str, data: bytes | str, *, fsync: bool = False) -> Path:
        """Replace ``name`` with a file holding ``data`` (text is UTF-8): :meth:`replace`."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return self.replace(name, lambda f: f.write(raw), fsync=fsync)

    def create(self, name: str, data: bytes | str, *, fsync: bool = False) -> Path:
        """Write ``data`` as the new file ``name``, refusing (``FileExistsError``) where anything holds
        the name: a temporary file linked into place, so the file appears whole or not at all."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        fd, tmp = self.temp(name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self.link(tmp, name)
        finally:
            self.unlink(tmp)
        return self.path / name

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` inside the folder, replacing ``dst`` (a link there is replaced, never
        followed)."""
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, src: str, dst: str) -> None:
        """A hard link ``dst`` to the file ``src`` (never to what a link ``src`` points at).

        Raises:
            FileExistsError: ``dst`` exists. OSError: the filesystem refuses hard links.
        """
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def symlink(self, target: str, name: str) -> None:
        """A symbolic link ``name`` holding ``target`` (relative to this folder)."""
        os.symlink(target, name, dir_fd=self.fd)

    def unlink(self, name: str, *, missing_ok: bool = True) -> None:
        """Remove the name ``name`` (a link itself, never its target)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def fsync(self) -> None:
        """Make the folder's entries durable (best effort: some filesystems refuse)."""
        with contextlib.suppress(OSError):
            os.fsync(self.fd)

    def open_in_place(self, name: str, *, append: bool = True, create: bool = True) -> int:
        """A descriptor of ``name`` open for writing where it is (``append``: at its end, else read-write
        from the start), created if ``create`` and missing; never through a link.

        Raises:
            LinkRefused: ``name`` is a symbolic link, has another hard link, or is not a regular file (a
                FIFO, a device): nothing is written.
            FileNotFoundError: ``name`` is missing and not ``create``.
            OSError: it cannot be opened.
        """
        flags = (
            os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        )  # NONBLOCK: a planted FIFO must not block
        flags |= (os.O_WRONLY | os.O_APPEND) if append else os.O_RDWR
        if create:
            flags |= os.O_CREAT
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise self.refusal(name) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise self.refusal(name)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd


@contextlib.contextmanager
def _parent(path: Path | str) -> Iterator[tuple[Folder, str]]:
    """(the folder holding ``path``, opened as the user named it; the file's name)."""
    path = Path(path)
    with Folder.open(path.parent, follow=True) as folder:
        yield folder, path.name


def check_not_link(path: Path | str) -> None:
    """Raise :class:`LinkRefused` if ``path`` is a symbolic link (a missing path is fine)."""
    if os.path.islink(path):
        raise refusal(path)


def ensure_dir(path: Path | str) -> Path:
    """``path`` as a folder of the run (created if missing, with its parents).

    Raises:
        LinkRefused: ``path`` is a symbolic link or not a folder.
    """
    Folder.open(path, create=True).close()
    return Path(path)


_NOT_EMPTY_FIX = "name a new or empty folder, or remove what is in it"


def new_folder_name(prefix: str) -> str:
    """``<prefix>_<date>_<time>_<6 hex digits>``: the name of a command's default output folder (the
    random suffix tells apart two started in the same second)."""
    import secrets
    import time

    return f"{prefix}_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(3)}"


def output_folder(
    out: Path | str,
    named: str,
    what: str,
    *,
    replaceable: Callable[[str], bool] | None = None,
    fix: str = _NOT_EMPTY_FIX,
) -> Folder:
    """The open output folder ``out`` of a command, for ``what`` (e.g. "the comparison's files"); ``named``
    is how an error names it (``--out 'DIR'``, ``plan.out=DIR``). The one rule for every command: ``out``
    is missing (it is made, with its parents) or an empty folder; call it before any work, and write every
    file through the returned :class:`Folder` (``d.write(name, text)``, ``d.sub(name)``; close it, or use
    ``with``). ``out`` itself may be a link the user made; nothing inside is written through one.
    ``replaceable``: the names an explicit request to replace an earlier result (``prepare-bert
    --overwrite``) lets the folder hold; ``fix``: the message's advice when it holds anything else.

    Raises:
        UserError: ``out`` is a file, holds anything, or cannot be created (one line).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{named} is a file, not a folder: give a folder for {what}")
    try:
        folder = Folder.open(out, create=True, follow=True)
    except LinkRefused:
        raise UserError(f"{named} is not a folder: give a folder for {what}") from None
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            raise UserError(
                f"{named} cannot be created ({exc.strerror}: a folder above it is a file): give a "
                f"folder for {what}"
            ) from None
        raise UserError(
            f"{named} cannot be created ({exc.strerror}): give a writable folder"
        ) from None
    held = [n for n in folder.names() if replaceable is None or not replaceable(n)]
    if held:
        folder.close()
        raise UserError(
            f"{named} already holds {len(held)} entr{'y' if len(held) == 1 else 'ies'} "
            f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); a command never writes over "
            f"earlier results: {fix}"
        )
    return folder


def replace_file(
    path: Path | str, write: Callable[[BinaryIO], object], *, fsync: bool = False
) -> Path:
    """:meth:`Folder.replace` of ``path``'s name in its folder (the folder as the user named it)."""
    with _parent(path) as (folder, name):
        return folder.replace(name, write, fsync=fsync)


def write_atomic(path: Path | str, data: bytes | str, *, fsync: bool = False) -> Path:
    """Replace ``path`` with a file holding ``data`` (text is UTF-8): :meth:`Folder.write`."""
    with _parent(path) as (folder, name):
        return folder.write(name, data, fsync=fsync)


def temp_file(folder: Path | str, name: str) -> tuple[int, Path]:
    """(open descriptor, path) of a new, empty file in ``folder`` (:meth:`Folder.temp`)."""
    with Folder.open(folder, follow=True) as d:
        fd, tmp = d.temp(name)
        return fd, d / tmp


def open_in_place(path: Path | str, *, append: bool = True, create: bool = True) -> int:
    """:meth:`Folder.open_in_place` of ``path``'s name in its folder."""
    with _parent(path) as (folder, name):
        return folder.open_in_place(name, append=append, create=create)


def _open_regular(path: Path | str) -> int | None:
    """A read-only descriptor of the regular file ``path``, the name itself (a link is not followed), or None
    where it is missing, a link, not a regular file or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_head(path: Path | str, limit: int = 4096) -> str | None:
    """The first ``limit`` bytes of the regular file ``path`` as text (undecodable bytes replaced), or None
    if it is missing, a link or unreadable: for small markers whose content is only shown to the user."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def lock_held(path: Path | str) -> bool:
    """Whether another open file holds an ``flock`` on the regular file ``path`` (a run's ``run.lock``),
    probed without taking it for longer than the probe and without creating anything; False where the file
    is missing, a link, or the filesystem has no locks."""
    fd = _open_regular(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False
