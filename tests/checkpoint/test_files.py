"""Checkpoints that cannot betray you: the newest K kept with a size/SHA-256 manifest written after each
file, verification on load with a fallback to the newest good one, one-line errors naming the files, no
temporary file left behind, and a failed write (disk full, read-only) losing nothing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_bench.checkpoint import files as checkpoint_files
from kfac_bench.checkpoint.manager import CheckpointManager
from kfac_bench.errors import UserError

from .stateful import Counter, saved


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_keeps_the_newest_k_with_manifests_and_last_pt(tmp_path: Path) -> None:
    saved(tmp_path, [3, 6, 9], keep=2)
    assert _files(tmp_path) == [
        "last.pt",
        "step-00000006.json",
        "step-00000006.pt",
        "step-00000009.json",
        "step-00000009.pt",
    ]
    for step in (6, 9):
        manifest = json.loads((tmp_path / f"step-{step:08d}.json").read_text())
        data = (tmp_path / f"step-{step:08d}.pt").read_bytes()
        assert manifest["bytes"] == len(data) and manifest["step"] == step
        assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert torch.load(tmp_path / "last.pt", weights_only=False)["counter"] == {"value": 90}


@pytest.mark.parametrize(
    "damage", ["truncated", "empty", "garbage", "bad manifest", "missing file"]
)
def test_a_bad_newest_falls_back_with_one_warning(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(tmp_path, [3, 6], keep=2)
    newest = tmp_path / "step-00000006.pt"
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        newest.write_bytes(b"")
    elif damage == "garbage":
        newest.write_bytes(os.urandom(len(data)))
    elif damage == "bad manifest":
        newest.with_suffix(".json").write_text("{not json")
    else:
        newest.unlink()
    counter = Counter()
    manager = CheckpointManager(tmp_path, {"counter": counter})
    assert manager.load()
    assert counter.value == 30 and manager.loaded_path == tmp_path / "step-00000003.pt"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kfac-bench: warning: skipped bad checkpoint(s) ")
    assert "step-00000006" in err[0] and "using " + str(tmp_path / "step-00000003.pt") in err[0]
    # The bad one is set aside (not deleted, never loaded again) and the good one is untouched.
    assert (tmp_path / "step-00000003.pt").is_file()
    assert not (tmp_path / "step-00000006.json").exists()
    assert (tmp_path / "step-00000006.json.corrupt").exists()
    assert (tmp_path / "step-00000006.pt.corrupt").exists() or damage == "missing file"
    # The next save continues from the good one and becomes the newest.
    counter.value = 70
    manager.save(7)
    assert CheckpointManager(tmp_path, {"counter": Counter()}).read() == {
        "counter": {"value": 70},
        "step": 7,
    }


def test_none_good_is_one_line_naming_every_file(tmp_path: Path) -> None:
    saved(tmp_path, [3, 6], keep=2)
    for step in (3, 6):
        (tmp_path / f"step-{step:08d}.pt").write_bytes(b"x")
    with pytest.raises(UserError) as info:
        CheckpointManager(tmp_path, {"counter": Counter()}).load()
    message = str(info.value)
    assert "\n" not in message and "no usable checkpoint" in message
    assert (
        str(tmp_path / "step-00000003.pt") in message
        and str(tmp_path / "step-00000006.pt") in message
    )
    # Nothing was renamed or deleted: the user decides.
    assert (tmp_path / "step-00000003.json").is_file() and (
        tmp_path / "step-00000006.json"
    ).is_file()


@pytest.mark.parametrize("content", [b"", b"\x00garbage\xff" * 100])
def test_a_legacy_last_pt_that_is_bad_names_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "last.pt").write_bytes(content)
    with pytest.raises(UserError, match=str(tmp_path / "last.pt")):
        CheckpointManager(tmp_path, {"counter": Counter()}).load()


def test_a_legacy_last_pt_that_is_good_is_read(tmp_path: Path) -> None:
    torch.save({"counter": {"value": 5}, "step": 2}, tmp_path / "last.pt")
    counter = Counter()
    assert CheckpointManager(tmp_path, {"counter": counter}).load() and counter.value == 5


def test_orphaned_temporary_files_are_removed_by_the_owner_only(tmp_path: Path) -> None:
    manager = saved(tmp_path, [3])
    orphans = [tmp_path / ".step-00000006.pt.4242.tmp", tmp_path / ".last.pt.abc.tmp"]
    for path in orphans:
        path.write_bytes(b"half a checkpoint")
    assert manager.read() is not None and all(p.exists() for p in orphans)  # a reader leaves them
    assert manager.load()
    assert not any(p.exists() for p in orphans)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EDQUOT])
def test_a_failed_write_is_one_line_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    manager = saved(tmp_path, [3, 6])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_write = checkpoint_files._HashingWriter.write
    written = [0]

    def failing_write(self: Any, data: Any) -> int:
        written[0] += len(data)
        if written[0] > 1000:  # part of the file is out, then the disk says no
            raise OSError(code, os.strerror(code))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint_files._HashingWriter, "write", failing_write)
    manager.parts["counter"].value = 90  # type: ignore[attr-defined]
    with pytest.raises(UserError) as info:
        manager.save(9)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "step-00000009.pt") in message
    assert os.strerror(code) in message and errno.errorcode[code] in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no tmp, nothing lost
    monkeypatch.undo()
    assert CheckpointManager(tmp_path, {"counter": Counter()}).read()["step"] == 6  # type: ignore[index]


def test_order_is_by_save_not_by_step(tmp_path: Path) -> None:
    # A run restarted from step 3 (train.resume=false, or after a fallback) saves step 4 after an
    # abandoned step 9: step 4 is the newest.
    saved(tmp_path, [3, 9], keep=3)
    counter = Counter(40)
    CheckpointManager(tmp_path, {"counter": counter}, keep=3).save(4)
    assert CheckpointManager(tmp_path, {"counter": Counter()}).read()["step"] == 4  # type: ignore[index]
    assert os.path.samefile(tmp_path / "last.pt", tmp_path / "step-00000004.pt")
