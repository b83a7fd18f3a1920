"""``plan.*`` command-line keys: a small typed config of the planner, kept out of the training config.

``kfac-bench plan`` takes the command line of ``kfac-bench train`` (``+recipe=NAME``, ``kfac.*=...``) plus
``plan.*`` keys. The ``plan.*`` keys are split off first and parsed into :class:`PlanConfig` (OmegaConf
checks names and types against the dataclass); the rest composes the training config exactly as
``kfac-bench train`` does, so the primary config has no ``plan`` node and ``train --cfg job`` is unchanged.
"""

# ruff: noqa: UP006, UP035
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import List

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from kfac_bench.errors import ConfigError

__all__ = ["MAX_WORLD_SIZE", "PREFIX", "PlanConfig", "parse_plan_config", "split_overrides"]

PREFIX = "plan."
#: The largest world size the planner takes: it evaluates every rank of every row, so its time and memory
#: grow with the world size (seconds at this size; a billion ranks would need tens of GB).
MAX_WORLD_SIZE = 16384
#: The longest arm the planner takes, in epochs or steps (a bound, not a limit of any real run).
MAX_LENGTH = 10_000_000
#: Upper bounds of the numeric plan keys (GiB per GPU, seconds of profiling, GB/s, µs).
FLOAT_LIMITS = {
    "memory_budget_gb": 1e6,
    "profile_seconds": 86_400.0,
    "bandwidth_gb_s": 1e5,
    "latency_us": 1e6,
}


@dataclass
class PlanConfig:
    """What to plan and where to write it.

    Attributes:
        world_sizes: numbers of ranks (GPUs) to plan for, 1 to :data:`MAX_WORLD_SIZE`.
        fractions: ``grad_worker_fraction`` values to plan (numbers or ``comm_opt``/``hybrid_opt``/
            ``mem_opt``); None: every fraction that splits each world size into equal groups (KAISA §3.1).
        out: folder for ``plan.json``, ``plan.png`` and ``time_to_solution.png``; None:
            ``runs/plan/<recipe>_<date>-<time>`` (``runs/`` is git-ignored).
        memory_budget_gb: per-GPU memory K-FAC may use (GiB); recommends the fastest fitting row.
        profile: time the decomposition and GEMM at the model's factor sizes on this machine's device
            (CUDA if available) and use those rates for the seconds per stage.
        profile_seconds: cap on the profiling time.
        bandwidth_gb_s: assumed per-rank network bandwidth in GB/s for the communication seconds (default:
            the profile file's, else 12.5: 100 Gb/s InfiniBand EDR, the interconnect of the papers' V100
            cluster).
        latency_us: the network's latency per ring step in µs, for the time to solution (default: the
            profile file's, else NCCL's own model of a ring step over the network, 6.6).
        profile_file: a YAML of per-stage costs and the baseline's step time measured elsewhere
            (:mod:`kfac_bench.plan.stage_profile`); the time to solution is projected from it.
        baseline: the baseline arm's recipe (default: ``<recipe>_<optimizer>``).
        dataset_size: training examples, for datasets whose size the config does not state.
        kfac_epochs, kfac_max_steps: the K-FAC arm's length, in place of its recipe's ``train.epochs`` /
            ``train.max_steps`` (each arm has its own length: ``train.epochs`` on the plan's command line
            would change both, and is refused).
        baseline_epochs, baseline_max_steps: the same for the baseline arm.
    """

    world_sizes: List[int] = field(default_factory=lambda: [8, 16, 32, 64, 128])
    fractions: List[str] | None = None
    out: str | None = None
    memory_budget_gb: float | None = None
    profile: bool = False
    profile_seconds: float = 20.0
    bandwidth_gb_s: float | None = None
    latency_us: float | None = None
    profile_file: str | None = None
    baseline: str | None = None
    dataset_size: int | None = None
    kfac_epochs: int | None = None
    kfac_max_steps: int | None = None
    baseline_epochs: int | None = None
    baseline_max_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.world_sizes:
            raise ConfigError(
                "plan.world_sizes is empty: give at least one, e.g. plan.world_sizes=[16,64]"
            )
        bad = [n for n in self.world_sizes if n < 1]
        if bad:
            raise ConfigError(f"plan.world_sizes={bad} must be >= 1")
        huge = [n for n in self.world_sizes if n > MAX_WORLD_SIZE]
        if huge:
            raise ConfigError(
                f"plan.world_sizes={huge} is more than the planner's maximum of {MAX_WORLD_SIZE} ranks "
                f"(its cost grows with the world size); plan at most {MAX_WORLD_SIZE}, "
                f"e.g. plan.world_sizes=[1024,{MAX_WORLD_SIZE}]"
            )
        for key, most in FLOAT_LIMITS.items():
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value <= most):
                raise ConfigError(f"plan.{key}={value} must be a finite number <= {most:g}")
        if self.fractions is not None and not self.fractions:
            raise ConfigError("plan.fractions is empty: leave it out to plan every valid fraction")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ConfigError(
                f"plan.memory_budget_gb={self.memory_budget_gb} must be > 0 (GiB per GPU), e.g. 2.5"
            )
        if not self.profile_seconds > 0:
            raise ConfigError(f"plan.profile_seconds={self.profile_seconds} must be > 0")
        if self.bandwidth_gb_s is not None and not self.bandwidth_gb_s > 0:
            raise ConfigError(f"plan.bandwidth_gb_s={self.bandwidth_gb_s} must be > 0")
        if self.latency_us is not None and not self.latency_us >= 0:
            raise ConfigError(f"plan.latency_us={self.latency_us} must be >= 0")
        if self.dataset_size is not None and not 1 <= self.dataset_size <= MAX_LENGTH**2:
            raise ConfigError(
                f"plan.dataset_size={self.dataset_size} must be >= 1 and <= {MAX_LENGTH**2} "
                "(training examples)"
            )
        for key in ("kfac_epochs", "kfac_max_steps", "baseline_epochs", "baseline_max_steps"):
            value = getattr(self, key)
            if value is not None and not 1 <= value <= MAX_LENGTH:
                raise ConfigError(f"plan.{key}={value} must be >= 1 and <= {MAX_LENGTH}")
        if self.profile and self.profile_file is not None:
            raise ConfigError(
                "plan.profile=true and plan.profile_file both give the stage costs: choose one "
                "(the time to solution needs plan.profile_file's baseline step)"
            )
        self.world_sizes = sorted(set(self.world_sizes))


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(``plan.*`` overrides without the prefix, every other argument)."""
    plan: list[str] = []
    rest: list[str] = []
    for arg in args:
        (plan if arg.lstrip("+").startswith(PREFIX) else rest).append(arg)
    return [a.lstrip("+")[len(PREFIX) :] for a in plan], rest


def parse_plan_config(overrides: Sequence[str]) -> PlanConfig:
    """:class:`PlanConfig` from ``key=value`` strings (``plan.`` already removed).

    Raises:
        ConfigError: one line naming an unknown key or a value of the wrong type.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"plan.{item}: give a value, plan.KEY=VALUE")
    try:
        base = OmegaConf.structured(PlanConfig)
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        values = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or getattr(err, "key", None)
        if isinstance(err, ConfigKeyError):
            valid = ", ".join(f.name for f in fields(PlanConfig))
            raise ConfigError(f"unknown key plan.{key}; valid keys: {valid}") from None
        given = next((o.partition("=")[2] for o in overrides if o.startswith(f"{key}=")), "")
        first = str(err).splitlines()[0]
        raise ConfigError(f"invalid plan.{key}={given}: {first}") from None
    assert isinstance(values, dict)
    values["fractions"] = (
        None if values["fractions"] is None else [str(f) for f in values["fractions"]]
    )
    return PlanConfig(**values)  # type: ignore[arg-type]
