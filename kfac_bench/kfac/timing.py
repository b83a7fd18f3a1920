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
    (``benchmarks/ops.py``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: Stage, sync: bool = True) -> Iterator[None]:
        """Add the block's wall time to stage ``name``. ``sync=False`` (inside hooks, where synchronising
        CUDA per layer would stall the pipeline) measures host time only, exact on CPU."""
        label = (
            torch.profiler.record_function(f"kfac::{name.value}")
            if torch.autograd.profiler._is_profiler_enabled
            else contextlib.nullcontext()
        )
        with label:
            if not self.enabled:
                yield
                return
            if sync:
                _sync()
            t0 = time.perf_counter()
            yield
            if sync:
                _sync()
            self.seconds[name.value] += time.perf_counter() - t0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
