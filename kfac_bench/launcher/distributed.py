"""Process-group setup from torchrun or SLURM environment variables.

torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``. A plain ``srun``
with one task per GPU sets ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and the node list instead;
the master address is then the first node of ``SLURM_JOB_NODELIST`` (expanded by ``scontrol``) or
``MASTER_ADDR`` if set. With neither, the run is a single process.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DistEnv", "cleanup", "detect", "first_host", "lost_peer", "setup"]

#: What gloo and NCCL say when a collective's peer is gone (killed, crashed, its host lost).
_PEER_LOST = re.compile(
    r"Connection (?:reset|closed|refused) by peer|Broken pipe|Socket Timeout|NCCL communicator was aborted"
    r"|remote process exited|ProcessGroup.*(?:aborted|terminated)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"
    #: A rank of a job that torchrun or SLURM started (even a job of one rank): it trains, and leaves
    #: launching to whoever started it.
    launched: bool = False
    #: Supervised by torchrun's elastic agent, which restarts a rank that fails.
    elastic: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04],gpu7`` -> ``node01``), without ``scontrol``
    for the simple forms and with it otherwise."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match and match.group(2) is None:
        return match.group(1)
    if match:
        first = re.split(r"[-,]", match.group(2))[0]
        return match.group(1) + first
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()[0]


def detect(env: Mapping[str, str] | None = None) -> DistEnv:
    """The job layout described by ``env`` (default: ``os.environ``): the one reading of "am I a rank of a
    launched job, which, and under whom"."""
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", "29500"))
    elastic = "TORCHELASTIC_RUN_ID" in env
    slurm_tasks = int(env.get("SLURM_NTASKS", "1"))
    launched = elastic or "RANK" in env or slurm_tasks > 1
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
            source="torchrun",
            launched=True,
            elastic=elastic,
        )
    if "SLURM_PROCID" in env and slurm_tasks > 1:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            world_size=slurm_tasks,
            master_addr=addr,
            master_port=port,
            source="slurm",
            launched=True,
            elastic=elastic,
        )
    return DistEnv(launched=launched, elastic=elastic)


def setup(env: DistEnv, device: torch.device) -> None:
    """Join the process group (NCCL on CUDA, gloo on CPU) when the job has more than one process."""
    import torch
    import torch.distributed as dist

    if not env.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
        )
        return
    # Under torchrun every rank is a client of the agent's store, which outlives a restart: keys of the
    # failed attempt (e.g. gloo's peer addresses) must not be read by the next one, hence a prefix.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=not agent_store and env.rank == 0,
        timeout=timedelta(minutes=10),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"kfac_bench/attempt_{restart}", store),
        rank=env.rank,
        world_size=env.world_size,
    )


def lost_peer(exc: BaseException) -> str | None:
    """The reason, in one line, when ``exc`` is a collective failing because another rank is gone (it was
    killed or crashed mid-collective); None for any other error."""
    if not isinstance(exc, RuntimeError):  # torch.distributed.DistError is one
        return None
    text = str(exc).strip()
    if not _PEER_LOST.search(text):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])  # gloo's "[.../pair.cc:545] "
    return first.split(". This is typically")[0].strip()


def cleanup(synchronize: bool = False) -> None:
    """Leave the process group, if any.

    Objects that hold the group (DDP's reducer, the preconditioner's communicators and their pending
    work) are collected first: left to the interpreter's exit, gloo's worker threads are torn down during
    finalization, which aborts the process ("terminate called without an active exception") after the run
    has finished, failing an ``srun --kill-on-bad-exit`` job (the failure pytorch/pytorch#190489 shows).
    With ``synchronize`` (a run that ended normally) every rank first waits for the others, so no rank
    leaves while rank 0 still writes the summary or a peer is still in a collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if synchronize and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def pick_device(kind: str, env: DistEnv) -> torch.device:
    """``cuda:<local rank>`` if asked for (or ``auto`` and CUDA exists), else the CPU."""
    import torch

    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")
