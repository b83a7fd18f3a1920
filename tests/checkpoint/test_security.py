"""A checkpoint is data, never code: every way a run reads a ``torch.save`` file (resume from ``step-N.pt``
with a matching manifest, a bare ``last.pt``, ``train.init_from``, ``model.init_checkpoint``) refuses a pickle
that names a function, with one line naming the file, and the payload never runs. A genuine checkpoint
round-trips (random generators included); one written by the older, NumPy-pickling kfac-bench gets a
message of its own; a corrupt file is told apart from a refused one."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kfac_bench import safe_files
from kfac_bench.checkpoint import files, torchfile
from kfac_bench.checkpoint.manager import CheckpointManager, RNGState
from kfac_bench.checkpoint.warm_start import start_from
from kfac_bench.errors import UserError
from kfac_bench.models.bert import build_bert
from tests.harness.fault_util import one_error_line
from tests.harness.util import TINY, run_cli


class Payload:
    """Unpickling this runs a shell command that creates ``marker`` (what a planted checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def _hostile(path: Path, marker: Path, **extra: Any) -> Path:
    """A torch file shaped like a training checkpoint whose model part is a payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": Payload(marker), "step": 99, **extra}, path)
    return path


def _plant(folder: Path, marker: Path, step: int = 99) -> Path:
    """A hostile ``step-N.pt`` with a manifest that matches it and claims to be the newest checkpoint."""
    path = _hostile(folder / f"step-{step:08d}.pt", marker)
    found, _ = files.candidates(folder)
    manifest = {
        "file": path.name,
        "step": step,
        "seq": max((c.seq for c in found), default=0) + 1,
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    path.with_suffix(".json").write_text(json.dumps(manifest))
    return path


def test_the_payload_is_real(tmp_path: Path) -> None:
    # The hostile file used below does run its command when unpickled the unsafe way.
    marker = tmp_path / "ran"
    path = _hostile(tmp_path / "x.pt", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_loader_refuses_code_and_names_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = _hostile(tmp_path / "x.pt", marker)
    with pytest.raises(torchfile.RefusedFile) as info:
        torchfile.load(path)
    assert not marker.exists()
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "system" in message
    assert not info.value.old_format


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
@pytest.mark.parametrize("protocol", [2, 4])
def test_a_plain_pickle_never_runs(tmp_path: Path, protocol: int) -> None:
    # Not a torch zip at all: a bare pickle of the payload (protocol 4 frames it, which torch's
    # weights-only reader does not read at all).
    marker = tmp_path / "ran"
    path = tmp_path / "x.pt"
    path.write_bytes(pickle.dumps(Payload(marker), protocol=protocol))
    error = torchfile.RefusedFile if protocol == 2 else torchfile.UnreadableFile
    with pytest.raises(error, match=re.escape(str(path))):
        torchfile.load(path)
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"not a checkpoint", b"", b"PK\x03\x04truncated"])
def test_a_corrupt_file_is_unreadable_not_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(torchfile.UnreadableFile, match="unreadable") as info:
        torchfile.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_truncated_genuine_checkpoint_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(torchfile.UnreadableFile):
        torchfile.load(path)


def test_an_old_format_checkpoint_gets_its_own_message(tmp_path: Path) -> None:
    # What the previous kfac-bench wrote: NumPy's random state as returned by np.random.get_state().
    path = tmp_path / "step-00000004.pt"
    torch.save({"model": {}, "rng": {"ranks": [{"numpy": np.random.get_state()}]}, "step": 4}, path)
    with pytest.raises(torchfile.RefusedFile) as info:
        torchfile.load(path)
    assert info.value.old_format
    message = str(info.value)
    assert torchfile.OLD_FORMAT in message and str(path) in message and "\n" not in message
    assert "new run directory" in message


def test_every_generator_round_trips_through_a_data_only_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's state
    torch.manual_seed(3)
    manager = CheckpointManager(tmp_path, {"rng": RNGState()})
    manager.save(1)
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    saved = torchfile.load(tmp_path / "last.pt")  # loads with weights_only=True
    assert isinstance(saved["rng"]["ranks"][0]["numpy"]["keys"], torch.Tensor)
    assert manager.load()
    got = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    assert got == expected


def test_resume_refuses_a_planted_step_file_with_a_valid_manifest(tmp_path: Path) -> None:
    folder, marker = tmp_path / "checkpoints", tmp_path / "ran"
    manager = CheckpointManager(folder, {"model": torch.nn.Linear(2, 2)})
    manager.save(3)
    planted = _plant(folder, marker)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UserError) as info:
        manager.load()
    assert not marker.exists()
    assert str(planted) in str(info.value) and "refused" in str(info.value)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing set aside or deleted


def test_resume_refuses_a_bare_last_pt(tmp_path: Path) -> None:
    folder, marker = tmp_path / "checkpoints", tmp_path / "ran"
    last = _hostile(folder / "last.pt", marker)
    with pytest.raises(UserError, match="refused") as info:
        CheckpointManager(folder, {"model": torch.nn.Linear(2, 2)}).load()
    assert not marker.exists() and str(last) in str(info.value)


def test_resume_refuses_an_old_format_checkpoint_with_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    manager = CheckpointManager(folder, {"model": torch.nn.Linear(2, 2)})
    manager.save(3)
    # The previous code's payload, with a manifest that matches (it wrote manifests too).
    path = folder / "step-00000003.pt"
    torch.save({"model": {}, "rng": {"ranks": [{"numpy": np.random.get_state()}]}, "step": 3}, path)
    manifest = json.loads(path.with_suffix(".json").read_text())
    manifest.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    path.with_suffix(".json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=re.escape(torchfile.OLD_FORMAT)):
        manager.load()


def test_init_from_refuses_a_planted_checkpoint(tmp_path: Path) -> None:
    folder, marker = tmp_path / "phase1" / "checkpoints", tmp_path / "ran"
    folder.mkdir(parents=True)
    planted = _plant(folder, marker)
    with safe_files.Folder.open(folder) as d:
        files._point_last(d, planted.name)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for where in (tmp_path / "phase1", folder / "last.pt"):
        with pytest.raises(UserError, match="refused") as info:
            start_from(where, model, optimizer, None)
        assert str(planted) in str(info.value)
    assert not marker.exists()


def test_init_checkpoint_refuses_a_planted_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = _hostile(tmp_path / "last.pt", marker)
    with pytest.raises(UserError, match=r"model\.init_checkpoint") as info:
        build_bert("tiny", vocab_size=300, init_checkpoint=str(path))
    assert not marker.exists() and str(path) in str(info.value)


@pytest.mark.slow
def test_cli_resume_with_a_planted_checkpoint_stops_with_one_line(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    first = run_cli("train", *TINY, "train.epochs=1", "hydra.run.dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    planted = _plant(run_dir / "checkpoints", marker)
    again = run_cli("train", *TINY, "train.epochs=2", "hydra.run.dir=run", cwd=tmp_path)
    assert again.returncode == 2
    line = one_error_line(again.stderr)
    assert str(planted) in line and "refused" in line
    assert not marker.exists()
