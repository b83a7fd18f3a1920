"""What one rank holds, computes and sends, for one world size × fraction × placement × factor reduction.

Everything here is the engine's own rule applied to layer shapes: the placement is
:func:`kfac_bench.kfac.assignment.assign` with the method's decomposition cost, the factor buckets are
:func:`kfac_bench.kfac.comm.make_buckets` over :func:`~kfac_bench.kfac.comm.factor_entries`, the
second-order parts have the shapes and dtypes of the method's own receive buffers
(``SecondOrderMethod.empty``). The memory categories are those of ``KFACPreconditioner.memory_usage()`` at
their peaks; the collectives and their payloads are those ``Communicator.counts`` / ``payload_bytes``
tally. The communication model is the one of the reference code (KAISA §3.1): factors reduced every factor
step, decompositions broadcast inside blocks of m gradient workers every decomposition step, preconditioned
gradients broadcast in receiver groups of world/m every step when m < world.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kfac_bench.kfac import FactorReduction, LayerSpec, Placement
from kfac_bench.kfac.assignment import LayerWork, assign
from kfac_bench.kfac.batching import batches
from kfac_bench.kfac.comm import Bucket, factor_entries, make_buckets
from kfac_bench.kfac.options import ComputeMethod

from .recipe import EngineSettings

__all__ = [
    "MEMORY",
    "WHEN",
    "RankLoads",
    "Scenario",
    "buffer_peaks",
    "equal_group_workers",
    "rank_loads",
    "row_dict",
    "strategy_name",
]

#: Memory categories of ``KFACPreconditioner.memory_usage()``, each at its peak (``outer_products`` is part
#: of ``decompositions``; ``batch_buffers`` and ``comm_buffers`` are the two kinds of ``buffers``, whose
#: peak is that of their sum: the two peak at different moments unless factors accumulate in one process).
MEMORY = ("factors", "decompositions", "outer_products", "batch_buffers", "comm_buffers", "buffers")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def equal_group_workers(world_size: int) -> list[int]:
    """Every number of gradient workers m that splits ``world_size`` into equal blocks (KAISA §3.1)."""
    return [m for m in range(1, world_size + 1) if world_size % m == 0]


def strategy_name(grad_workers: int, world_size: int) -> str:
    """COMM-OPT (m = world), MEM-OPT (m = 1 < world) or HYBRID-OPT (KAISA §2.2)."""
    if grad_workers == world_size:
        return "COMM-OPT"
    return "MEM-OPT" if grad_workers == 1 else "HYBRID-OPT"


@dataclass(frozen=True)
class Scenario:
    """One planned configuration."""

    world_size: int
    grad_workers: int
    placement: Placement
    reduction: FactorReduction

    @property
    def fraction(self) -> float:
        return self.grad_workers / self.world_size

    @property
    def strategy(self) -> str:
        return strategy_name(self.grad_workers, self.world_size)


@dataclass
class RankLoads:
    """Per-rank quantities of one scenario (lists indexed by rank).

    Attributes:
        owned_dims: sizes of the factors each rank decomposes.
        factor_elements: elements of the factors each rank decomposes (Σ n², SC20's per-worker count).
        decomposition_cost: Σ n³ of those factors.
        memory: bytes per category of :data:`MEMORY`, at each category's peak.
        payload: bytes per collective kind on each rank, per occurrence (factor step, decomposition
            step, step).
        calls: collectives per kind on each rank, per occurrence.
        precondition_flops: GEMM flops of the preconditioning each rank runs every step.
    """

    scenario: Scenario
    work: dict[str, LayerWork]
    owned_dims: list[list[int]]
    factor_elements: list[int]
    decomposition_cost: list[float]
    memory: dict[str, list[int]]
    payload: dict[str, list[int]] = field(default_factory=dict)
    calls: dict[str, list[int]] = field(default_factory=dict)
    precondition_flops: list[float] = field(default_factory=list)

    def total_memory(self) -> list[int]:
        """Each rank's peak of ``memory_usage()["total"]`` once factors and decompositions exist."""
        m = self.memory
        return [
            m["factors"][r] + m["decompositions"][r] + m["buffers"][r]
            for r in range(self.scenario.world_size)
        ]


#: When each collective kind runs.
WHEN = {
    "factor_allreduce": "factor_step",
    "factor_reduce": "factor_step",
    "decomposition_broadcast": "decomposition_step",
    "grad_broadcast": "step",
}


def rank_loads(
    layers: Sequence[LayerSpec],
    settings: EngineSettings,
    scenario: Scenario,
    accumulation_steps: int = 1,
) -> RankLoads:
    """The per-rank loads of ``scenario`` (see :class:`RankLoads`)."""
    n = scenario.world_size
    work = assign(
        layers,
        n,
        scenario.fraction,
        settings.method.decomposition_cost,
        settings.assignment_strategy,
        settings.colocate_factors,
        scenario.placement,
    )
    f_size, g_size = _size(settings.factor_dtype), _size(settings.grad_dtype)
    owned: list[list[int]] = [[] for _ in range(n)]
    memory = {k: [0] * n for k in MEMORY}
    payload = {k: [0] * n for k in WHEN}
    calls = {k: [0] * n for k in WHEN}
    flops = [0.0] * n
    reduce = scenario.reduction is FactorReduction.REDUCE
    # Triple products per step (eigen_lowrank: at most the eigen method's, for its exact factors).
    gemm = 2 if settings.compute_method is ComputeMethod.INVERSE else 4
    for w in work.values():
        owned[w.a_owner].append(w.a_dim)
        owned[w.g_owner].append(w.g_dim)
        if reduce:  # only the decomposing rank keeps a running factor
            memory["factors"][w.a_owner] += f_size * w.a_dim**2
            memory["factors"][w.g_owner] += f_size * w.g_dim**2
        parts = settings.part_bytes(w.a_dim, w.g_dim)
        held = sum(parts.values())
        derived = held - parts["a"] - parts["g"]
        layer_flops = gemm * (w.g_dim**2 * w.a_dim + w.g_dim * w.a_dim**2)
        for r in w.grad_workers:
            memory["decompositions"][r] += held
            memory["outer_products"][r] += derived
            flops[r] += layer_flops
            if len(w.grad_workers) > 1:
                payload["decomposition_broadcast"][r] += held
                calls["decomposition_broadcast"][r] += len(parts)
    # What every rank holds or sends alike: all running factors (all-reduce); the buffers of a factor step,
    # as every rank packs every bucket, reduce targets or not; a preconditioned-gradient broadcast per layer
    # when m < world.
    buckets = (
        make_buckets(
            factor_entries(work, reduce), f_size, settings.bucket_cap_mb, settings.symmetry_aware
        )
        if n > 1
        else []
    )
    c_size = _size(settings.comm_dtype)
    everywhere = dict(
        zip(
            ("batch_buffers", "comm_buffers", "buffers"),
            buffer_peaks(
                work, buckets, f_size, c_size, accumulation_steps, _per_call(layers, settings)
            ),
        )
    )
    everywhere["factors"] = (
        0 if reduce else f_size * sum(w.a_dim**2 + w.g_dim**2 for w in work.values())
    )
    for key, value in everywhere.items():
        memory[key] = [v + value for v in memory[key]]
    if scenario.grad_workers < n:
        payload["grad_broadcast"] = [g_size * sum(w.g_dim * w.a_dim for w in work.values())] * n
        calls["grad_broadcast"] = [len(work)] * n
    if buckets:
        kind = "factor_reduce" if reduce else "factor_allreduce"
        payload[kind] = [c_size * sum(b.numel for b in buckets)] * n
        calls[kind] = [len(buckets)] * n
    return RankLoads(
        scenario=scenario,
        work=work,
        owned_dims=owned,
        factor_elements=[sum(d * d for d in dims) for dims in owned],
        decomposition_cost=[float(sum(d**3 for d in dims)) for dims in owned],
        memory=memory,
        payload={k: v for k, v in payload.items() if any(v)},
        calls={k: v for k, v in calls.items() if any(v)},
        precondition_flops=flops,
    )


def buffer_peaks(
    work: dict[str, LayerWork],
    buckets: Sequence[Bucket],
    f_size: int,
    c_size: int,
    accumulation_steps: int,
    per_call: Collection[str] | None = None,
) -> tuple[int, int, int]:
    """Peaks of ``batch_buffers``, ``comm_buffers`` and their sum over a factor step, at the moments
    ``memory_usage()`` can be read: after the last forward pass and after each layer's gradient hook in
    the last backward pass (KFACPreconditioner.memory_usage gives what each category holds).

    The backward pass is taken to reach the layers in the reverse of their registration order, the order
    of the factor buckets (``buckets``: :func:`~kfac_bench.kfac.comm.make_buckets`, empty for one process);
    ``f_size``, ``c_size``: bytes per element of the factor and the communication dtype. ``per_call``:
    the layers whose forward call holds its input factor until its gradient (None: all); the others'
    grams are computed in batches on the gradient's arrival (:mod:`kfac_bench.kfac.batching`, as on a
    GPU, the device planned: the CPU computes every call on its own), taken
    here as arriving one call per key (a key whose calls wait for each other also holds their inputs and
    output gradients, activation-sized: not modelled).
    """
    # Accumulating: the earlier micro-batches' sums, beside the last one's pending input factors.
    extra = accumulation_steps > 1
    pending = {n: per_call is None or n in per_call for n in work}
    dims = {f"{n}/{k}": d for n, w in work.items() for k, d in (("a", w.a_dim), ("g", w.g_dim))}
    batch = f_size * sum(
        pending[n] * w.a_dim**2 + extra * (w.a_dim**2 + w.g_dim**2) for n, w in work.items()
    )
    comm, launched = 0, 0
    handed: set[str] = set()
    peaks = [batch, comm, batch + comm]
    for name, w in reversed(list(work.items())):
        a2, g2 = w.a_dim**2, w.g_dim**2
        # The call's grams join the sums (one process: kept until step()) or, distributed, the sums
        # become the normalised factors handed to the reduction: a2 + g2 held after, the pending
        # input factor and (accumulating) the sums before.
        batch += f_size * ((not extra) * (a2 + g2) - pending[name] * a2)
        if buckets:
            handed |= {f"{name}/g", f"{name}/a"}
            while launched < len(buckets) and handed.issuperset(buckets[launched].keys):
                batch -= f_size * sum(dims[k] ** 2 for k in buckets[launched].keys)
                comm += c_size * buckets[launched].numel
                launched += 1
        peaks = [max(peaks[0], batch), max(peaks[1], comm), max(peaks[2], batch + comm)]
    return peaks[0], peaks[1], peaks[2]


def _per_call(layers: Sequence[LayerSpec], settings: EngineSettings) -> set[str]:
    """The layers whose factor grams the engine computes call by call: handlers without batched grams,
    and every layer while ``factor_batch_fraction`` (or, for the layers it applies to,
    ``factor_position_fraction``) thins out the rows."""
    thinned = settings.factor_batch_fraction < 1.0
    return {
        s.name
        for s in layers
        if thinned
        or not batches(s.handler)
        or (settings.factor_position_fraction < 1.0 and hasattr(s.handler, "a_gram_rows"))
    }


def _span(values: Sequence[float]) -> dict[str, Any]:
    return {"min": min(values), "max": max(values)}


def row_dict(loads: RankLoads, intervals: tuple[int, int]) -> dict[str, Any]:
    """The ``plan.json`` row of ``loads``; ``intervals``: (factor, decomposition) update steps."""
    s = loads.scenario
    n = s.world_size
    cost = loads.decomposition_cost
    all_dims = [d for dims in loads.owned_dims for d in dims]
    memory = {k: _span(v) for k, v in loads.memory.items()}
    memory["total"] = _span(loads.total_memory())
    collectives = {
        kind: {"when": WHEN[kind], "calls": _span(loads.calls[kind]), "bytes": _span(v)}
        for kind, v in loads.payload.items()
    }

    def per(when: str) -> list[int]:
        return [sum(v[r] for k, v in loads.payload.items() if WHEN[k] == when) for r in range(n)]

    f, k = intervals
    step, fac, dec = per("step"), per("factor_step"), per("decomposition_step")
    amortized = [step[r] + fac[r] / f + dec[r] / k for r in range(n)]
    return {
        "world_size": n,
        "placement": str(s.placement),
        "grad_worker_fraction": s.fraction,
        "grad_workers": s.grad_workers,
        "strategy": s.strategy,
        "factor_reduction": str(s.reduction),
        "factor_elements_per_rank": _span(loads.factor_elements),
        "decomposition_cost_per_rank": {
            "max": max(cost),
            "min": min(cost),
            "ideal": sum(cost) / n,
            "floor": float(max(all_dims) ** 3),
        },
        "memory_bytes_per_rank": memory,
        "comm_bytes": {
            "collectives": collectives,
            "per_step": _span(step),
            "per_factor_step": _span(fac),
            "per_decomposition_step": _span(dec),
            "amortized_per_step": _span(amortized),
            "factor_update_steps": f,
            "inv_update_steps": k,
        },
    }
