"""``kfac-bench plan``: what a recipe's K-FAC costs per GPU at N GPUs, computed from the layer shapes and the
engine's own placement and bucketing (:mod:`kfac_bench.plan`), before any GPU is booked."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  plan      K-FAC memory, traffic and balance per GPU before a run: kfac-bench plan +recipe=NAME
            [plan.world_sizes=[8,16,32,64,128]] [plan.memory_budget_gb=X] [plan.out=DIR]
            [plan.profile=true] (kfac-bench plan --help lists the plan keys)"""

HELP = """\
usage: kfac-bench plan [+recipe=NAME] [kfac.KEY=VALUE ...] [plan.KEY=VALUE ...]

For each world size x grad_worker_fraction (every one that gives equal groups) x placement (lpt, round_robin)
x factor reduction (allreduce, reduce): factor elements and decomposition cost (sum of n^3) per rank, K-FAC
memory per rank by category, and the bytes each collective sends per step / factor step / decomposition step;
per world size, the factor computation per rank over the rows kfac.factor_batch_fraction and
kfac.factor_position_fraction keep.
The model is built on the meta device from the recipe exactly as `kfac-bench train` composes it.

plan keys:
  plan.world_sizes=[8,16,32,64,128]   GPUs to plan for (each at most 16384)
  plan.fractions=[...]                grad_worker_fraction values (default: all with equal groups)
  plan.memory_budget_gb=X             recommend the fastest row that fits X GiB per GPU
  plan.out=DIR                        where plan.json and plan.png go (default: plan)
  plan.profile=true                   time decompositions/GEMMs on this device for the seconds per stage
  plan.profile_seconds=20             cap on the profiling time
  plan.bandwidth_gb_s=12.5            network bandwidth per GPU assumed for the communication seconds
"""


def main(args: Sequence[str]) -> int:
    """``kfac-bench plan ARGS``: prints the table, writes ``plan.json`` and ``plan.png``."""
    if "--help" in args or "-h" in args:
        print(HELP, end="")
        return 0
    from kfac_bench.errors import ConfigError
    from kfac_bench.plan.config import parse_plan_config, split_overrides

    plan_args, rest = split_overrides(args)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        raise ConfigError(f"kfac-bench plan takes key=value overrides only, not {flags[0]}")
    cfg = parse_plan_config(plan_args)

    from kfac_bench.plan.plot import plot_plan
    from kfac_bench.plan.recipe import load_recipe
    from kfac_bench.plan.report import build_plan, grad_worker_counts, render
    from kfac_bench.plan.timing import NOMINAL_V100

    for n in cfg.world_sizes:  # bad fractions fail before the model is built
        grad_worker_counts(n, cfg.fractions)
    planned = load_recipe(rest)
    rates = NOMINAL_V100.with_bandwidth(cfg.bandwidth_gb_s * 1e9)
    if cfg.profile:
        from kfac_bench.plan.profile import profile_rates

        dims = [d for s in planned.layers for d in (s.a_dim, s.g_dim)]
        rates = profile_rates(dims, planned.settings, cfg.profile_seconds, cfg.bandwidth_gb_s * 1e9)
    plan = build_plan(planned, cfg, rates)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    plot_plan(plan, out / "plan.png")
    print(render(plan), end="")
    print(f"wrote {out / 'plan.json'}, {out / 'plan.png'}")
    return 0
