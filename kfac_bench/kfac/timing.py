"""Wall time per stage of ``step()``, named after the paper's stages (TPDS §6.4.1, Fig. 7)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from .options import StrEnum


class Stage(StrEnum):
    """The timed stages of ``step()``, in their order."""

    FACTOR = "factor"
    FACTOR_COMM = "factor_comm"
    DECOMPOSITION = "decomposition"
    DECOMPOSITION_COMM = "decomposition_comm"
    PRECONDITION = "precondition"
    GRAD_BROADCAST = "grad_broadcast"
    KL_CLIP = "kl_clip"


#: The stage names, as :meth:`KFACPreconditioner.stage_times` keys them.
STAGES = tuple(s.value for s in Stage)


class StageTimer:
    """Cumulative seconds per stage; a no-op unless ``enabled``. While ``torch.profiler`` records, each
    stage is also a ``kfac::<stage>`` range of the trace, so a profile attributes ops to stages
    (``benchmarks/ops.py``).

    Timing costs the device no synchronisation: on CUDA a stage is bracketed by two CUDA events recorded on
    the current stream, and their elapsed time is read later: events that completed are collected when
    the next stage starts (``query()``, which never blocks), the rest when :attr:`seconds` is read (an
    interval boundary: a summary or a checkpoint, where the loop has synchronised the device already). On
    the CPU a stage is its host time.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def seconds(self) -> dict[str, float]:
        """Stage -> seconds so far (waits for the stages still in flight on the device)."""
        self._collect(wait=True)
        return self._seconds

    @contextlib.contextmanager
    def __call__(self, name: Stage, sync: bool = True) -> Iterator[None]:
        """Add the block's time to stage ``name``: device time between two CUDA events where CUDA is in
        use, else host time. ``sync=False`` (inside hooks, per layer) measures host time only, exact on
        CPU."""
        label = (
            torch.profiler.record_function(f"kfac::{name.value}")
            if torch.autograd.profiler._is_profiler_enabled
            else contextlib.nullcontext()
        )
        with label:
            if not self.enabled:
                yield
                return
            if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
                self._collect(wait=False)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._pending.append((name.value, start, end))
                return
            t0 = time.perf_counter()
            yield
            self._seconds[name.value] += time.perf_counter() - t0

    def _collect(self, wait: bool) -> None:
        """Add the elapsed time of the event pairs that completed (``wait``: of all, waiting for them)."""
        keep = []
        for name, start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                keep.append((name, start, end))
                continue
            self._seconds[name] += start.elapsed_time(end) / 1000.0
        self._pending = keep
