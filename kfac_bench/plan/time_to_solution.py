"""Minutes to the end of training at N GPUs, the baseline optimizer against each K-FAC strategy.

For every world size N and arm (the baseline recipe's optimizer, and K-FAC as COMM-OPT, MEM-OPT and
HYBRID-OPT): minutes = steps × step time, where the steps are the arm's recipe's epochs × steps per epoch at
N (:mod:`.length`: the training set over the global batch by the recipe's scaling rule) or its step budget,
and the step time is

* **compute**: the profile's baseline step less the gradient allreduce the network model gives at the
  profile's world size, per example, × the examples one rank processes per step at N;
* **gradient allreduce**: ring, ``2(N-1)/N · bytes / bandwidth + 2(N-1) · latency`` per bucket
  (:data:`GRAD_BUCKET_BYTES`), bytes = the trainable parameters in the gradients' dtype;
* K-FAC only, from the planner's loads (:func:`~kfac_bench.plan.costs.rank_loads`, the recipe's placement
  and factor reduction): **precondition** every step (the profile's, × the busiest rank's preconditioning
  flops over those at the profile's configuration), **gradient broadcast** every step when m < N
  (minimum-spanning-tree broadcast in groups of N/m: ``ceil(log2(N/m))`` × (bytes / bandwidth + latency per
  call)), **KL clip** every step (the profile's); every factor interval f: **factor computation** (the
  profile's, × examples per rank over the profile's batch) and the **factor allreduce** (ring, as the
  gradients, over the planner's factor buckets; a reduce: half); every decomposition interval k:
  **decompositions** (the profile's, × the busiest rank's Σ n³ over that at the profile's configuration)
  and their **broadcast** to the m gradient workers (tree, as above).

Nothing is fitted to the figures it is compared with: the profile gives one step and one set of stage costs
at one configuration, the network two stated numbers, and the recipes the epochs, batch and intervals.
Overlap of communication with computation, stragglers, data loading beyond the profile's step and I/O at
scale are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kfac_bench.errors import ConfigError
from kfac_bench.kfac import FactorReduction, Placement
from kfac_bench.kfac.assignment import grad_workers_per_layer
from kfac_bench.kfac.options import parse_grad_worker_fraction

from .costs import RankLoads, Scenario, rank_loads
from .length import RunLength
from .recipe import PlannedModel
from .stage_profile import StageProfile

__all__ = [
    "DEFAULT_BANDWIDTH_GB_S",
    "DEFAULT_LATENCY_US",
    "GRAD_BUCKET_BYTES",
    "STRATEGIES",
    "Network",
    "project",
    "render_time_to_solution",
    "strategy_workers",
]

#: K-FAC arms, KAISA's names; HYBRID-OPT at the recipe's fraction if it is a hybrid one, else 1/2 (KAISA's
#: HYBRID-OPT in its Fig. 8 and BERT runs).
STRATEGIES = ("comm_opt", "mem_opt", "hybrid_opt")
HYBRID_FRACTION = 0.5
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


def strategy_workers(strategy: str, world_size: int, recipe_fraction: str) -> int:
    """Gradient workers per layer of ``strategy`` at ``world_size`` (ValueError: no equal groups)."""
    if strategy == "comm_opt":
        return world_size
    if strategy == "mem_opt":
        return 1
    fraction: Any = HYBRID_FRACTION
    try:
        parsed = parse_grad_worker_fraction(recipe_fraction)
    except ValueError:
        parsed = None
    if isinstance(parsed, float) and 0 < parsed < 1:
        fraction = parsed
    return grad_workers_per_layer(fraction, world_size)


def _max(values: dict[str, list[int]], key: str) -> int:
    return max(values.get(key, [0]))


class _Model:
    """The step-time model of one recipe against one profile (see the module's docstring)."""

    def __init__(self, planned: PlannedModel, profile: StageProfile, network: Network) -> None:
        self.planned, self.profile, self.net = planned, profile, network
        s = planned.settings
        at = profile.measured_at
        self.reduction = FactorReduction(planned.factor_reduction)
        self.placement = Placement(planned.placement)
        ref = self.loads(at.world_size, at.grad_workers, Placement(at.placement), 1)
        mem = self.loads(
            at.world_size, 1, Placement(at.placement), 1
        )  # MEM-OPT's gradient broadcast
        self.ref_n3 = max(ref.decomposition_cost)
        self.ref_precondition_flops = max(ref.precondition_flops)
        grad_size = torch.empty((), dtype=s.grad_dtype).element_size()
        self.grad_bytes = planned.scan.coverage().trainable_params * grad_size
        self.grad_calls = max(1, math.ceil(self.grad_bytes / GRAD_BUCKET_BYTES))
        ref_allreduce = network.allreduce(self.grad_bytes, at.world_size, self.grad_calls)
        compute = profile.baseline_step_s - ref_allreduce
        if compute <= 0:
            raise ConfigError(
                f"plan.profile_file={profile.path}: the modelled gradient allreduce at "
                f"{at.world_size} GPUs ({1e3 * ref_allreduce:.1f} ms) is longer than the baseline step "
                f"({1e3 * profile.baseline_step_s:.1f} ms): check its network figures"
            )
        self.compute_per_example = compute / at.batch_size
        self.reference = {
            "gradient_bytes": self.grad_bytes,
            "gradient_allreduce_calls": self.grad_calls,
            "gradient_allreduce_s": ref_allreduce,
            "compute_s_per_example": self.compute_per_example,
            "decomposition_n3_busiest_rank": self.ref_n3,
            "precondition_flops_busiest_rank": self.ref_precondition_flops,
            "modelled_comm_s": self.comm(ref, at.world_size, at.grad_workers)
            | {"grad_broadcast": self.comm(mem, at.world_size, 1)["grad_broadcast"]},
            "profiled_comm_s": {
                k: v for k, v in profile.stages_s.items() if k.endswith(("comm", "broadcast"))
            },
        }

    def loads(self, n: int, m: int, placement: Placement, micro: int) -> RankLoads:
        scenario = Scenario(n, m, placement, self.reduction)
        return rank_loads(self.planned.layers, self.planned.settings, scenario, micro)

    def comm(self, loads: RankLoads, n: int, m: int) -> dict[str, float]:
        """Seconds per occurrence of K-FAC's collectives on the busiest rank."""
        p, c = loads.payload, loads.calls
        if self.reduction is FactorReduction.REDUCE:
            factor = self.net.reduce(_max(p, "factor_reduce"), n, _max(c, "factor_reduce"))
        else:
            factor = self.net.allreduce(_max(p, "factor_allreduce"), n, _max(c, "factor_allreduce"))
        return {
            "factor_comm": factor,
            "decomposition_comm": self.net.broadcast(
                _max(p, "decomposition_broadcast"), m, _max(c, "decomposition_broadcast")
            ),
            "grad_broadcast": self.net.broadcast(
                _max(p, "grad_broadcast"), n // m, _max(c, "grad_broadcast")
            ),
        }

    def base(self, n: int, length: RunLength) -> dict[str, float]:
        examples = length.rank_batch(n) * length.micro_batches(n)
        return {
            "compute": self.compute_per_example * examples,
            "grad_allreduce": self.net.allreduce(self.grad_bytes, n, self.grad_calls),
        }

    def kfac(self, n: int, m: int, length: RunLength) -> tuple[dict[str, float], tuple[int, int]]:
        """Seconds per occurrence of every stage (baseline's included), and the (factor, decomposition)
        intervals at ``n``."""
        micro = length.micro_batches(n)
        loads = self.loads(n, m, self.placement, micro)
        st, at = self.profile.stages_s, self.profile.measured_at
        examples = length.rank_batch(n) * micro
        stages = {
            **self.base(n, length),
            "precondition": st["precondition"]
            * (max(loads.precondition_flops) / self.ref_precondition_flops),
            "kl_clip": st["kl_clip"],
            "factor": st["factor"] * examples / at.batch_size,
            "decomposition": st["decomposition"] * max(loads.decomposition_cost) / self.ref_n3,
            **self.comm(loads, n, m),
        }
        return stages, self.planned.settings.intervals(n)


#: How often each stage runs: every step, every factor step or every decomposition step.
EVERY_STEP = ("compute", "grad_allreduce", "precondition", "grad_broadcast", "kl_clip")
FACTOR_STEP = ("factor", "factor_comm")
DECOMPOSITION_STEP = ("decomposition", "decomposition_comm")


def _amortised(stages: dict[str, float], intervals: tuple[int, int] | None) -> dict[str, float]:
    f, k = intervals or (1, 1)
    out = {}
    for name, seconds in stages.items():
        out[name] = seconds / (f if name in FACTOR_STEP else k if name in DECOMPOSITION_STEP else 1)
    return out


def _entry(
    n: int,
    arm: str,
    length: RunLength,
    stages: dict[str, float] | None,
    intervals: tuple[int, int] | None,
    grad_workers: int | None,
    reason: str | None = None,
) -> dict[str, Any]:
    steps, per_epoch, how = length.steps(n)
    entry: dict[str, Any] = {
        "world_size": n,
        "arm": arm,
        "minutes": None,
        "recipe": length.recipe,
        "epochs": length.epochs,
        "steps": steps,
        "steps_per_epoch": per_epoch,
        "length": how,
        "global_batch": length.global_batch(n),
        "grad_workers": grad_workers,
        "intervals": None if intervals is None else list(intervals),
        "step_s": None,
        "stages_s": stages,
        "stages_s_per_step": None,
        "reason": reason if stages is None else (None if steps is not None else how),
    }
    if stages is not None:
        per_step = _amortised(stages, intervals)
        entry["stages_s_per_step"] = per_step
        entry["step_s"] = sum(per_step.values())
        if steps is not None:
            entry["minutes"] = steps * entry["step_s"] / 60
    return entry


def project(
    planned: PlannedModel,
    kfac_arm: RunLength,
    baseline: RunLength,
    profile: StageProfile,
    network: Network,
    world_sizes: list[int],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``plan.json``'s ``time_to_solution`` list (one entry per world size × arm, in that order) and the
    model's inputs and reference figures (``time_to_solution_model``).

    Raises:
        ConfigError: the profile was measured on another model, or its step leaves no compute.
    """
    if profile.model and profile.model != model_name(planned):
        raise ConfigError(
            f"plan.profile_file={profile.path} was measured on model '{profile.model}', the recipe "
            f"'{planned.recipe}' plans '{model_name(planned)}': give a profile of that model"
        )
    model = _Model(planned, profile, network)
    entries = []
    for n in world_sizes:
        entries.append(_entry(n, baseline.optimizer, baseline, model.base(n, baseline), None, None))
        for strategy in STRATEGIES:
            try:
                m = strategy_workers(strategy, n, planned.grad_worker_fraction)
            except ValueError as err:
                entries.append(_entry(n, strategy, kfac_arm, None, None, None, str(err)))
                continue
            stages, intervals = model.kfac(n, m, kfac_arm)
            entries.append(_entry(n, strategy, kfac_arm, stages, intervals, m))
    _relative(entries, baseline.optimizer)
    info = {
        "baseline": baseline.to_dict(),
        "kfac": kfac_arm.to_dict(),
        "profile": profile.to_dict(),
        "network": network.to_dict(),
        "placement": planned.placement,
        "factor_reduction": planned.factor_reduction,
        "reference": model.reference,
        "recipe_precision": planned.precision,
    }
    return entries, info


def _relative(entries: list[dict[str, Any]], baseline: str) -> None:
    """Scaling efficiency against each arm's smallest world size, and the time saved against the
    baseline at the same world size."""
    arms = {e["arm"] for e in entries}
    for arm in arms:
        mine = [e for e in entries if e["arm"] == arm and e["minutes"] is not None]
        first = min(mine, key=lambda e: e["world_size"], default=None)
        for e in mine:
            assert first is not None
            e["scaling_efficiency"] = (first["minutes"] * first["world_size"]) / (
                e["minutes"] * e["world_size"]
            )
            e["efficiency_reference_world_size"] = first["world_size"]
    base = {e["world_size"]: e["minutes"] for e in entries if e["arm"] == baseline}
    for e in entries:
        b = base.get(e["world_size"])
        e["less_time_than_baseline"] = (
            None if e["arm"] == baseline or e["minutes"] is None or not b else 1 - e["minutes"] / b
        )
        e.setdefault("scaling_efficiency", None)
        e.setdefault("efficiency_reference_world_size", None)


def model_name(planned: PlannedModel) -> str:
    """The name a profile's ``model`` must carry: ``model.arch`` if the builder takes one, else the
    builder's function name."""
    arch = planned.model_args.get("arch")
    return str(arch) if arch else planned.model_target.rsplit(".", 1)[-1]


def _cell(e: dict[str, Any] | None, baseline: str) -> str:
    if e is None or e["minutes"] is None:
        return f"{'—':>21}"
    eff = e["scaling_efficiency"]
    text = f"{e['minutes']:8.1f} {100 * eff:4.0f}%"
    if e["arm"] != baseline:
        text += f" {-100 * e['less_time_than_baseline']:+4.0f}%"
    else:
        text += " " * 6
    return f"{text:>21}"


def render_time_to_solution(plan: dict[str, Any]) -> str:
    """The time-to-solution table: a line per world size, minutes per arm (with scaling efficiency against
    the smallest world size, and the change against the baseline)."""
    entries = plan.get("time_to_solution") or []
    info = plan.get("time_to_solution_model") or {}
    if not entries:
        return f"time to solution: not projected ({info.get('reason', 'no profile')})\n"
    base, kf = info["baseline"], info["kfac"]
    prof, net = info["profile"], info["network"]
    arms = [base["optimizer"], *STRATEGIES]
    lines = [
        f"time to solution (minutes; scaling efficiency vs {entries[0]['world_size']} GPUs; change vs "
        f"{base['optimizer']}): {base['optimizer']} = {base['recipe']}, K-FAC = {kf['recipe']} "
        f"({kf['optimizer']} + K-FAC, {planned_placement(info)})",
        f"  profile {prof['path']}: {prof['device']}, baseline step {1e3 * prof['baseline_step_s']:.1f} ms "
        f"at {prof['measured_at']['world_size']} GPUs; network {net['source']}",
        f"  {'GPUs':>5} {'global batch':>12} {'intervals':>10} | "
        + " | ".join(f"{a:>21}" for a in arms),
    ]
    for n in sorted({e["world_size"] for e in entries}):
        here = {e["arm"]: e for e in entries if e["world_size"] == n}
        k = here.get("comm_opt") or {}
        iv = k.get("intervals")
        ivs = "—" if not iv else f"{iv[0]}/{iv[1]}"
        gb = (here.get(base["optimizer"]) or {}).get("global_batch")
        lines.append(
            f"  {n:>5} {gb if gb is not None else '—':>12} {ivs:>10} | "
            + " | ".join(_cell(here.get(a), base["optimizer"]) for a in arms)
        )
    if prof["precision"] not in ("unstated", info.get("recipe_precision", prof["precision"])):
        lines.append(
            f"  note: the profile was measured in {prof['precision']}, the recipe trains in "
            f"{info['recipe_precision']}; its step and stage times are taken as they are"
        )
    missing = sorted({e["reason"] for e in entries if e["minutes"] is None and e["reason"]})
    lines += [f"  not projected: {r}" for r in missing]
    ref = info["reference"]
    measured = ref["profiled_comm_s"]
    if measured:
        modelled = ref["modelled_comm_s"]
        pairs = ", ".join(
            f"{k} {1e3 * modelled[k]:.0f} ms (profile {1e3 * v:.0f} ms)"
            for k, v in measured.items()
            if k in modelled
        )
        lines.append(f"  network model at the profile's configuration: {pairs}")
    return "\n".join(lines) + "\n"


def planned_placement(info: dict[str, Any]) -> str:
    return f"{info['placement']} placement, factors by {info['factor_reduction']}"
