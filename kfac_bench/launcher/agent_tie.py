"""A rank never outlives the agent that started it.

:func:`kfac_bench.launcher.agent.run_torchrun` (the ``launcher=torchrun`` process itself, or
``python -m kfac_bench.launcher.agent`` under ``launch/slurm.sbatch`` and ``launch/torchrun_multinode.sh``)
holds the run directory's lock for its ranks, or starts them with ``hydra.run.dir`` checked. torchrun
starts each rank in a session of its own, so when that process is SIGKILLed (the OOM killer, ``kill -9``,
a node agent) nothing reaches the ranks: they would train on unsupervised while the kernel has released
the lock, and a second identical command would claim the directory and write into it beside them.

So the agent passes its pid to its ranks (:data:`AGENT_PID_ENV`), and each rank, first thing, asks the
kernel to SIGKILL it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread that polls
the parent pid every :data:`POLL_S` seconds). A SIGKILL of the agent is a SIGKILL of the whole run: the
ranks stop at once, wherever they are (a stuck collective included), and the run directory is what any
SIGKILL leaves: checkpoints are written atomically, so the same command resumes from the newest one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
from collections.abc import Mapping

__all__ = ["AGENT_PID_ENV", "POLL_S", "tie_to_agent"]

#: Set by the agent for its ranks: the pid of the process that started them.
AGENT_PID_ENV = "KFAC_BENCH_AGENT_PID"
#: How often a rank without ``prctl`` checks that its agent is alive.
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux only)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(POLL_S)
    _die()


def tie_to_agent(env: Mapping[str, str] | None = None) -> bool:
    """In a rank whose parent is the agent named by :data:`AGENT_PID_ENV`: die (SIGKILL) when the agent
    dies. Returns whether this process is now tied (False where the variable is unset, or this process is
    not the agent's own child, e.g. a DataLoader worker)."""
    env = os.environ if env is None else env
    raw = env.get(AGENT_PID_ENV, "")
    if not raw.isdigit():
        return False
    agent = int(raw)
    if os.getppid() != agent:
        try:
            os.kill(agent, 0)
        except ProcessLookupError:
            _die()  # the agent died before this rank got here
        except PermissionError:
            pass
        return False  # the agent lives, but is not our parent: not one of its ranks
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch, args=(agent,), name="kfac-agent-tie", daemon=True).start()
    if os.getppid() != agent:  # it died between the check and the prctl
        _die()
    return True
