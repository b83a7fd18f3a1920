"""The plan of a recipe: every row (world size × fraction × placement × factor reduction), the recommendation
under a memory budget, and their text rendering. ``plan.json`` is :func:`build_plan`'s dict."""

from __future__ import annotations

from typing import Any

from kfac_bench.errors import ConfigError
from kfac_bench.kfac import FactorReduction, Placement
from kfac_bench.kfac.assignment import grad_workers_per_layer

from .config import PlanConfig
from .costs import Scenario, equal_group_workers, rank_loads, row_dict
from .recipe import PlannedModel
from .reference import render_table5, table5_comparison
from .time_to_solution import model_name
from .timing import Rates, stage_seconds

__all__ = ["build_plan", "grad_worker_counts", "recommend", "render"]

MIB, GIB = 2**20, 2**30


def grad_worker_counts(world_size: int, fractions: list[str] | None) -> list[int]:
    """Gradient workers per layer to plan at ``world_size``: every count that gives equal groups, or those of
    the given ``fractions`` (the engine's rule, :func:`~kfac_bench.kfac.assignment.grad_workers_per_layer`).

    Raises:
        ConfigError: a fraction that does not split ``world_size`` into equal groups, or is not a fraction.
    """
    if fractions is None:
        return equal_group_workers(world_size)
    counts = set()
    for f in fractions:
        try:
            counts.add(grad_workers_per_layer(f, world_size))
        except ValueError as err:
            raise ConfigError(f"plan.fractions: {err}") from None
    return sorted(counts)


def build_plan(planned: PlannedModel, cfg: PlanConfig, rates: Rates) -> dict[str, Any]:
    """Every row of the plan, with the recommendation and the KAISA Table 5 comparison where they apply."""
    s = planned.settings
    rows = []
    factor_stage = []
    for n in cfg.world_sizes:
        intervals = s.intervals(n)
        micro = planned.accumulation(n)
        flops = planned.factor_calls.flops(micro)
        factor_stage.append(
            {
                "world_size": n,
                "micro_batches": micro,
                "flops_per_factor_step": flops,
                "seconds_per_factor_step": None if flops is None else flops / rates.gemm_flops,
                "factor_update_steps": intervals[0],
            }
        )
        for m in grad_worker_counts(n, cfg.fractions):
            for placement in (Placement.LPT, Placement.ROUND_ROBIN):
                for reduction in (FactorReduction.ALLREDUCE, FactorReduction.REDUCE):
                    loads = rank_loads(
                        planned.layers,
                        s,
                        Scenario(n, m, placement, reduction),
                        planned.accumulation(n),
                    )
                    row = row_dict(loads, intervals)
                    row["seconds"] = stage_seconds(loads, rates, intervals, flops)
                    rows.append(row)
    plan: dict[str, Any] = {
        "recipe": planned.recipe,
        "model": model_name(planned),
        "coverage": planned.scan.coverage().to_dict(),
        "settings": {
            "factor_dtype": _name(s.factor_dtype),
            "inv_dtype": _name(s.inv_dtype),
            "comm_dtype": _name(s.comm_dtype),
            "grad_dtype": _name(s.grad_dtype),
            "compute_method": str(s.compute_method),
            "derived_parts": list(s.method.derived),
            "colocate_factors": s.colocate_factors,
            "assignment_strategy": str(s.assignment_strategy),
            "allreduce_bucket_cap_mb": s.bucket_cap_mb,
            "symmetry_aware": s.symmetry_aware,
            "factor_update_steps": s.factor_update_steps,
            "inv_update_steps": s.inv_update_steps,
            "reference_world_size": s.reference_world_size,
            "factor_batch_fraction": s.factor_batch_fraction,
            "factor_position_fraction": s.factor_position_fraction,
        },
        "factor_computation": {
            **planned.factor_calls.to_dict(),
            "micro_batch": planned.batch_size,
            "per_world_size": factor_stage,
        },
        "rates": rates.to_dict(),
        "layers": [
            {
                "name": x.name,
                "type": x.type,
                "a_dim": x.a_dim,
                "g_dim": x.g_dim,
                "bias": x.bias,
                "params": x.params,
            }
            for x in planned.layers
        ],
        "rows": rows,
    }
    if cfg.memory_budget_gb is not None:
        plan["memory_budget_gb"] = cfg.memory_budget_gb
        plan["memory_budget_counts"] = (
            "K-FAC's memory only: factors, decompositions and buffers on the fullest rank; the model, "
            "activations and optimizer state are not included"
        )
        plan["recommendations"] = recommend(rows, cfg.memory_budget_gb)
    table5 = table5_comparison(planned)
    if table5 is not None:
        plan["kaisa_table5"] = table5
    return plan


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _label(row: dict[str, Any]) -> str:
    return f"{row['strategy']} {_fraction(row)}, {row['placement']}, factors by {row['factor_reduction']}"


def _fraction(row: dict[str, Any]) -> str:
    m, n = row["grad_workers"], row["world_size"]
    return "1" if m == n else f"{m}/{n}"


def recommend(rows: list[dict[str, Any]], budget_gb: float) -> list[dict[str, Any]]:
    """Per world size: the row with the fewest estimated K-FAC seconds per step among those whose fullest
    rank fits ``budget_gb`` GiB (fewer bytes break ties), with the reason in words."""
    budget = budget_gb * GIB
    out = []
    for n in sorted({r["world_size"] for r in rows}):
        here = [r for r in rows if r["world_size"] == n]

        def peak(r: dict[str, Any]) -> int:
            return int(r["memory_bytes_per_rank"]["total"]["max"])

        fits = [r for r in here if peak(r) <= budget]
        if not fits:
            least = min(here, key=peak)
            out.append(
                {
                    "world_size": n,
                    "row": None,
                    "reason": f"nothing fits {budget_gb:g} GiB: the least memory is {_label(least)} "
                    f"with {peak(least) / GIB:.2f} GiB on its fullest rank",
                }
            )
            continue
        best = min(fits, key=lambda r: (r["seconds"]["per_step"], peak(r)))
        faster = [r for r in here if r["seconds"]["per_step"] < best["seconds"]["per_step"]]
        why = (
            f"{_label(best)}: {peak(best) / GIB:.2f} GiB on its fullest rank <= {budget_gb:g} GiB, "
            f"~{1e3 * best['seconds']['per_step']:.1f} ms of K-FAC per step"
        )
        if faster:
            quick = min(faster, key=lambda r: r["seconds"]["per_step"])
            why += (
                f"; the faster {_label(quick)} (~{1e3 * quick['seconds']['per_step']:.1f} ms) needs "
                f"{peak(quick) / GIB:.2f} GiB"
            )
        else:
            why += "; the fastest row of all"
        out.append({"world_size": n, "row": rows.index(best), "reason": why})
    return out


def _count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


HEADER = (
    f"  {'strategy':<10} {'frac':>6} {'placement':<11} {'reduction':<9} | {'factor elems/rank':>17} | "
    f"{'Σn³ max':>8} {'/ideal':>6} | {'memory/rank MiB: factors':>24} {'decomp':>6} {'buffers':>7} "
    f"{'total':>6} | {'sent/rank MiB: step':>19} {'factor':>6} {'decomp':>6} | {'ms/step':>7}"
)


def _line(row: dict[str, Any]) -> str:
    fe, dc, mem, comm = (
        row["factor_elements_per_rank"],
        row["decomposition_cost_per_rank"],
        row["memory_bytes_per_rank"],
        row["comm_bytes"],
    )
    buffers = mem["buffers"]["max"]
    return (
        f"  {row['strategy']:<10} {_fraction(row):>6} {row['placement']:<11} "
        f"{row['factor_reduction']:<9} | {_count(fe['min']):>8}..{_count(fe['max']):<7} | "
        f"{dc['max']:>8.2e} {dc['max'] / dc['ideal']:>5.2f}x | {mem['factors']['max'] / MIB:>24.0f} "
        f"{mem['decompositions']['max'] / MIB:>6.0f} {buffers / MIB:>7.0f} {mem['total']['max'] / MIB:>6.0f} "
        f"| {comm['per_step']['max'] / MIB:>19.1f} {comm['per_factor_step']['max'] / MIB:>6.1f} "
        f"{comm['per_decomposition_step']['max'] / MIB:>6.1f} | {1e3 * row['seconds']['per_step']:>7.1f}"
    )


def _factor_rows(plan: dict[str, Any]) -> str:
    """The rows the factor products use: the fractions, and what they keep of one micro-batch."""
    fc, s = plan["factor_computation"], plan["settings"]
    fb, fp = s["factor_batch_fraction"], s["factor_position_fraction"]
    text = (
        f"factor statistics: factor_batch_fraction={fb:g}, factor_position_fraction={fp:g} "
        f"(micro-batch {fc['micro_batch']}"
    )
    if fc["reason"] is not None:
        return f"{text}); factor computation not planned: {fc['reason']}"
    used = sum(c["examples_used"] * c["positions_used"] for c in fc["calls"])
    every = sum(c["examples"] * c["positions"] for c in fc["calls"])
    ratio = sum(c["flops"] for c in fc["calls"]) / sum(c["exact_flops"] for c in fc["calls"])
    return (
        f"{text}: {_count(used)} of {_count(every)} rows over its layer calls; "
        f"factor computation {ratio:.3g}x that of every row)"
    )


def _factor_stage(plan: dict[str, Any], world_size: int) -> str:
    """The factor computation per rank at ``world_size`` (the same for every row)."""
    fc = plan["factor_computation"]
    if fc["reason"] is not None:
        return "factor computation not planned"
    w = next(x for x in fc["per_world_size"] if x["world_size"] == world_size)
    micro = w["micro_batches"]
    return (
        f"factor computation per rank {w['flops_per_factor_step'] / 1e9:.3g} GFLOP per factor step "
        f"({micro} micro-batch{'es' if micro > 1 else ''}), "
        f"~{1e3 * w['seconds_per_factor_step']:.2f} ms at the GEMM rate, factors every "
        f"{w['factor_update_steps']} step{'s' if w['factor_update_steps'] > 1 else ''}"
    )


def render(plan: dict[str, Any]) -> str:
    """The plan as text: a header, one line per row grouped by world size, recommendations, Table 5."""
    s, cov = plan["settings"], plan["coverage"]
    largest = max(max(x["a_dim"], x["g_dim"]) for x in plan["layers"])
    lines = [
        f"kfac-bench plan: {plan['recipe']} ({plan.get('model', '?')}) — {len(plan['layers'])} K-FAC layers, "
        f"{100 * cov['share']:.1f}% of {_count(cov['trainable_params'])} trainable parameters; "
        f"largest factor {largest}² (floor {float(largest) ** 3:.2e} n³)",
        f"engine: {s['compute_method']} (parts {', '.join(['a', 'g', *s['derived_parts']])}), factors "
        f"{s['factor_dtype']}, decompositions {s['inv_dtype']}, factor comm {s['comm_dtype']}"
        f"{' (upper triangles)' if s['symmetry_aware'] else ''}, "
        f"buckets {s['allreduce_bucket_cap_mb']:g} MB, "
        f"intervals {s['factor_update_steps']}/{s['inv_update_steps']}"
        f"{' at reference world ' + str(s['reference_world_size']) if s['reference_world_size'] else ''}",
        _factor_rows(plan),
        f"per rank: min..max over ranks, else the fullest rank; buffers = peak of batch factors + in-flight "
        f"factor buckets over a factor step; ms/step: {plan['rates']['source']}",
    ]
    for n in sorted({r["world_size"] for r in plan["rows"]}):
        here = [r for r in plan["rows"] if r["world_size"] == n]
        ideal = here[0]["decomposition_cost_per_rank"]["ideal"]
        lines += [
            "",
            f"{n} GPUs (ideal Σn³ per rank {ideal:.2e}); {_factor_stage(plan, n)}",
            HEADER,
        ]
        lines += [_line(r) for r in here]
    if "recommendations" in plan:
        lines += [
            "",
            f"recommended under {plan['memory_budget_gb']:g} GiB per GPU of K-FAC memory (factors, "
            "decompositions and buffers only; the model, activations and optimizer state come on top):",
        ]
        lines += [f"  {r['world_size']:>4} GPUs: {r['reason']}" for r in plan["recommendations"]]
    if "kaisa_table5" in plan:
        lines += ["", render_table5(plan["kaisa_table5"])]
    return "\n".join(lines) + "\n"
