"""The network model of the time to solution: a ring allreduce and a minimum-spanning-tree broadcast over a
stated bandwidth and latency per algorithm step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BANDWIDTH_GB_S", "DEFAULT_LATENCY_US", "GRAD_BUCKET_BYTES", "Network"]

#: Gradient allreduce buckets: ``DistributedDataParallel``'s default ``bucket_cap_mb=25``.
GRAD_BUCKET_BYTES = 25 * 2**20
#: Network defaults without a profile's: 100 Gb/s InfiniBand EDR (the papers' V100 cluster) and NCCL's own
#: model of one ring step over the network (NCCL 2.5 ``src/graph/tuning.cc``, ``hwLat[NET][RING][SIMPLE]``).
DEFAULT_BANDWIDTH_GB_S = 12.5
DEFAULT_LATENCY_US = 6.6


@dataclass(frozen=True)
class Network:
    """Per-rank bandwidth (bytes/s) and latency per algorithm step (s), with where they come from."""

    bandwidth_bytes: float
    latency_s: float
    source: str

    def allreduce(self, nbytes: float, world: int, calls: int = 1) -> float:
        """Ring allreduce: ``2(p-1)/p · bytes / bandwidth + 2(p-1) · latency`` per call."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (world - 1)
        return steps / world * nbytes / self.bandwidth_bytes + steps * self.latency_s * calls

    def reduce(self, nbytes: float, world: int, calls: int = 1) -> float:
        """Ring reduce: half an allreduce."""
        return self.allreduce(nbytes, world, calls) / 2

    def broadcast(self, nbytes: float, group: int, calls: int = 1) -> float:
        """Minimum-spanning-tree broadcast: ``ceil(log2 p)`` rounds of the payload (KAISA §3.1's O(log p))."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        rounds = math.ceil(math.log2(group))
        return rounds * (nbytes / self.bandwidth_bytes + self.latency_s * calls)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth_bytes_per_s": self.bandwidth_bytes,
            "latency_s": self.latency_s,
            "source": self.source,
        }
