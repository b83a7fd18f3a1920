"""Depth you can debug: from the CLI to the engine's eigendecomposition in a training step, at most 8
frames of the project's own (cli > train command > its jobs > train > loop > step > second order >
method)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from kfac_bench.cli import main

pytestmark = pytest.mark.slow


def test_from_the_cli_to_eigh_in_a_training_step_is_at_most_8_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks: list[list[str]] = []
    eigh = torch.linalg.eigh

    def recording(*args: object, **kwargs: object) -> object:
        frames = [f for f in traceback.extract_stack() if "/kfac_bench/" in f.filename]
        if any(f.name == "run_loop" for f in frames):  # a training step's, not the warm-up's
            stacks.append([f"{Path(f.filename).stem}.{f.name}" for f in frames])
        return eigh(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.linalg, "eigh", recording)
    monkeypatch.chdir(tmp_path)
    args = ["train", "+recipe=digits_smoke", "train.epochs=2", "train.progress=none"]
    assert main([*args, "train.tensorboard=false", "hydra.run.dir=run"]) == 0
    assert stacks, "no decomposition ran in a training step"
    deepest = max(stacks, key=len)
    assert len(deepest) <= 8, " > ".join(deepest)
