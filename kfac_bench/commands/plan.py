"""``kfac-bench plan``: what a recipe's K-FAC costs per GPU at N GPUs, computed from the layer shapes and the
engine's own placement and bucketing (:mod:`kfac_bench.plan`), and, from a profile, the minutes to the end of
training against the baseline optimizer, before any GPU is booked."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfac_bench.plan.config import PlanConfig
    from kfac_bench.plan.stage_profile import StageProfile

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  plan      K-FAC memory, traffic, balance and time to solution per GPU count before a run:
            kfac-bench plan +recipe=NAME [plan.world_sizes=[8,16,32,64,128]] [plan.memory_budget_gb=X]
            [plan.profile_file=PROFILE.yaml] [plan.out=DIR] (kfac-bench plan --help lists the plan keys)"""

HELP = """\
usage: kfac-bench plan [+recipe=NAME] [kfac.KEY=VALUE ...] [train.KEY=VALUE ...] [plan.KEY=VALUE ...]

For each world size x grad_worker_fraction (every one that gives equal groups) x placement (lpt, round_robin)
x factor reduction (allreduce, reduce): factor elements and decomposition cost (sum of n^3) per rank, K-FAC
memory per rank by category, and the bytes each collective sends per step / factor step / decomposition step;
per world size, the factor computation per rank over the rows kfac.factor_batch_fraction and
kfac.factor_position_fraction keep. With plan.profile_file: minutes to the end of training per world size for
the baseline recipe and K-FAC as COMM-OPT, MEM-OPT and HYBRID-OPT (docs/plan.md#time-to-solution).
The model is built on the meta device from the recipe exactly as `kfac-bench train` composes it.

plan keys:
  plan.world_sizes=[8,16,32,64,128]   GPUs to plan for (each at most 16384)
  plan.fractions=[...]                grad_worker_fraction values (default: all with equal groups)
  plan.memory_budget_gb=X             recommend the fastest row that fits X GiB per GPU
  plan.out=DIR                        where the files go (default: runs/plan/<recipe>_<date>-<time>)
  plan.profile=true                   time decompositions/GEMMs on this device for the seconds per stage
  plan.profile_seconds=20             cap on the profiling time
  plan.profile_file=PATH              per-stage costs and the baseline step measured elsewhere (YAML, e.g.
                                      profiles/paper_v100_resnet50.yaml or make gpu-check's): time to solution
  plan.baseline=RECIPE                the baseline arm's recipe (default: <recipe>_<optimizer>)
  plan.dataset_size=N                 training examples, where the dataset's config does not state them
  plan.kfac_epochs=N                  the K-FAC arm's epochs (default: its recipe's train.epochs)
  plan.kfac_max_steps=N               the K-FAC arm's step budget (default: its recipe's train.max_steps)
  plan.baseline_epochs=N              the baseline arm's epochs (default: its recipe's)
  plan.baseline_max_steps=N           the baseline arm's step budget (default: its recipe's)
Each arm keeps its own length: train.epochs / train.max_steps on this command line are refused (they would
change both arms); plan.memory_budget_gb counts K-FAC's memory only (factors, decompositions, buffers).
plan.out must be a new or empty folder (a plan never overwrites an earlier one).
  plan.bandwidth_gb_s=12.5            network bandwidth per GPU (default: the profile's, else 12.5)
  plan.latency_us=6.6                 network latency per ring step (default: the profile's, else 6.6)
"""


def writable_folder(out: Path) -> None:
    """Check, before any work, that ``out`` is or can become a writable folder.

    Raises:
        UserError: ``out`` (or a folder above it) is a file, or the nearest existing folder is not writable.
    """
    from kfac_bench.errors import UserError

    if out.exists() and not out.is_dir():
        raise UserError(
            f"plan.out={out} is a file, not a folder: give a folder for the plan's files"
        )
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"plan.out={out} cannot be created: {existing} is a file; give a folder for the plan's files"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"plan.out={out} is not writable ({existing} is read-only to this user): give a writable folder"
        )


#: Command-line keys that would set both arms' length at once.
BOTH_ARMS = ("train.epochs", "train.max_steps")


def main(args: Sequence[str]) -> int:
    """``kfac-bench plan ARGS``: prints the tables, writes ``plan.json``, ``plan.png`` and, with a profile,
    ``time_to_solution.png``."""
    if "--help" in args or "-h" in args:
        print(HELP, end="")
        return 0
    from kfac_bench.errors import ConfigError
    from kfac_bench.plan.config import parse_plan_config, split_overrides

    plan_args, rest = split_overrides(args)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        raise ConfigError(f"kfac-bench plan takes key=value overrides only, not {flags[0]}")
    both = [a for a in rest if a.lstrip("+~").split("=", 1)[0] in BOTH_ARMS]
    if both:
        key = both[0].lstrip("+~").split("=", 1)[0]
        which = key.removeprefix("train.")
        raise ConfigError(
            f"{key} on the plan's command line would change both arms' length: give "
            f"plan.kfac_{which}=N and/or plan.baseline_{which}=N"
        )
    cfg = parse_plan_config(plan_args)
    from kfac_bench.safe_files import new_folder_name, output_folder

    if cfg.out is not None:  # before the seconds of work a plan takes: new or empty, else refused
        output_folder(cfg.out, f"plan.out={cfg.out}", "the plan's files").close()
    else:
        writable_folder(Path("runs", "plan"))

    from kfac_bench.plan.length import load_baseline, with_length
    from kfac_bench.plan.plot import plot_plan, plot_time_to_solution
    from kfac_bench.plan.recipe import load_recipe
    from kfac_bench.plan.report import build_plan, grad_worker_counts, render
    from kfac_bench.plan.stage_profile import load_profile
    from kfac_bench.plan.time_to_solution import (
        DEFAULT_BANDWIDTH_GB_S,
        DEFAULT_LATENCY_US,
        Network,
        model_name,
        project,
    )
    from kfac_bench.plan.timing import NOMINAL_V100
    from kfac_bench.plan.tts_render import render_time_to_solution

    for n in cfg.world_sizes:  # bad fractions fail before the model is built
        grad_worker_counts(n, cfg.fractions)
    profile = None if cfg.profile_file is None else load_profile(cfg.profile_file)
    bandwidth, latency, net_source = _network(
        cfg, profile, DEFAULT_BANDWIDTH_GB_S, DEFAULT_LATENCY_US
    )
    planned = load_recipe(rest, cfg.dataset_size)
    assert planned.length is not None
    kfac_arm = with_length(planned.length, cfg.kfac_epochs, cfg.kfac_max_steps)
    baseline = None
    if profile is not None:
        baseline = load_baseline(rest, planned.length, cfg.baseline, cfg.dataset_size)
        baseline = with_length(baseline, cfg.baseline_epochs, cfg.baseline_max_steps)
    rates = NOMINAL_V100.with_bandwidth(bandwidth * 1e9)
    if cfg.profile:
        from kfac_bench.plan.profile import profile_rates

        dims = [d for s in planned.layers for d in (s.a_dim, s.g_dim)]
        rates = profile_rates(dims, planned.settings, cfg.profile_seconds, bandwidth * 1e9)
    plan = build_plan(planned, cfg, rates)
    plan["model"] = model_name(planned)
    if profile is not None and baseline is not None:
        network = Network(bandwidth * 1e9, latency * 1e-6, net_source)
        entries, info = project(planned, kfac_arm, baseline, profile, network, cfg.world_sizes)
        plan["time_to_solution"], plan["time_to_solution_model"] = entries, info
    else:
        plan["time_to_solution"] = []
        plan["time_to_solution_model"] = {
            "reason": "no measured baseline step: give plan.profile_file=PROFILE.yaml (make gpu-check "
            "writes one on a GPU; profiles/ has the paper's)"
        }
    default = Path("runs", "plan", new_folder_name(planned.recipe))
    out = Path(cfg.out) if cfg.out is not None else default
    with output_folder(out, f"plan.out={out}", "the plan's files") as folder:
        written = [
            folder.write("plan.json", json.dumps(plan, indent=1) + "\n"),
            folder.replace("plan.png", lambda f: plot_plan(plan, f)),
        ]
        if plan["time_to_solution"]:
            written.append(
                folder.replace("time_to_solution.png", lambda f: plot_time_to_solution(plan, f))
            )
    print(render(plan), end="")
    print()
    print(render_time_to_solution(plan), end="")
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def _network(
    cfg: PlanConfig, profile: StageProfile | None, bandwidth_gb_s: float, latency_us: float
) -> tuple[float, float, str]:
    """(GB/s, µs per ring step, words): the command line's, else the profile's, else the defaults."""
    if cfg.bandwidth_gb_s is not None:
        bw, bw_from = cfg.bandwidth_gb_s, "plan.bandwidth_gb_s"
    elif profile is not None and profile.bandwidth_bytes is not None:
        bw, bw_from = profile.bandwidth_bytes / 1e9, "profile"
    else:
        bw, bw_from = bandwidth_gb_s, "default: InfiniBand EDR"
    if cfg.latency_us is not None:
        lat, lat_from = cfg.latency_us, "plan.latency_us"
    elif profile is not None and profile.latency_s is not None:
        lat, lat_from = profile.latency_s * 1e6, "profile"
    else:
        lat, lat_from = latency_us, "default: NCCL's ring step over the network"
    parts = [f"{bw:g} GB/s ({bw_from})", f"{lat:g} µs per ring step ({lat_from})"]
    return bw, lat, ", ".join(parts)
