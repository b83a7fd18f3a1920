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

With a cluster file (:mod:`.cluster`, named by the profile) two terms follow the cluster's measured growth
with N: the baseline step gains the cluster's **baseline growth** (seconds beyond the ring model, against
the profile's world size), and K-FAC's every-step stages (preconditioning, KL clip) follow its
**K-FAC growth**: stretched by the part of it that rises with N, the rest added as the reference model's
seconds (:meth:`~kfac_bench.plan.cluster.Cluster.every_step_factor`). Without one, nothing grows with N
but the network terms.

Every projection carries a band, ``minutes_low``..``minutes_high``: the lowest and highest minutes over
the cluster's readings for another model (:data:`~kfac_bench.plan.cluster.VARIANTS`), widened by the
relative uncertainty ``u = sqrt(spread² + uncertainty²)`` (the cluster's spread of repeated measurements,
the profile's own input uncertainty; :data:`DEFAULT_UNCERTAINTY` where neither is stated).

The profile gives one step and one set of stage costs at one configuration, the cluster its growth, the
network two stated numbers, and the recipes the epochs, batch and intervals. Overlap of communication with
computation, data loading beyond the profile's step and I/O at scale are in the cluster's growth only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kfac_bench.errors import ConfigError
from kfac_bench.kfac import FactorReduction, Placement
from kfac_bench.kfac.assignment import grad_workers_per_layer
from kfac_bench.kfac.options import parse_grad_worker_fraction

from .cluster import VARIANTS, Variant
from .costs import RankLoads, Scenario, rank_loads
from .length import RunLength
from .network import DEFAULT_BANDWIDTH_GB_S, DEFAULT_LATENCY_US, GRAD_BUCKET_BYTES, Network
from .recipe import PlannedModel
from .stage_profile import StageProfile

__all__ = [
    "BAND_Z",
    "DEFAULT_BANDWIDTH_GB_S",
    "DEFAULT_LATENCY_US",
    "DEFAULT_UNCERTAINTY",
    "GRAD_BUCKET_BYTES",
    "STRATEGIES",
    "Network",
    "check_batch",
    "model_name",
    "project",
    "strategy_workers",
]

#: K-FAC arms, KAISA's names; HYBRID-OPT at the recipe's fraction if it is a hybrid one, else 1/2 (KAISA's
#: HYBRID-OPT in its Fig. 8 and BERT runs).
STRATEGIES = ("comm_opt", "mem_opt", "hybrid_opt")
HYBRID_FRACTION = 0.5
#: Relative uncertainty of a projection whose profile states none and names no cluster: assumed, stated in
#: the output as such.
DEFAULT_UNCERTAINTY = 0.10
#: The band is meant to hold 90 % of measurements: 1.645 standard deviations of a normal spread on either
#: side (the two-sided 90 % quantile).
BAND_Z = 1.645


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

    def __init__(
        self,
        planned: PlannedModel,
        profile: StageProfile,
        network: Network,
        variant: Variant = VARIANTS[0],
    ) -> None:
        self.planned, self.profile, self.net, self.variant = planned, profile, network, variant
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
        out = {
            "compute": self.compute_per_example * examples,
            "grad_allreduce": self.net.allreduce(self.grad_bytes, n, self.grad_calls),
        }
        cluster = self.profile.cluster
        if cluster is not None:
            at = self.profile.measured_at.world_size
            out["cluster_growth"] = cluster.baseline_extra(n, at, self.grad_bytes, self.variant)
        return out

    def every_step(self, seconds: float, n: int) -> float:
        """K-FAC every-step ``seconds`` (at the profile's world size) at ``n`` GPUs on the cluster."""
        cluster = self.profile.cluster
        if cluster is None:
            return seconds
        st = self.profile.stages_s
        total = st["precondition"] + st["kl_clip"]
        at = self.profile.measured_at.world_size
        return seconds * cluster.every_step_factor(n, at, self.variant, total)

    def kfac(self, n: int, m: int, length: RunLength) -> tuple[dict[str, float], tuple[int, int]]:
        """Seconds per occurrence of every stage (baseline's included), and the (factor, decomposition)
        intervals at ``n``."""
        micro = length.micro_batches(n)
        loads = self.loads(n, m, self.placement, micro)
        st, at = self.profile.stages_s, self.profile.measured_at
        examples = length.rank_batch(n) * micro
        stages = {
            **self.base(n, length),
            "precondition": self.every_step(
                st["precondition"] * max(loads.precondition_flops) / self.ref_precondition_flops, n
            ),
            "kl_clip": self.every_step(st["kl_clip"], n),
            "factor": st["factor"] * examples / at.batch_size,
            "decomposition": st["decomposition"] * max(loads.decomposition_cost) / self.ref_n3,
            **self.comm(loads, n, m),
        }
        # The preconditioned-gradient broadcast runs every step too: it grows with the rest.
        stages["grad_broadcast"] = self.every_step(stages["grad_broadcast"], n)
        return stages, self.planned.settings.intervals(n)


#: How often each stage runs: every step, every factor step or every decomposition step.
EVERY_STEP = (
    "compute",
    "grad_allreduce",
    "cluster_growth",
    "precondition",
    "grad_broadcast",
    "kl_clip",
)
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
    try:
        steps, per_epoch, how = length.steps(n)
        global_batch: int | None = length.global_batch(n)
    except ConfigError as err:  # the recipe cannot run at n: this row only, with its reason
        steps, per_epoch, how, global_batch = None, None, str(err), None
        stages, reason = None, reason or str(err)
    entry: dict[str, Any] = {
        "world_size": n,
        "arm": arm,
        "minutes": None,
        "minutes_low": None,
        "minutes_high": None,
        "recipe": length.recipe,
        "epochs": length.epochs,
        "max_steps": length.max_steps,
        "steps": steps,
        "steps_per_epoch": per_epoch,
        "length": how,
        "global_batch": global_batch,
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


def _entries(
    model: _Model, planned: PlannedModel, kfac_arm: RunLength, baseline: RunLength, n: int
) -> list[dict[str, Any]]:
    """The baseline's and each K-FAC strategy's entry at ``n`` GPUs (a world size the recipe cannot use
    gives entries without minutes, with the reason)."""

    def guarded(fn: Any) -> Any:
        try:
            return fn(), None
        except ConfigError as err:
            return None, str(err)

    base, why = guarded(lambda: model.base(n, baseline))
    out = [_entry(n, baseline.optimizer, baseline, base, None, None, why)]
    for strategy in STRATEGIES:
        try:
            m = strategy_workers(strategy, n, planned.grad_worker_fraction)
        except ValueError as err:
            out.append(_entry(n, strategy, kfac_arm, None, None, None, str(err)))
            continue
        got, why = guarded(lambda m=m: model.kfac(n, m, kfac_arm))
        stages, intervals = got if got is not None else (None, None)
        out.append(_entry(n, strategy, kfac_arm, stages, intervals, m, why))
    return out


def uncertainty(profile: StageProfile) -> tuple[float, str]:
    """The band's relative half-width beyond the cluster's readings, and where it comes from:
    :data:`BAND_Z` × sqrt(spread² + uncertainty²)."""
    cluster = profile.cluster
    parts = []
    if cluster is not None and cluster.spread:
        parts.append((cluster.spread, f"the cluster's spread {100 * cluster.spread:.2f} %"))
    if profile.uncertainty:
        parts.append((profile.uncertainty, f"the profile's {100 * profile.uncertainty:.2f} %"))
    if not parts:
        return DEFAULT_UNCERTAINTY, f"unstated: {100 * DEFAULT_UNCERTAINTY:.0f} % assumed"
    sigma = math.sqrt(sum(u * u for u, _ in parts))
    words = " and ".join(w for _, w in parts)
    return BAND_Z * sigma, f"90 % of a normal spread: {BAND_Z} x {words}"


#: How far the profile's examples per rank per step may be from the recipe's at the profile's world size:
#: the compute is scaled per example, which holds near the measured batch; a micro-batch given for a whole
#: step under accumulation (16 for 2048) is off by far more.
BATCH_RATIO = 4


def check_batch(profile: StageProfile, kfac_arm: RunLength) -> None:
    """Refuse a profile whose examples per rank per step, at its world size, are more than
    :data:`BATCH_RATIO` times more or fewer than the recipe's there (a micro-batch given for a step under
    accumulation projects the whole run wrong by that factor).

    Raises:
        ConfigError: one line naming both batches and the fix.
    """
    at = profile.measured_at
    try:
        recipe = kfac_arm.rank_batch(at.world_size) * kfac_arm.micro_batches(at.world_size)
    except ConfigError as err:
        raise ConfigError(
            f"plan.profile_file={profile.path} was measured at {at.world_size} GPUs, where the recipe "
            f"'{kfac_arm.recipe}' cannot run ({err})"
        ) from None
    if max(recipe, at.batch_size) > BATCH_RATIO * min(recipe, at.batch_size):
        raise ConfigError(
            f"plan.profile_file={profile.path}: measured_at.batch_size={at.batch_size} at "
            f"{at.world_size} GPUs implies a global batch of {at.batch_size * at.world_size}, but "
            f"'{kfac_arm.recipe}' trains {recipe} examples per rank per step there (global "
            f"{recipe * at.world_size}); batch_size is the examples per rank per optimizer step, all "
            f"micro-batches together (within {BATCH_RATIO}x of the recipe's)"
        )


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
        ConfigError: the profile was measured on another model or another batch, or its step leaves no
            compute.
    """
    if profile.model and profile.model != model_name(planned):
        raise ConfigError(
            f"plan.profile_file={profile.path} was measured on model '{profile.model}', the recipe "
            f"'{planned.recipe}' plans '{model_name(planned)}': give a profile of that model"
        )
    check_batch(profile, kfac_arm)
    variants = VARIANTS if profile.cluster is not None else VARIANTS[:1]
    models = [_Model(planned, profile, network, v) for v in variants]
    runs = [
        [e for n in world_sizes for e in _entries(m, planned, kfac_arm, baseline, n)]
        for m in models
    ]
    entries = runs[0]
    u, u_source = uncertainty(profile)
    for i, e in enumerate(entries):
        if e["minutes"] is None:
            continue
        values = [run[i]["minutes"] for run in runs if run[i]["minutes"] is not None]
        e["minutes_low"] = min(values) * (1 - u)
        e["minutes_high"] = max(values) * (1 + u)
    _relative(entries, baseline.optimizer)
    info = {
        "baseline": baseline.to_dict(),
        "kfac": kfac_arm.to_dict(),
        "model": model_name(planned),
        "profile": profile.to_dict(),
        "network": network.to_dict(),
        "placement": planned.placement,
        "factor_reduction": planned.factor_reduction,
        "reference": models[0].reference,
        "recipe_precision": planned.precision,
        "band": {
            "relative_uncertainty": u,
            "source": u_source,
            "variants": [vars(v) for v in variants],
        },
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
    """The model's name as users name it (:func:`kfac_bench.config.model_name`), which a profile's
    ``model`` must carry."""
    from kfac_bench.config import model_name as name_of

    return name_of({"_target_": planned.model_target, **planned.model_args})
