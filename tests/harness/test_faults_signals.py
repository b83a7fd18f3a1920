"""Signals as users and schedulers send them: SIGTERM or SIGINT to the whole process group (``timeout``,
Ctrl-C, torchrun's shutdown) with DataLoader workers running stops the run like a signal to its main pid
(checkpoint, ``preempted``, exit 75, resume), and Ctrl-C is a clean stop, not a traceback."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kfac_bench.launcher.rundir import PREEMPTED_FILE
from tests.harness.fault_util import eval_steps, run, start, summary, wait_for_records
from tests.harness.util import TINY
from tests.limits import hang_limit

pytestmark = pytest.mark.slow

LONG = [*TINY, "train.epochs=2000", "train.eval_every_steps=3", "train.checkpoint_every_epochs=0"]


@pytest.mark.parametrize(
    ("sig", "workers"),
    [(signal.SIGTERM, 2), (signal.SIGINT, 2), (signal.SIGINT, 0)],
    ids=["TERM-workers", "INT-workers", "INT"],
)
def test_a_signal_to_the_process_group_checkpoints_and_exits_75(
    tmp_path: Path, sig: signal.Signals, workers: int
) -> None:
    run_dir = tmp_path / "run"
    args = [*LONG, f"train.num_workers={workers}", "hydra.run.dir=run"]
    proc = start("train", *args, cwd=tmp_path, start_new_session=True)
    try:
        wait_for_records(run_dir, 2, proc, timeout=150)
        if workers:  # the loader's workers are alive and in the group
            assert len(_children(proc.pid)) >= workers
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=hang_limit(90))
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
    s = summary(run_dir)
    assert s["status"] == "preempted"
    step = s["steps"]
    assert (run_dir / PREEMPTED_FILE).read_text().startswith(f"step {step} signal {int(sig)}")
    before = eval_steps(run_dir)

    resumed = run("train", *args, f"train.max_steps={step + 3}", cwd=tmp_path, timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    steps = eval_steps(run_dir)
    assert steps[: len(before)] == before and steps == sorted(set(steps))


def _children(pid: int) -> list[int]:
    from kfac_bench.launcher.agent import child_pids

    return child_pids(pid)
