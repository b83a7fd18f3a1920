"""A cluster's growth with N (:mod:`.cluster`) from one reference model measured at several world sizes.

Given the reference model's profile (one world size) and its measured minutes per world size for the
baseline and for K-FAC (COMM-OPT), the planner's own projection without growth is set against them:

* ``baseline_growth_s[N]`` = measured baseline step at N − the planner's baseline step at N (compute and
  ring allreduce), less the same at the profile's world size (so it is 0 there);
* ``kfac_growth[N]`` = the measured K-FAC step at N less the measured baseline step and the planner's
  K-FAC update stages (factor and decomposition work and traffic, amortised over the intervals at N): what is
  left is K-FAC's every-step work at N, as a ratio to the same at the profile's world size.

TPDS Fig. 8's ResNet-50 bars give ``profiles/cluster_v100_longhorn.yaml`` this way
(``tests/plan/test_paper_scaling.py`` recomputes it).
"""

from __future__ import annotations

from typing import Any

from .cluster import VARIANTS
from .length import RunLength
from .recipe import PlannedModel
from .stage_profile import StageProfile
from .time_to_solution import EVERY_STEP, Network, _amortised, _Model

__all__ = ["cluster_growth"]


def cluster_growth(
    planned: PlannedModel,
    profile: StageProfile,
    network: Network,
    kfac_arm: RunLength,
    baseline: RunLength,
    measured_minutes: dict[int, tuple[float, float]],
) -> dict[str, Any]:
    """``{"baseline_growth_s": {N: s}, "kfac_growth": {N: ratio}}`` from ``measured_minutes`` (N → (baseline,
    K-FAC COMM-OPT) minutes); ``profile`` is the reference model's, without a cluster."""
    model = _Model(planned, profile, network, VARIANTS[0])
    at = profile.measured_at.world_size
    if at not in measured_minutes:
        raise ValueError(f"the measurements must include the profile's world size {at}")
    base_growth: dict[int, float] = {}
    every: dict[int, float] = {}
    for n, (base_min, kfac_min) in sorted(measured_minutes.items()):
        base_steps, _, _ = baseline.steps(n)
        kfac_steps, _, _ = kfac_arm.steps(n)
        assert base_steps is not None and kfac_steps is not None
        base_step = 60 * base_min / base_steps
        kfac_step = 60 * kfac_min / kfac_steps
        modelled = sum(model.base(n, baseline).values())
        base_growth[n] = base_step - modelled
        stages, intervals = model.kfac(n, n, kfac_arm)
        per = _amortised(stages, intervals)
        updates = sum(v for k, v in per.items() if k not in EVERY_STEP)
        every[n] = kfac_step - base_step - updates
    return {
        "baseline_growth_s": {n: v - base_growth[at] for n, v in base_growth.items()},
        "kfac_growth": {n: v / every[at] for n, v in every.items()},
        "every_step_s": every,
    }
