"""The time-to-solution table as text: a line per world size, minutes and band per arm, each arm's length."""

from __future__ import annotations

from typing import Any

from .time_to_solution import STRATEGIES

__all__ = ["arm_length", "render_time_to_solution"]

WIDTH = 27


def _cell(e: dict[str, Any] | None, baseline: str) -> str:
    if e is None or e["minutes"] is None:
        return f"{'—':>{WIDTH}}"
    text = f"{e['minutes']:.0f} ({e['minutes_low']:.0f}–{e['minutes_high']:.0f})"
    if e["arm"] != baseline and e["less_time_than_baseline"] is not None:
        text += f" {-100 * e['less_time_than_baseline']:+.0f}%"
    return f"{text:>{WIDTH}}"


def arm_length(arm: dict[str, Any]) -> str:
    """An arm's length in words: its epochs, and its step budget if it has one."""
    text = f"{arm['epochs']} epochs"
    if arm.get("max_steps") is not None:
        text += f" or {arm['max_steps']} steps, whichever ends first"
    return text


def render_time_to_solution(plan: dict[str, Any]) -> str:
    """The time-to-solution table: a line per world size, minutes per arm with their band (and the change
    against the baseline), the arms' lengths, the profile and the rows left out with their reasons."""
    entries = plan.get("time_to_solution") or []
    info = plan.get("time_to_solution_model") or {}
    if not entries:
        return f"time to solution: not projected ({info.get('reason', 'no profile')})\n"
    base, kf = info["baseline"], info["kfac"]
    prof, net, band = info["profile"], info["network"], info["band"]
    arms = [base["optimizer"], *STRATEGIES]
    lines = [
        f"time to solution of {info['model']} (minutes, band low–high; change vs {base['optimizer']}): "
        f"{base['optimizer']} = {base['recipe']}, {arm_length(base)}; K-FAC = {kf['recipe']} "
        f"({kf['optimizer']} + K-FAC, {info['placement']} placement, factors by "
        f"{info['factor_reduction']}), {arm_length(kf)}",
        f"  profile {prof['path']}: {prof['device']}, baseline step {1e3 * prof['baseline_step_s']:.1f} ms "
        f"at {prof['measured_at']['world_size']} GPUs, {prof['measured_at']['batch_size']} examples per rank "
        f"per step; network {net['source']}",
        f"  band: the cluster's readings for this model, ±{100 * band['relative_uncertainty']:.1f} % "
        f"({band['source']})",
        f"  {'GPUs':>5} {'global batch':>12} {'steps':>13} {'intervals':>9} | "
        + " | ".join(f"{a:>{WIDTH}}" for a in arms),
    ]
    for n in sorted({e["world_size"] for e in entries}):
        here = {e["arm"]: e for e in entries if e["world_size"] == n}
        k = here.get("comm_opt") or {}
        iv = k.get("intervals")
        ivs = "—" if not iv else f"{iv[0]}/{iv[1]}"
        b = here.get(base["optimizer"]) or {}
        gb = b.get("global_batch")
        steps = f"{b.get('steps') or '—'}/{k.get('steps') or '—'}"
        lines.append(
            f"  {n:>5} {gb if gb is not None else '—':>12} {steps:>13} {ivs:>9} | "
            + " | ".join(_cell(here.get(a), base["optimizer"]) for a in arms)
        )
    lines.append(
        f"  steps: {base['optimizer']}/K-FAC; intervals: factor/decomposition steps of K-FAC"
    )
    if prof["precision"] not in ("unstated", info.get("recipe_precision", prof["precision"])):
        lines.append(
            f"  note: the profile was measured in {prof['precision']}, the recipe trains in "
            f"{info['recipe_precision']}; its step and stage times are taken as they are"
        )
    missing: dict[str, list[str]] = {}
    for e in entries:
        if e["minutes"] is None and e["reason"]:
            missing.setdefault(e["reason"], []).append(f"{e['arm']} at {e['world_size']}")
    lines += [f"  not projected ({', '.join(w)}): {r}" for r, w in missing.items()]
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
