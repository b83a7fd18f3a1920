"""Preemption: SIGTERM / SIGUSR1 ask the loop to stop after the current step, checkpoint and exit with
:data:`EXIT_REQUEUE`, which ``launch/slurm.sbatch`` answers with ``scontrol requeue``."""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["EXIT_REQUEUE", "PreemptionFlag"]

#: sysexits.h EX_TEMPFAIL: "try again later"; the job is requeued and resumes from its checkpoint.
EXIT_REQUEUE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Installs handlers for SIGTERM and SIGUSR1 that only set a flag (the loop checks it between steps)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was signalled; every rank must call it at the same point (one all-reduce)."""
        local = self.signum is not None
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
