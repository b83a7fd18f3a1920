"""Checkpoints the run did not write are never destroyed: a ``step-*.pt`` without a manifest is neither
loaded, overwritten nor pruned (one line says how to move it), a ``checkpoints/`` that is a link is refused
before pruning could delete files elsewhere, and a manifest that is not one this harness writes (a ``seq``
of ``"abc"``, ``null`` or ``1e999``, undecodable or absurdly nested) is set aside while the resume falls
back to the newest good checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kfac_bench.checkpoint.manager import CheckpointManager
from kfac_bench.errors import UserError

from .stateful import Counter, saved


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_checkpoint_without_a_manifest_is_never_loaded_overwritten_or_pruned(
    tmp_path: Path,
) -> None:
    saved(tmp_path / "elsewhere", [3])
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    stranger = folder / "step-00000006.pt"  # a good checkpoint, copied in without its manifest
    shutil.copy(tmp_path / "elsewhere" / "step-00000003.pt", stranger)
    planted = stranger.read_bytes()
    manager = CheckpointManager(folder, {"counter": Counter()}, keep=2)
    with pytest.raises(UserError) as info:
        manager.load()
    assert str(info.value) == (
        f"checkpoint {stranger} has no manifest, so this run did not write it: it is neither loaded nor "
        f"overwritten. Move it out of {folder} (to start a run from its weights, pass "
        "train.init_from=PATH), then run the same command again"
    )
    # A run that starts over (train.resume=false) saves and prunes around it, never over it.
    for step in (3, 9, 12):
        manager.save(step)
    with pytest.raises(UserError, match=r"step-00000006\.pt has no manifest"):
        manager.save(6)
    assert stranger.read_bytes() == planted
    assert sorted(_tree(folder)) == [
        "last.pt",
        "step-00000006.pt",
        "step-00000009.json",
        "step-00000009.pt",
        "step-00000012.json",
        "step-00000012.pt",
    ]


def test_a_checkpoints_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    saved(shared, [3, 6])  # another run's checkpoints, with their manifests
    before = _tree(shared)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(shared)
    manager = CheckpointManager(run / "checkpoints", {"counter": Counter()}, keep=2)
    for action in (manager.load, lambda: manager.save(9)):
        with pytest.raises(UserError) as info:
            action()
        assert str(info.value).startswith(
            f"refusing to write {run / 'checkpoints'}: it is a symbolic link to {shared}"
        )
    assert _tree(shared) == before


CORRUPT = {
    "seq text": lambda m: {**m, "seq": "abc"},
    "seq null": lambda m: {**m, "seq": None},
    "seq 1e999": lambda m: json.dumps(m).replace(f'"seq": {m["seq"]}', '"seq": 1e999'),
    "seq true": lambda m: {**m, "seq": True},
    "bytes negative": lambda m: {**m, "bytes": -1},
    "another file": lambda m: {**m, "file": "step-00000003.pt"},
    "a list": lambda m: [m],
    "nested 100k deep": lambda m: "[" * 100_000 + "]" * 100_000,
    "invalid utf-8": lambda m: b'{"seq": "\xff\xfe"}',
}


@pytest.mark.parametrize("damage", list(CORRUPT))
def test_a_corrupt_manifest_is_set_aside_and_the_resume_falls_back(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(tmp_path, [3, 6])
    path = tmp_path / "step-00000006.json"
    bad = CORRUPT[damage](json.loads(path.read_text()))
    if isinstance(bad, bytes):
        path.write_bytes(bad)
    else:
        path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    counter = Counter()
    manager = CheckpointManager(tmp_path, {"counter": counter})
    assert manager.load() and counter.value == 30
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "skipped bad checkpoint(s) step-00000006.pt (unreadable manifest)" in err[0]
    )
    assert (tmp_path / "step-00000006.json.corrupt").is_file()
    assert (tmp_path / "step-00000006.pt.corrupt").is_file()


def test_a_save_interrupted_before_its_file_was_in_place_is_no_checkpoint(tmp_path: Path) -> None:
    # The manifest is written before the file is renamed into place: killed in between, the folder holds
    # a manifest whose file is missing. As the only one it leaves nothing to resume; else the older one.
    saved(tmp_path, [3])
    (tmp_path / "step-00000003.pt").unlink()
    (tmp_path / "last.pt").unlink()
    assert CheckpointManager(tmp_path, {"counter": Counter()}).load() is False
    saved(tmp_path / "two", [3, 6])
    (tmp_path / "two" / "step-00000006.pt").unlink()
    counter = Counter()
    assert CheckpointManager(tmp_path / "two", {"counter": counter}).load() and counter.value == 30
