"""Preemption: SIGTERM, SIGINT (Ctrl-C), SIGUSR1 or SIGUSR2 ask the run to stop after the current step and
checkpoint.

A rank's :class:`PreemptionFlag` only records the signal; the loop checks it between steps (one all-reduce
makes every rank agree), saves a checkpoint and returns ``preempted``. The process then exits with
:data:`EXIT_REQUEUE` (under torchrun with 0 and a marker file instead, see :mod:`kfac_bench.launcher.rundir`),
which ``launch/slurm.sbatch`` answers with ``scontrol requeue``. A launcher process uses the same flag with
``forward`` to pass the signal on to its ranks (:mod:`kfac_bench.launcher.agent`).

Ctrl-C is a preemption like SIGTERM (checkpoint, ``preempted``, exit 75): the work since the last checkpoint
is kept. A second Ctrl-C while the run is stopping raises :class:`KeyboardInterrupt` at once (the CLI ends
with one line and exit status 130), for a user who will not wait for the checkpoint.

SIGUSR2 is submitit's preemption signal: a submitit job has its checkpoint-and-requeue handler installed
before the run starts; :meth:`PreemptionFlag.hand_back` calls it once the run's own checkpoint is written, so
the sweep job is requeued by submitit's protocol and resumes from that checkpoint.

This module imports no torch: a rank installs :func:`catch_early` before its heavy imports, so a signal
that arrives while the rank starts up is kept, not fatal.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["EXIT_REQUEUE", "SIGNALS", "PreemptionFlag", "catch_early"]

#: sysexits.h EX_TEMPFAIL: "try again later"; the job is requeued and resumes from its checkpoint.
EXIT_REQUEUE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

_early: PreemptionFlag | None = None


class PreemptionFlag:
    """Handlers for :data:`SIGNALS` that record the first signal (and call ``forward`` with every one).

    Args:
        forward: called with the signal number from the handler (a launcher passes it to its ranks).
    """

    def __init__(self, forward: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self.forward = forward
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionFlag:
        """Install the handlers; a signal :func:`catch_early` recorded counts as received here."""
        global _early
        self._previous = {}
        early: PreemptionFlag | None = _early if _early is not self else None
        before_early = early._previous if early is not None else {}
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            if early is not None and getattr(previous, "__self__", None) is early:
                # What was installed before catch_early (SIG_DFL, or e.g. submitit's handler).
                previous = before_early.get(sig, signal.SIG_DFL)
            self._previous[sig] = previous
        if early is not None:
            if self.signum is None:
                self.signum = early.signum
            _early = None
        return self

    def restore(self) -> None:
        """Put back the handlers that were installed before :meth:`install` (remembered for
        :meth:`hand_back`)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum is not None and self is not _early:
            raise KeyboardInterrupt  # a second Ctrl-C (or Ctrl-C after another signal): abort now
        if self.signum is None:
            self.signum = signum
        if self.forward is not None:
            self.forward(signum)

    def hand_back(self) -> None:
        """Call the handler that was installed before :meth:`install` for the recorded signal, if it is a
        Python function (submitit's checkpoint-and-requeue, which exits the process). Call it last, once
        the checkpoint, summary and marker are written and the handlers restored."""
        previous = self._previous.get(self.signum) if self.signum is not None else None
        # Python's own SIGINT handler would only raise KeyboardInterrupt after a clean stop.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)


def catch_early() -> PreemptionFlag:
    """Record a preemption signal from now on, until the run installs its own :class:`PreemptionFlag`
    (which takes the signal over). For rank processes, whose imports take seconds."""
    global _early
    if _early is None:
        _early = PreemptionFlag().install()
    return _early
