"""Seconds per K-FAC stage from the planned loads: decomposition and GEMM rates plus a bandwidth.

The rates are either nominal V100 figures (the papers' GPU) or measured on this machine's device
(:mod:`kfac_bench.plan.profile`). The network is a bandwidth term only, per collective algorithm: a ring
all-reduce moves ``2 (p-1)/p`` of its payload through each rank, a reduce half of that, a minimum-spanning-
tree broadcast ``ceil(log2 p)`` times its payload (the O(log p) of KAISA §3.1). Latency and overlap with the
backward pass are not modelled: the seconds rank the rows of one plan, they do not predict a step time.
The factor computation (the same for every strategy) is its GEMM floor at the GEMM rate, reported beside
the ranking's seconds, not in them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .costs import RankLoads

__all__ = ["NOMINAL_V100", "Rates", "stage_seconds"]


@dataclass(frozen=True)
class Rates:
    """Device and network speeds.

    Attributes:
        decomposition_s_per_n3: seconds per n³ of one decomposition (fit ``intercept + slope · n³``).
        decomposition_intercept_s: fixed seconds per decomposition (launch and host overheads).
        gemm_flops: matrix-multiply flop/s.
        bandwidth_bytes: per-rank network bytes/s.
        source: where the rates come from, for the report.
    """

    decomposition_s_per_n3: float
    decomposition_intercept_s: float
    gemm_flops: float
    bandwidth_bytes: float
    source: str
    samples: list[dict[str, float]] = field(default_factory=list)

    def decomposition_seconds(self, dims: Sequence[int]) -> float:
        return sum(
            self.decomposition_intercept_s + self.decomposition_s_per_n3 * d**3 for d in dims
        )

    def with_bandwidth(self, bandwidth_bytes: float) -> Rates:
        return Rates(
            self.decomposition_s_per_n3,
            self.decomposition_intercept_s,
            self.gemm_flops,
            bandwidth_bytes,
            self.source,
            self.samples,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "decomposition_s_per_n3": self.decomposition_s_per_n3,
            "decomposition_intercept_s": self.decomposition_intercept_s,
            "gemm_flops": self.gemm_flops,
            "bandwidth_bytes_per_s": self.bandwidth_bytes,
            "samples": self.samples,
        }


#: Nominal V100 rates. Decomposition: SC20 Table V measures 2256.64 ms for ResNet-50's eigendecompositions on
#: 16 V100s, whose round-robin worst rank decomposes factors summing to 1.1177e11 n³ (this planner's count):
#: 2.019e-11 s per n³. GEMM: 15.7 TFLOP/s, the V100 SXM2
#: FP32 peak (NVIDIA V100 datasheet). Bandwidth: set per plan (``plan.bandwidth_gb_s``).
NOMINAL_V100 = Rates(
    decomposition_s_per_n3=2.25664 / 1.1177426944e11,
    decomposition_intercept_s=0.0,
    gemm_flops=15.7e12,
    bandwidth_bytes=12.5e9,
    source="nominal V100 (decomposition: SC20 Table V; GEMM: FP32 peak)",
)


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def stage_seconds(
    loads: RankLoads,
    rates: Rates,
    intervals: tuple[int, int],
    factor_flops: float | None = None,
) -> dict[str, float | None]:
    """Seconds of each K-FAC stage on the slowest rank, and the K-FAC seconds per step amortised over the
    (factor, decomposition) ``intervals`` (``per_step``: factor computation excluded, the same for every
    row of a world size). ``factor_flops``: the factor computation per rank and factor step
    (:mod:`kfac_bench.plan.factors`; None: not planned), at the GEMM rate: ``factor_computation`` per
    factor step, ``factor_computation_per_step`` amortised."""
    s = loads.scenario
    n, m = s.world_size, s.grad_workers
    bw = rates.bandwidth_bytes
    wire = {
        "factor_allreduce": 2 * (n - 1) / n,
        "factor_reduce": (n - 1) / n,
        "decomposition_broadcast": _log2(m),
        "grad_broadcast": _log2(n // m),
    }
    comm = {k: max(v) * wire[k] / bw for k, v in loads.payload.items()}
    factor_comm = comm.get("factor_allreduce", 0.0) + comm.get("factor_reduce", 0.0)
    out = {
        "factor_comm": factor_comm,
        "decomposition": max(rates.decomposition_seconds(d) for d in loads.owned_dims),
        "decomposition_broadcast": comm.get("decomposition_broadcast", 0.0),
        "precondition": max(loads.precondition_flops) / rates.gemm_flops,
        "grad_broadcast": comm.get("grad_broadcast", 0.0),
    }
    f, k = intervals
    per_step = (
        out["precondition"]
        + out["grad_broadcast"]
        + out["factor_comm"] / f
        + (out["decomposition"] + out["decomposition_broadcast"]) / k
    )
    factor = None if factor_flops is None else factor_flops / rates.gemm_flops
    return {
        **out,
        "per_step": per_step,
        "factor_computation": factor,
        "factor_computation_per_step": None if factor is None else factor / f,
    }
