"""Run a function on N forked gloo processes from a test, and fail fast on errors or hangs.

Forking (rather than torchrun) starts ranks in seconds. Every rank sets one intra-op thread: on a 2-core
machine several 2-thread processes run several times slower than 1-thread ones. ``backend="nccl"`` (GPU
tests) spawns instead of forking, since CUDA cannot be used in a child forked after the parent used it,
and puts rank r on CUDA device r. A rank that walks its heap freezes what it inherited first (``gc.freeze()``:
``gc.get_objects()`` then skips the forked pytest worker's objects) rather than paying a spawned interpreter.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.limits import hang_limit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    out: mp.Queue,
    backend: str = "gloo",
) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Tensors through a multiprocessing queue would be shared by file descriptor, which dies with
        # this process: send them serialised instead.
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        out.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the results by rank.

    Raises:
        RuntimeError: with the failing rank's traceback as soon as any rank fails (the others are killed,
            so a rank blocked in a collective with the failed one cannot hang the test), or naming the
            ranks that did not finish within ``hang_limit(timeout)`` seconds.
    """
    timeout = hang_limit(timeout)
    ctx = mp.get_context(start_method or ("spawn" if backend == "nccl" else "fork"))
    out: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = out.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise RuntimeError(
                    f"ranks {missing} did not finish within {timeout:.0f} s (hang?)"
                ) from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=hang_limit(5))
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
