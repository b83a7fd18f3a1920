"""A checkpoint folder swapped for a link while the run writes is never followed: whatever the moment of the
swap, the folder the link points at (another run's checkpoints) keeps exactly its files and bytes. A thread
exchanges ``checkpoints/`` and a link to the victim folder back and forth (``renameat2(RENAME_EXCHANGE)``,
atomic, so the folder is never missing) while the run saves checkpoint after checkpoint."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kfac_bench.checkpoint import files
from kfac_bench.errors import UserError

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchanger() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _race(tmp_path: Path, write: Callable[[Path, int], object], saves: int) -> tuple[int, int]:
    """Exchange ``run/checkpoints`` with a link to a victim folder while ``write(folder, i)`` runs until
    ``saves`` calls succeeded; returns (writes that succeeded, writes refused). Asserts the victim kept
    its files byte for byte."""
    exchange = _exchanger()
    if exchange is None:
        pytest.skip("renameat2 is not in this C library")
    victim = tmp_path / "other_run" / "checkpoints"
    victim.mkdir(parents=True)
    files.write_checkpoint(victim, {"w": torch.ones(3)}, 7, 2)  # another run's checkpoint
    before = _snapshot(victim)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "swap").symlink_to(victim)
    a, b = os.fsencode(run / "checkpoints"), os.fsencode(run / "swap")
    if exchange(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) != 0:
        pytest.skip(f"RENAME_EXCHANGE unsupported here ({os.strerror(ctypes.get_errno())})")
    exchange(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)  # back: checkpoints/ is the folder again
    stop = threading.Event()

    def swap() -> None:  # a swap every fraction of a millisecond: many land in the middle of a save
        pause = random.Random(0)
        while not stop.is_set():
            exchange(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
            time.sleep(pause.uniform(0, 5e-4))

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    done = refused = 0
    unexpected: list[str] = []
    try:
        for i in range(100 * saves):  # the bound only stops a race that never lets a save through
            if done == saves:
                break
            try:
                write(run / "checkpoints", i)
                done += 1
            except UserError as exc:  # the folder was a link when it was opened: refused, one line
                refused += 1
                if "link" not in str(exc) or "\n" in str(exc):
                    unexpected.append(str(exc))
    finally:
        stop.set()
        thread.join()
    assert _snapshot(victim) == before, "the victim folder was written through the link"
    assert not unexpected, unexpected[:3]
    return done, refused


def test_checkpoints_never_follow_a_folder_swapped_for_a_link(tmp_path: Path) -> None:
    payload = {"w": torch.zeros(3)}

    def write(folder: Path, i: int) -> None:
        files.write_checkpoint(folder, payload, i + 1, 2)

    done, refused = _race(tmp_path, write, 300)
    assert done == 300 and refused > 0  # the race really raced: both outcomes happened
    run = tmp_path / "run"
    real = next(p for p in (run / "checkpoints", run / "swap") if not p.is_symlink())
    names = sorted(p.name for p in real.iterdir())
    assert files.LAST in names and not [n for n in names if n.endswith(".tmp")]
