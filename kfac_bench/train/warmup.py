"""One untimed optimizer step before the clock starts, undone: every run's clock counts training only.

A process's first step pays one-time costs that later steps do not: the allocator's first blocks, kernel
selection and compilation, lazily built buffers, the data loader's first worker start, K-FAC's first
factor and decomposition shapes. Inside the clock they would be charged to whichever run a process starts
first (in a sweep, one arm more than the other). MLPerf leaves initialisation out of the timed run
(``init_start`` ... ``run_start``); :func:`warm_up` does the same for this warm-up: one full step (forward,
backward, ``precond.step()``, ``optimizer.step()``) on the run's first batch, after which every part the
checkpoint saves is put back as it was (weights, optimizer, scheduler, scaler, K-FAC state, random
generators: the same :class:`~kfac_bench.checkpoint.manager.CheckpointManager` parts a resume restores), the
gradients are cleared, and the K-FAC stage seconds it took are taken off the run's stage times. The run then
trains exactly as it would have without it.

Note:
    Collective under torch.distributed (the step's all-reduces, the preconditioner's state): every rank
    calls it at the same point, before the loop starts its clock.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from kfac_bench.data.loader import shutdown_workers
from kfac_bench.train.loop import Loop, forward_backward, optimizer_step

__all__ = ["RESTORED_PARTS", "warm_up", "warming_up"]

#: The checkpoint parts one step changes, restored after the warm-up (the rest it never touches).
RESTORED_PARTS = ("model", "optimizer", "scheduler", "scaler", "precond", "rng")


_active = False


def warming_up() -> bool:
    """Whether the warm-up step is running now: for code that counts training steps by their forward
    passes (a test's fault model), which should not count this one."""
    return _active


def warm_up(loop: Loop, stages: Any | None = None) -> bool:
    """Run one untimed optimizer step on the first batch of the epoch the loop starts in, then restore
    the state it changed; ``stages`` (:class:`~kfac_bench.metrics.timekeeping.StageTotals`) loses the stage
    seconds the step took. Returns False (nothing done) when there is no batch to take.
    """
    s = loop.state
    loop.sampler.set_epoch(s.epoch, start=s.sample_in_epoch)
    try:
        batches = list(itertools.islice(iter(loop.train_loader), loop.accumulation_steps))
    except BaseException:
        # A worker's error (an unreadable image): end the workers this iterator started, or the
        # interpreter would wait for them at exit (kfac_bench.data.loader.shutdown_workers).
        shutdown_workers(loop.train_loader)
        raise
    if len(batches) < loop.accumulation_steps:
        return False
    parts = {k: p for k, p in loop.checkpoints.parts.items() if k in RESTORED_PARTS}
    saved = {k: _host_copy(p.state_dict()) for k, p in parts.items()}
    before = stages.totals() if stages is not None else {}
    was_training = loop.module.training
    loop.module.train()
    global _active
    _active = True
    try:
        _step(loop, batches)
    finally:
        _active = False
    for k, p in parts.items():  # in the manager's order: the generators last
        p.load_state_dict(saved[k])
    loop.module.train(was_training)
    if stages is not None:
        after = stages.totals()
        for k, v in after.items():
            stages.offset[k] = stages.offset.get(k, 0.0) - (v - before.get(k, 0.0))
    return True


def _host_copy(obj: Any) -> Any:
    """A copy of a state dict with every tensor copied to host memory: the snapshot never doubles what
    the device holds (``load_state_dict`` puts each tensor back on its part's device)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(
            obj
        )  # keeps the mapping's type (an OrderedDict's order, a defaultdict's factory)
        for k, v in obj.items():
            out[k] = _host_copy(v)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _step(loop: Loop, batches: list[Any]) -> None:
    """One optimizer step as the loop takes it (:func:`~kfac_bench.train.loop.forward_backward`,
    :func:`~kfac_bench.train.loop.optimizer_step`; gradient clipping left out: the step is undone, only its
    costs matter). A non-finite loss on any rank skips the K-FAC and optimizer step on every rank, as the
    loop would stop there (and the run then diverges at its first step, on the clock)."""
    total, _ = forward_backward(loop, batches)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    if not math.isfinite(float(total)):
        loop.optimizer.zero_grad(set_to_none=True)
        return
    if loop.scaler is not None:
        loop.scaler.unscale_(loop.optimizer)
    if loop.precond is not None:
        loop.precond.step()
    optimizer_step(loop)
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)
