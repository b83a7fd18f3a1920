"""``gpu-profile.yaml``: the ResNet-50 step's stage costs as a ``kfac-bench plan`` profile
(``plan.profile_file=gpu-profile.yaml``, :mod:`kfac_bench.plan.stage_profile`), from the check's
``resnet50`` section. One device, so no network figures: the planner models the network.

Per occurrence, from the per-kind medians: the baseline step is the SGD arm's step on plain steps; the
factor computation is the K-FAC arm's forward + backward beyond the SGD arm's on factor steps, less the same
difference on plain steps (the engine times its hooks on the host only; their device cost shows here); the
decompositions, preconditioning and KL clip are the engine's own stage times on decomposition and plain
steps. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from kfac_bench.plan.stage_profile import MeasuredAt, dump_profile

__all__ = ["NAME", "profile_text"]

NAME = "gpu-profile.yaml"
#: The check's workload label -> the name a recipe's model has in the planner (``model.arch``).
MODELS = {"torchvision resnet50": "resnet50"}


def profile_text(report: dict[str, Any]) -> str | None:
    """The profile of ``report``'s ResNet-50 measurement, or None while it has no per-kind medians of every
    step kind and no workload batch (the report is rewritten as figures arrive)."""
    sec = report["sections"].get("resnet50", {})
    data = sec.get("data") or {}
    kinds, work = data.get("per_kind"), data.get("workload")
    if not kinds or not work or "batch" not in work:
        return None
    if any(kind not in kinds for kind in ("plain", "factor", "decomposition")):
        return None
    env = report["sections"].get("environment", {}).get("data", {}).get("environment", {})
    device = str(env.get("device_name") or "unknown device")
    plain, factor, dec = kinds["plain"], kinds["factor"], kinds["decomposition"]

    def hooks(kind: dict[str, Any]) -> float:
        return float(kind["kfac_forward_backward_s"] - kind["sgd_forward_backward_s"])

    when = f"make gpu-check of {report.get('started', '?')} on {device}"
    label = work.get("label", "ResNet-50")
    stages = {
        "factor": (
            max(0.0, hooks(factor) - hooks(plain)),
            f"{when}: K-FAC's forward + backward beyond SGD's on factor steps less on plain steps "
            f"(median of {factor['count']} / {plain['count']}), {label}",
        ),
        "decomposition": (
            float(dec["stages_s"]["decomposition"]),
            f"{when}: the engine's decomposition stage (median of {dec['count']} decomposition steps)",
        ),
        "precondition": (
            float(plain["stages_s"]["precondition"]),
            f"{when}: the engine's precondition stage (median of {plain['count']} plain steps)",
        ),
        "kl_clip": (
            float(plain["stages_s"]["kl_clip"]),
            f"{when}: the engine's KL-clip stage (median of {plain['count']} plain steps)",
        ),
    }
    dry = " (dry run: not a GPU measurement)" if report.get("dry_run") else ""
    return dump_profile(
        device=device + dry,
        model=MODELS.get(str(work.get("model")), str(work.get("model"))),
        precision=str(work.get("precision", "unstated")),
        measured_at=MeasuredAt(1, int(work["batch"]), 1, "lpt"),
        baseline_step_s=(
            float(plain["sgd_step_s"]),
            f"{when}: SGD step (median of {plain['count']} plain steps), {label}",
        ),
        stages_s=stages,
        header=f"kfac-bench plan profile written by {when}{dry}.\n"
        "One device: the planner models the network (plan.bandwidth_gb_s, plan.latency_us).",
    )
