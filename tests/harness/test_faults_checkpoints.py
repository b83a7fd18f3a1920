"""Checkpoints that cannot betray a run, end to end: a corrupt newest checkpoint falls back to the newest
good one with one warning and the logs are cut back to it (eval.jsonl and TensorBoard repeat no step);
with none good the run stops with one line naming the files; a full disk is one line and loses nothing."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from tests.harness.fault_util import eval_steps, one_error_line, records, run, snapshot, summary
from tests.harness.util import TINY, run_cli

pytestmark = pytest.mark.slow

#: Checkpoint and evaluate every 3 steps; with the default keep_checkpoints=2, steps 9 and 12 remain.
EVERY_3 = [*TINY, "train.eval_every_steps=3", "train.checkpoint_every_steps=3", "hydra.run.dir=run"]


def _corrupt(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # cut off, as by a full disk or a killed copy


def test_a_corrupt_newest_checkpoint_falls_back_and_the_logs_follow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_cli("train", *EVERY_3, "train.tensorboard=true", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) == [
        "step-00000009.pt",
        "step-00000012.pt",
    ]
    _corrupt(run_dir / "checkpoints" / "last.pt")  # the same file as step-00000012.pt

    resumed = run_cli("train", *EVERY_3, "train.tensorboard=true", "train.epochs=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warning = [line for line in resumed.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "skipped bad checkpoint(s) step-00000012.pt" in warning[0]
    assert "resumed at step 9" in resumed.stdout
    assert (run_dir / "checkpoints" / "step-00000012.pt.corrupt").is_file()  # kept, never loaded
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [3, 6, 9, 12, 15, 18]
    assert summary(run_dir)["steps"] == 18

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    top1 = acc.Scalars("eval/top1")
    assert [e.step for e in top1] == [3, 6, 9, 12, 15, 18]
    assert top1[3].value == pytest.approx(recs[3]["metrics"]["top1"])  # step 12 of the resumed run


def test_no_good_checkpoint_stops_with_one_line_naming_the_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_cli("train", *EVERY_3, cwd=tmp_path).returncode == 0
    for name in ("step-00000009.pt", "step-00000012.pt"):
        _corrupt(run_dir / "checkpoints" / name)
    before = _outputs(run_dir)
    result = run_cli("train", *EVERY_3, "train.epochs=3", cwd=tmp_path)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "no usable checkpoint to resume from" in line
    for name in ("step-00000009.pt", "step-00000012.pt"):
        assert str(run_dir / "checkpoints" / name) in line
    assert _outputs(run_dir) == before  # nothing renamed, rewritten or truncated


def _outputs(run_dir: Path) -> dict[str, bytes]:
    """What the run produced: checkpoints and logs (config.yaml and .hydra/ record each start's config)."""
    return {
        k: v
        for k, v in snapshot(run_dir).items()
        if k != "config.yaml" and not k.startswith(".hydra")
    }


def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_cli("train", *EVERY_3, cwd=tmp_path).returncode == 0
    before = {k: v for k, v in snapshot(run_dir).items() if k.startswith("checkpoints/")}
    checkpoint_size = len(before["checkpoints/step-00000012.pt"])
    # Writes past 100 kB fail (EFBIG, the way a full disk fails a write): logs fit, a checkpoint does not.
    result = run(
        "train",
        *EVERY_3,
        "train.epochs=3",
        cwd=tmp_path,
        rlimits={resource.RLIMIT_FSIZE: (100_000, 100_000)},
    )
    assert checkpoint_size > 100_000
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert (
        f"cannot write checkpoint {run_dir / 'checkpoints' / 'step-00000015.pt'}: File too large"
        in line
    )
    after = {k: v for k, v in snapshot(run_dir).items() if k.startswith("checkpoints/")}
    assert after == before and not list((run_dir / "checkpoints").glob(".*"))  # no temporary file

    again = run_cli("train", *EVERY_3, "train.epochs=3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 12" in again.stdout
    assert eval_steps(run_dir) == [3, 6, 9, 12, 15, 18]
    assert os.path.samefile(
        run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "step-00000018.pt"
    )
