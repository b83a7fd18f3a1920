"""No rank outlives its launcher: a SIGKILL of the process that started the ranks (the ``launcher=torchrun``
job, or ``python -m kfac_bench.launcher.agent``) kills them within seconds, the run directory is free and
intact, and the same command resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.launcher.agent_tie import AGENT_PID_ENV, POLL_S
from tests.harness.fault_util import (
    env,
    eval_steps,
    processes_mentioning,
    run,
    start,
    wait_for_records,
)
from tests.harness.util import TINY
from tests.limits import hang_limit

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after ``hang_limit(seconds)`` (empty as soon as all are gone)."""
    deadline = time.monotonic() + hang_limit(seconds)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# A stand-in agent: starts one "rank" (a child that ties itself to the agent, or not) and sleeps.
_AGENT = """
import os, subprocess, sys, time
os.environ[{key!r}] = str(os.getpid())
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(600)
"""
_RANK = """
import sys, time
import kfac_bench.launcher.agent_tie as agent_tie

if sys.argv[-1] == "poll":
    agent_tie._set_parent_death_signal = lambda signum: False
tied = agent_tie.tie_to_agent() if sys.argv[-1] != "untied" else False
print("tied" if tied else "untied", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["prctl", "poll", "untied"])
def test_a_rank_dies_with_its_sigkilled_agent(tmp_path: Path, how: str) -> None:
    rank_code = _RANK.replace("sys.argv[-1]", repr(how))
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT.format(key=AGENT_PID_ENV), rank_code],
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    rank = None
    try:
        assert agent.stdout is not None
        rank = int(agent.stdout.readline())
        assert agent.stdout.readline().strip() == ("untied" if how == "untied" else "tied")
        agent.kill()
        agent.wait(timeout=hang_limit(10))
        if how == "untied":
            # The control: a rank that did not tie itself is orphaned (what every rank was before). It is
            # alive after 4 of the periods in which a polling rank notices its agent is gone: waiting for
            # the hang limit instead would only show it again, 15 s later.
            time.sleep(4 * POLL_S)
            assert _alive(rank)
        else:
            assert _wait_gone([rank], 5) == []
    finally:
        agent.kill()
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_rank_whose_agent_is_already_gone_stops_at_once() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(gone.stdout)
    code = "from kfac_bench.launcher.agent_tie import tie_to_agent; tie_to_agent(); print('trained on')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env(**{AGENT_PID_ENV: str(dead_pid)}),
        capture_output=True,
        text=True,
        timeout=hang_limit(30),
    )
    assert result.returncode == -signal.SIGKILL and "trained on" not in result.stdout


def test_a_process_that_is_not_the_agents_child_is_left_alone() -> None:
    # The variable reaches the ranks' own children (DataLoader workers, a tool a rank runs): not theirs.
    code = "from kfac_bench.launcher.agent_tie import tie_to_agent; print(tie_to_agent())"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env(**{AGENT_PID_ENV: "1"}),
        capture_output=True,
        text=True,
        timeout=hang_limit(30),
    )
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]


@pytest.mark.distributed
def test_sigkill_of_the_torchrun_launcher_stops_its_ranks_and_the_run_resumes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "kfac=none",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "train.epochs=2000",
        "train.eval_every_steps=3",
        "train.checkpoint_every_steps=3",
        "hydra.run.dir=run",
    ]
    launcher = start("train", *args, cwd=tmp_path)
    try:
        wait_for_records(run_dir, 2, launcher, timeout=120)
        ranks = [p for p in processes_mentioning(str(run_dir)) if p != launcher.pid]
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.communicate(timeout=hang_limit(10))
        assert _wait_gone(ranks, 5) == []  # no rank trains on with the lock released
    finally:
        launcher.kill()
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
    step = CheckpointManager(run_dir / CHECKPOINT_DIR, {}).read()["step"]  # type: ignore[index]
    before = eval_steps(run_dir)

    resumed = run("train", *args, f"train.max_steps={step + 3}", cwd=tmp_path, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    after = eval_steps(run_dir)
    # One writer at a time: every evaluation once, in order, the resumed ones continuing the killed run's.
    assert after == sorted(set(after)) and after[-1] == step + 3
    assert [s for s in before if s <= step] == [s for s in after if s <= step]
