"""Nothing a run writes leaves its run directory: every writer of the harness, handed a run directory in which
someone planted a symbolic link (or a hard link, or a FIFO) at the name it writes, refuses in one line naming
the link, and the file the link points at is byte-identical afterwards. Temporary names are unpredictable
(a link planted at the name a pid would give is never written through), and new files get the umask's mode.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kfac_bench import safe_files
from kfac_bench.checkpoint import elastic, files
from kfac_bench.launcher import rundir
from kfac_bench.metrics import sinks, summary, trackers
from kfac_bench.metrics.mlperf import MLPerfLog, RunFacts
from kfac_bench.safe_files import LinkRefused
from tests.harness.util import tiny_cfg

VICTIM = b"the job user's own file\n"


def _mlperf(run: Path) -> None:
    log = MLPerfLog(run / "mlperf.log", RunFacts("resnet", primary="top1"))
    log.begin(0.0, resumed=False)


def _mlperf_resumed(run: Path) -> None:
    log = MLPerfLog(run / "mlperf.log", RunFacts("resnet", primary="top1"))
    log.load_state_dict({"bytes": 3, "anchor_ms": 1.0, "stopped": False, "in_block": False})
    log.begin(5.0, resumed=True)


def _squad(run: Path) -> None:
    from kfac_bench.tasks.squad import SquadTask

    task = SquadTask()
    task.last_predictions = {"q1": "an answer"}
    task.save_outputs(run)


def _tensorboard(run: Path) -> None:
    # The event writer as the sink opens it; the sink's scalars() would turn the refusal into its
    # best-effort warning (tests/metrics/test_trackers.py), the victim untouched either way.
    sinks.TensorBoardSink(run / "tb").writer.add_scalar("train/loss", 1.0, 1)


#: (the name a writer writes in the run directory, the writer).
WRITERS: list[tuple[str, Callable[[Path], Any]]] = [
    ("run.lock", rundir.lock),
    ("config.yaml", lambda run: rundir.record_config(run, tiny_cfg())),
    ("preempted", lambda run: rundir.mark_preempted(run, 12, 15)),
    ("diverged", lambda run: rundir.mark_diverged(run, 12, "loss", None)),
    ("summary.json", lambda run: summary.write_summary(run, {"status": "success"})),
    ("tracker.json", lambda run: trackers._save_id(run, "mlflow_run_id", "abc")),
    ("world.json", lambda run: elastic.record_world(run, elastic.World(1, 32, 32))),
    ("eval.jsonl", lambda run: sinks.JsonlSink(run / "eval.jsonl").write({"step": 1})),
    ("mlperf.log", _mlperf),
    ("mlperf.log", _mlperf_resumed),  # the resume cuts the log back to the checkpoint's length
    ("predictions.json", _squad),
    ("checkpoints", lambda run: files.write_checkpoint(run / "checkpoints", {"step": 1}, 1, 2)),
    ("tb", _tensorboard),
]


def _plant_link(run: Path, name: str, tmp_path: Path) -> Path:
    """A link at ``run/name`` to a victim file (or, for a folder the run writes, a victim folder holding
    one); returns the victim file."""
    victim_dir = tmp_path / "victim_home"
    victim_dir.mkdir()
    victim = victim_dir / "precious"
    victim.write_bytes(VICTIM)
    run.mkdir(exist_ok=True)
    folder = name in ("checkpoints", "tb")
    (run / name).symlink_to(victim_dir if folder else victim)
    return victim


@pytest.mark.parametrize(
    ("name", "writer"), WRITERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(WRITERS)]
)
def test_every_writer_refuses_a_planted_link_and_leaves_its_target(
    tmp_path: Path, name: str, writer: Callable[[Path], Any]
) -> None:
    run = tmp_path / "run"
    victim = _plant_link(run, name, tmp_path)
    try:
        with pytest.raises(LinkRefused) as info:
            writer(run)
    finally:
        rundir.release(run)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"refusing to write {run / name}: it is a symbolic link to {victim.parent}"
    )
    assert victim.read_bytes() == VICTIM
    assert sorted(p.name for p in victim.parent.iterdir()) == [
        "precious"
    ]  # nothing added beside it
    assert (run / name).is_symlink()


def test_a_link_planted_at_the_temporary_name_a_pid_gives_is_never_written(tmp_path: Path) -> None:
    victim = tmp_path / "precious"
    victim.write_bytes(VICTIM)
    run = tmp_path / "run"
    run.mkdir()
    for name in (
        "summary.json",
        "config.yaml",
        "world.json",
        "step-00000001.pt",
        "step-00000001.json",
    ):
        (run / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    (run / "checkpoints").mkdir()
    for name in ("step-00000001.pt", "step-00000001.json", "last.pt"):
        (run / "checkpoints" / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    summary.write_summary(run, {"status": "success"})
    rundir.record_config(run, tiny_cfg())
    elastic.record_world(run, elastic.World(1, 32, 32))
    files.write_checkpoint(run / "checkpoints", {"step": 1}, 1, 2)
    assert victim.read_bytes() == VICTIM
    assert json.loads((run / "summary.json").read_text()) == {"status": "success"}
    for path in (
        run / "summary.json",
        run / "config.yaml",
        run / "checkpoints" / "step-00000001.pt",
    ):
        assert path.is_file() and not path.is_symlink()


def test_a_hard_link_or_a_fifo_is_not_written_in_place(tmp_path: Path) -> None:
    victim = tmp_path / "precious"
    victim.write_bytes(VICTIM)
    run = tmp_path / "run"
    run.mkdir()
    os.link(victim, run / "run.lock")
    with pytest.raises(LinkRefused, match=r"run\.lock: it is a file with 2 hard links"):
        rundir.lock(run)
    os.mkfifo(run / "eval.jsonl")  # opening it for writing would block without the check
    with pytest.raises(LinkRefused, match=r"eval\.jsonl: it is not a regular file"):
        sinks.JsonlSink(run / "eval.jsonl").write({"step": 1})
    assert victim.read_bytes() == VICTIM


def test_new_files_get_the_umask_mode_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = safe_files.write_atomic(tmp_path / "summary.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # as open() makes it, not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"old\n")

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(OSError):
        safe_files.write_atomic(path, "new\n")
    assert path.read_bytes() == b"old\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_ensure_dir_refuses_a_file_where_a_folder_goes(tmp_path: Path) -> None:
    (tmp_path / "tb").write_bytes(VICTIM)
    with pytest.raises(LinkRefused, match=r"tb: it is a regular file"):
        safe_files.ensure_dir(tmp_path / "tb")
    assert (tmp_path / "tb").read_bytes() == VICTIM
