"""Checkpoint files on disk: written with a manifest, verified before they are trusted, the newest K kept.

Layout of ``<run dir>/checkpoints/``::

    step-00000440.pt      torch.save of one checkpoint, taken after optimizer step 440
    step-00000440.json    its manifest, written before the file is renamed into place: {"file", "step",
                          "seq", "bytes", "sha256"}
    last.pt               the newest checkpoint (a hard link to its step file, else a symlink), for tools
                          that take a path (BERT phase 2's ``model.init_checkpoint``)

A checkpoint is *good* when its file has the size and SHA-256 its manifest records and
:func:`kfac_bench.checkpoint.torchfile.load` reads it as data (tensors and plain containers: a file whose
pickle names code is refused, never loaded). Checkpoints are ordered by ``seq`` (a save counter), not by step,
so a run restarted from an older checkpoint never mistakes an abandoned later one for its newest. Each write
goes to a temporary file in the same folder (an unpredictable name: :mod:`kfac_bench.safe_files`), is
fsynced; its manifest is written (the same way), then the file is renamed into place; only then are
checkpoints beyond the newest K deleted, so a failed write (disk full, read-only folder) leaves every earlier
checkpoint intact. A ``step-*.pt`` without a manifest is therefore not the run's own: it is never loaded,
overwritten or deleted, and the run stops with one line saying how to move it. A folder that is a link is
refused (pruning would delete files elsewhere), and a save opens the folder once
(:class:`kfac_bench.safe_files.Folder`, ``O_NOFOLLOW|O_DIRECTORY``) and does every step through that
descriptor, so a folder swapped for a link mid-save is never followed. A folder from before manifests (a
lone ``last.pt``) is read as one unverified checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import io
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kfac_bench import safe_files
from kfac_bench.checkpoint import torchfile
from kfac_bench.errors import UserError

__all__ = [
    "LAST",
    "Candidate",
    "NoGoodCheckpoint",
    "candidates",
    "check_folder",
    "load_newest_good",
    "quarantine",
    "remove_orphans",
    "unclaimed",
    "write_checkpoint",
]

LAST = "last.pt"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
_CHUNK = 1 << 20
_MAX_MANIFEST = 1 << 16
_MISSING = "its file is missing"


class NoGoodCheckpoint(UserError):
    """Checkpoints exist but none passes verification (one line naming the files)."""


@dataclass
class Candidate:
    """A checkpoint file and what its manifest promises (``manifest`` None: a legacy ``last.pt``)."""

    path: Path
    manifest: dict[str, Any] | None
    seq: int

    @property
    def manifest_path(self) -> Path:
        return self.path.with_suffix(".json")


@contextlib.contextmanager
def _opened(folder: Path | safe_files.Folder) -> Iterator[safe_files.Folder]:
    """``folder`` as an open :class:`~kfac_bench.safe_files.Folder` (a path is opened, never through a
    link, and closed after)."""
    if isinstance(folder, safe_files.Folder):
        yield folder
    else:
        with safe_files.Folder.open(folder) as opened:
            yield opened


def _read_manifest(d: safe_files.Folder, name: str) -> dict[str, Any] | None:
    """The manifest ``name`` of ``d``, or None if it is unreadable or not one this module writes (a link,
    a field of the wrong type, a non-integer ``seq``, another file's name, absurd nesting)."""
    try:
        raw = d.read_bytes(name, _MAX_MANIFEST + 1)
        if len(raw) > _MAX_MANIFEST:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UserError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    ints = [data.get(k) for k in ("step", "seq", "bytes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        return None
    digest = data.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    return data if data.get("file") == name[: -len(".json")] + ".pt" else None


def candidates(folder: Path | safe_files.Folder) -> tuple[list[Candidate], list[Path]]:
    """(checkpoints with a manifest, newest first; manifests that cannot be read).

    Without any manifest, a regular ``last.pt`` is the one (legacy, unverified) candidate.

    Raises:
        LinkRefused: ``folder`` (a path) is a link.
    """
    found: list[Candidate] = []
    unreadable: list[Path] = []
    if not isinstance(folder, safe_files.Folder) and not os.path.lexists(folder):
        return found, unreadable
    with _opened(folder) as d:
        for name in fnmatch.filter(d.names(), "step-*.json"):
            manifest = _read_manifest(d, name)
            if manifest is None:
                unreadable.append(d / name)
                continue
            found.append(Candidate((d / name).with_suffix(".pt"), manifest, int(manifest["seq"])))
        found.sort(key=lambda c: c.seq, reverse=True)
        if not found and not unreadable and d.is_file(LAST):
            found.append(Candidate(d / LAST, None, 0))
    return found, unreadable


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _problem(candidate: Candidate) -> str | None:
    """Why ``candidate`` cannot be trusted, or None."""
    path, manifest = candidate.path, candidate.manifest
    if manifest is None:
        return None
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return _MISSING
    if size != manifest["bytes"]:
        return f"{size} bytes, its manifest says {manifest['bytes']}"
    if _sha256(path) != manifest["sha256"]:
        return "checksum differs from its manifest"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_newest_good(
    folder: Path,
) -> tuple[dict[str, Any], Candidate, list[tuple[Candidate, str]]] | None:
    """The newest good checkpoint as saved (tensors on the CPU), its candidate and the newer bad ones
    with the reason each was rejected; None if the folder holds no checkpoint at all.

    Raises:
        NoGoodCheckpoint: checkpoints exist but none is good.
        torchfile.RefusedFile: the newest checkpoint that passes its manifest's checks is a pickle that
            names code (planted, or another program's), or one of an older kfac-bench: nothing is loaded.
    """
    found, unreadable = candidates(folder)
    rejected = [
        (Candidate(p.with_suffix(".pt"), None, -1), "unreadable manifest") for p in unreadable
    ]
    for candidate in found:
        problem = _problem(candidate)
        if problem is None:
            try:
                # Data only: a file whose pickle names code raises RefusedFile, which stops the run
                # here (never set aside and never skipped for an older one: it may be hostile).
                payload = torchfile.load(candidate.path)
            except torchfile.UnreadableFile as exc:  # corruption that passed the checks (or legacy)
                problem = f"unreadable: {exc.reason}"
            except OSError as exc:
                problem = f"unreadable: {_first_line(exc)}"
            else:
                if isinstance(payload, dict):
                    return payload, candidate, rejected
                problem = f"holds a {type(payload).__name__}, not a checkpoint"
        rejected.append((candidate, problem))
    if all(why == _MISSING for _, why in rejected):
        return None  # only saves interrupted before their file was in place: nothing to resume
    listed = "; ".join(f"{c.path} ({why})" for c, why in rejected)
    raise NoGoodCheckpoint(
        f"no usable checkpoint to resume from: {listed}. Restore a good copy, or move the "
        f"checkpoints away to start the run over"
    )


def quarantine(rejected: list[tuple[Candidate, str]]) -> list[Path]:
    """Rename rejected checkpoints and manifests to ``*.corrupt`` (kept for inspection, never loaded)."""
    moved = []
    for candidate, _ in rejected:
        with _opened(candidate.path.parent) as d:
            for name in (candidate.path.name, candidate.manifest_path.name):
                if name != LAST and d.lstat(name) is not None:
                    d.rename(name, name + ".corrupt")
                    moved.append(d / (name + ".corrupt"))
    return moved


def remove_orphans(folder: Path | safe_files.Folder) -> list[Path]:
    """Delete temporary files a killed writer left behind (``.*.tmp``); only the run's owner calls it."""
    removed = []
    with _opened(folder) as d:
        for name in fnmatch.filter(d.names(), ".*.tmp"):
            d.unlink(name)
            removed.append(d / name)
    return removed


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through (``torch.save`` writes sequentially)
    and remembers the first OSError, which ``torch.save`` would otherwise wrap in a RuntimeError."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.digest.update(data)
        self.size += len(data)
        return written


def _point_last(d: safe_files.Folder, target: str) -> None:
    """Make ``last.pt`` the file ``target`` (hard link; a relative symlink where links are refused), under a
    temporary name no one can predict, renamed into place."""
    tmp = f".{LAST}.{secrets.token_hex(8)}.tmp"
    try:
        d.link(target, tmp)
    except OSError:
        d.symlink(target, tmp)
    d.rename(tmp, LAST)


def unclaimed(folder: Path | safe_files.Folder) -> list[Path]:
    """``step-*.pt`` files of ``folder`` without a manifest: this module writes a manifest before the file,
    so these are not the run's own (copied in, or another program's); they are never overwritten, deleted
    or loaded."""
    with _opened(folder) as d:
        names = d.names()
        return [
            d / n for n in names if _STEP_FILE.match(n) and n[: -len(".pt")] + ".json" not in names
        ]


def unclaimed_error(path: Path) -> UserError:
    """One line for a ``step-*.pt`` the run did not write (:func:`unclaimed`)."""
    return UserError(
        f"checkpoint {path} has no manifest, so this run did not write it: it is neither loaded nor "
        f"overwritten. Move it out of {path.parent} (to start a run from its weights, pass "
        "train.init_from=PATH), then run the same command again"
    )


def check_folder(folder: Path) -> None:
    """Refuse a checkpoint folder that is a link (pruning would delete files elsewhere) or that holds a
    checkpoint the run did not write.

    Raises:
        UserError: one line naming the path.
    """
    if not os.path.lexists(folder):
        return
    with safe_files.Folder.open(folder) as d:
        strangers = unclaimed(d)
        if strangers:
            raise unclaimed_error(strangers[0])


def _prune(d: safe_files.Folder, keep: int) -> None:
    """Delete the checkpoints beyond the newest ``keep``: only files with a manifest (the run's own)."""
    found, _ = candidates(d)
    for candidate in [c for c in found if c.manifest is not None][keep:]:
        d.unlink(candidate.path.name)
        d.unlink(candidate.manifest_path.name)


def write_checkpoint(folder: Path, payload: dict[str, Any], step: int, keep: int) -> Path:
    """Write ``payload`` as the newest checkpoint of ``folder`` and keep the newest ``keep``.

    The payload goes to a temporary file (an unpredictable name), then its manifest is written, then the
    file is renamed into place: a ``step-*.pt`` without a manifest is never this module's.

    Raises:
        UserError: the folder cannot take the file (disk full, quota, read-only, permissions): one line;
            every earlier checkpoint is left as it was. The folder is a link, or ``step-N.pt`` exists
            without a manifest (not the run's: never overwritten): one line.
    """
    folder = Path(folder)
    path = folder / f"step-{step:08d}.pt"
    try:
        # Opened once, O_NOFOLLOW: every step below names a file inside this folder, even if its path is
        # swapped for a link meanwhile (the save then lands in the folder that was opened).
        d = safe_files.Folder.open(folder, create=True)
    except OSError as exc:
        raise _write_error(path, exc) from None
    with d:
        _write(d, payload, step, path)
        _prune(d, keep)
    return path


def _write(d: safe_files.Folder, payload: dict[str, Any], step: int, path: Path) -> None:
    name, manifest_name = path.name, path.with_suffix(".json").name
    tmp: str | None = None
    manifest_written = False
    writer: _HashingWriter | None = None
    try:
        remove_orphans(d)
        if d.lstat(name) is not None and d.lstat(manifest_name) is None:
            raise unclaimed_error(path)
        found, _ = candidates(d)
        seq = max((c.seq for c in found), default=0) + 1
        fd, tmp = d.temp(name)
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(payload, writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        manifest = {
            "file": name,
            "step": step,
            "seq": seq,
            "bytes": writer.size,
            "sha256": writer.digest.hexdigest(),
        }
        d.write(manifest_name, json.dumps(manifest, sort_keys=True) + "\n", fsync=True)
        manifest_written = True
        d.rename(tmp, name)
        tmp = None
        _point_last(d, name)
        d.fsync()
    except OSError as exc:
        _undo(d, manifest_written, manifest_name, name)
        raise _write_error(path, exc) from None
    except UserError:
        raise
    except Exception:
        _undo(d, manifest_written, manifest_name, name)
        if writer is not None and writer.error is not None:
            raise _write_error(path, writer.error) from None
        raise
    finally:
        if tmp is not None:
            d.unlink(tmp)


def _undo(d: safe_files.Folder, manifest_written: bool, manifest_name: str, name: str) -> None:
    """A save failed after its manifest was written but before its file was in place: the manifest goes
    too. (Where an earlier save of the same step is still in place, its manifest was replaced: a resume
    rejects that file and falls back to the checkpoint before it.)"""
    if manifest_written and d.lstat(name) is None:
        d.unlink(manifest_name)


def _write_error(path: Path, exc: OSError) -> UserError:
    code = errno.errorcode.get(exc.errno or 0, "")
    reason = f"{exc.strerror or exc}" + (f" ({code})" if code else "")
    return UserError(
        f"cannot write checkpoint {path}: {reason}; the earlier checkpoints in {path.parent} are intact. "
        "Free space (or make the run dir writable) and run the same command again to resume"
    )
