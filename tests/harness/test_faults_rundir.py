"""A run directory belongs to one run: config drift on resume is refused (and allowed changes resume), a
second run in a live directory is refused, the lock dies with its holder (SIGKILL too), generated names
never collide. Each refusal is one line with exit status 2 and leaves every file as it was."""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from pathlib import Path

import pytest

from kfac_bench import cli
from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.config.compose import compose_run
from kfac_bench.launcher import rundir
from tests.harness.fault_util import (
    eval_steps,
    fault,
    one_error_line,
    processes_mentioning,
    records,
    run,
    snapshot,
    start,
    summary,
    wait_for_records,
)
from tests.harness.util import TINY
from tests.limits import hang_limit


@pytest.mark.slow
def test_config_drift_is_refused_and_allowed_changes_resume(tmp_path: Path) -> None:
    first = run("train", *TINY, "hydra.run.dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(tmp_path / "run")

    drift = run(
        "train",
        *TINY,
        "kfac=none",
        "optimizer.lr=0.2",
        "train.seed=3",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert drift.returncode == 2
    line = one_error_line(drift.stderr)
    assert f"run dir {tmp_path / 'run'} holds a run with another config" in line
    for key in ("kfac.enabled (True -> False)", "optimizer.lr (0.1 -> 0.2)", "train.seed (0 -> 3)"):
        assert key in line
    assert snapshot(tmp_path / "run") == before  # .hydra/, config, logs, checkpoints untouched

    orphan = tmp_path / "run" / ".summary.json.4242.tmp"  # as a writer killed mid-write leaves it
    orphan.write_text("{")
    more = run(
        "train",
        *TINY,
        "train.epochs=3",
        "train.log_every_steps=2",
        "train.keep_checkpoints=3",
        "launcher.max_restarts=1",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed at step 12" in more.stdout and not orphan.exists()
    assert eval_steps(tmp_path / "run") == [6, 12, 18] and summary(tmp_path / "run")["steps"] == 18


@pytest.mark.slow
def test_a_second_run_in_a_live_directory_is_refused(tmp_path: Path) -> None:
    args = [*TINY, "train.epochs=2000", "train.eval_every_steps=3", "hydra.run.dir=run"]
    first = start("train", *args, cwd=tmp_path)
    try:
        wait_for_records(tmp_path / "run", 1, first)
        for extra in ([], ["launcher=torchrun", "launcher.nproc_per_node=2"]):
            second = run("train", *args, *extra, cwd=tmp_path)
            assert second.returncode == 2
            line = one_error_line(second.stderr)
            assert (
                f"run dir {tmp_path / 'run'} is in use by another run (pid {first.pid} on " in line
            )
        assert first.poll() is None  # the first run never noticed
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=hang_limit(60))
    finally:
        first.kill()
    assert first.returncode == 75, err[-3000:]
    steps = eval_steps(tmp_path / "run")
    assert steps == list(
        range(3, 3 * len(steps) + 1, 3)
    )  # one writer: no record twice or interleaved
    assert not processes_mentioning(str(tmp_path / "run"))


@pytest.mark.slow
def test_a_killed_run_releases_the_lock_and_its_resume_repeats_no_step(tmp_path: Path) -> None:
    # SIGKILL in step 10: evaluations at 3, 6, 9 are written, the newest checkpoint is step 6 (epoch end).
    args = [
        *TINY,
        *fault(tmp_path / "fault", at=10, action="kill"),
        "train.eval_every_steps=3",
        "train.tensorboard=true",
        "hydra.run.dir=run",
    ]
    killed = run("train", *args, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL
    assert eval_steps(tmp_path / "run") == [3, 6, 9]
    assert CheckpointManager(tmp_path / "run" / CHECKPOINT_DIR, {}).read()["step"] == 6  # type: ignore[index]

    resumed = run("train", *args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 6" in resumed.stdout
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [3, 6, 9, 12]
    # TensorBoard: the events the killed process logged after step 6 are purged, none is repeated.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    top1 = acc.Scalars("eval/top1")
    assert [e.step for e in top1] == [3, 6, 9, 12]
    assert top1[2].value == pytest.approx(recs[2]["metrics"]["top1"])  # the resumed run's step 9
    loss_steps = [e.step for e in acc.Scalars("train/loss")]
    assert loss_steps == sorted(set(loss_steps))


@pytest.mark.slow
def test_runs_started_together_get_their_own_directories(tmp_path: Path) -> None:
    procs = [start("train", *TINY, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=hang_limit(120)) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2
    for d in dirs:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_digits_smoke_[0-9a-f]{6}", d.name)
        assert eval_steps(d) == [6, 12] and summary(d)["steps"] == 12


def test_generated_names_differ_per_composition_and_a_sweep_shares_one() -> None:
    a = compose_run(["+recipe=digits_smoke"], return_hydra_config=True)
    b = compose_run(["+recipe=digits_smoke"], return_hydra_config=True)
    assert str(a.hydra.run.dir) != str(b.hydra.run.dir)
    assert str(a.hydra.sweep.dir) == str(a.hydra.sweep.dir)  # cached: one value per config
    assert re.search(r"_digits_smoke_[0-9a-f]{6}$", str(a.hydra.run.dir))
    # A sweep's folder is not named after a job (a sweep over recipes has one name per job): one folder.
    assert re.fullmatch(r"runs/multirun/[0-9_-]+_[0-9a-f]{6}", str(a.hydra.sweep.dir))


def test_a_run_dir_that_cannot_be_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_open = os.open

    def read_only(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith(rundir.LOCK_FILE) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(Exception) as info:
        rundir.lock(tmp_path / "run")
    assert str(info.value) == (
        f"cannot write to run dir {tmp_path / 'run'}: Read-only file system; choose a writable hydra.run.dir"
    )
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    status = cli.main(["train", *TINY, f"hydra.run.dir={tmp_path / 'ro'}"])
    err = capsys.readouterr().err
    assert status == 2
    assert one_error_line(err) == (
        f"kfac-bench: error: run dir {tmp_path / 'ro'} is not writable; choose a writable hydra.run.dir"
    )


@pytest.mark.slow
def test_the_lock_is_per_process_and_released(tmp_path: Path) -> None:
    rundir.lock(tmp_path)
    rundir.lock(tmp_path)  # the holder may ask again
    rundir.probe_lock(tmp_path)  # ... and probe its own lock
    rundir.release(tmp_path)
    holder = start(
        "train",
        *TINY,
        "train.epochs=2000",
        "train.eval_every_steps=3",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    try:
        wait_for_records(tmp_path / "run", 1, holder)
        with pytest.raises(Exception, match="is in use by another run"):
            rundir.probe_lock(tmp_path / "run")
        holder.kill()
        holder.wait(timeout=hang_limit(30))
        deadline = time.monotonic() + hang_limit(10)
        while True:  # the kernel drops the lock with the process
            try:
                rundir.lock(tmp_path / "run")
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        rundir.release(tmp_path / "run")
    finally:
        holder.kill()
