"""``summary.json``: what a finished (or stopped) run reports, read by ``kfac-bench compare``; and the one
line a run prints when it ends."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kfac_bench import safe_files
from kfac_bench.metrics.environment import git_commit, run_environment
from kfac_bench.metrics.sinks import json_safe
from kfac_bench.metrics.timekeeping import TargetTracker, Throughput

if TYPE_CHECKING:
    import torch

__all__ = [
    "STATUSES",
    "SUMMARY_FILE",
    "arm_label",
    "campaign",
    "first_order",
    "label_of_arm",
    "peak_memory_bytes",
    "read_summary",
    "report_line",
    "run_summary",
    "write_summary",
]

SUMMARY_FILE = "summary.json"
#: success: target met (or none set and the run finished); target_not_reached: finished below target;
#: diverged: a non-finite loss stopped it; preempted: stopped by a signal, resumable.
STATUSES = ("success", "target_not_reached", "diverged", "preempted")


def campaign(config: dict[str, Any]) -> str | None:
    """The campaign a run belongs to (``compare`` never pools two): ``train.campaign``, which a
    ``--multirun`` sweep sets to its folder unless the command line names one."""
    given = (config.get("train") or {}).get("campaign")
    return None if given is None else str(given)


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak accelerator memory allocated by tensors (CUDA) and peak resident memory of this process."""
    import torch

    peak = {"host_max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["device_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return peak


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically (a temporary file, then rename); a non-finite number (a diverged
    run's loss or metric) is written as ``null``, so the file is strict JSON."""
    text = json.dumps(json_safe(summary), indent=2, sort_keys=True, default=str, allow_nan=False)
    return safe_files.write_atomic(Path(run_dir) / SUMMARY_FILE, text + "\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())


def run_summary(
    *,
    name: str,
    status: str,
    tracker: TargetTracker,
    steps: int,
    steps_per_epoch: int,
    samples: int,
    wall_time_s: float,
    train_time_s: float,
    throughput: Throughput,
    stage_times_s: dict[str, float],
    precond: Any,
    world_size: int,
    device: torch.device,
    config: dict[str, Any],
    divergence: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """The ``summary.json`` of a run: status, campaign (:func:`campaign`), time-to-target (wall and
    training seconds, epochs, steps), best and final metrics, throughput, K-FAC stage seconds, memory and
    coverage (which layers it preconditions, which it leaves out and why), peak memory, and the config.

    Args:
        precond: the preconditioner, or None for a first-order run.
        config: the resolved run config as plain containers.
        divergence: (step, what was non-finite) of a diverged run.
    """
    import torch

    reached = tracker.reached
    stages = stage_times_s
    kfac_share = sum(stages.values()) / train_time_s if stages and train_time_s > 0 else None
    memory = getattr(precond, "memory_usage", None)
    coverage = getattr(precond, "coverage", None)
    return {
        "name": name,
        "status": status,
        "campaign": campaign(config),
        "divergence": {"step": divergence[0], "what": divergence[1]} if divergence else None,
        "target_metric": tracker.primary,
        "targets": tracker.targets,
        "target_value": tracker.targets.get(tracker.primary),
        "higher_is_better": tracker.higher_is_better,
        "reached_target": reached is not None,
        "time_to_target_s": reached["wall_time_s"] if reached else None,
        "train_time_to_target_s": reached["train_time_s"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "best_metric": tracker.best,
        "best_metric_epoch": tracker.best_record.get("epoch"),
        "final_metrics": tracker.last.get("metrics"),
        "steps": steps,
        "epochs": steps / steps_per_epoch,
        "samples": samples,
        "wall_time_s": wall_time_s,
        "train_time_s": train_time_s,
        "mean_step_time_s": throughput.mean_step_time_s,
        "samples_per_s": throughput.samples_per_s,
        "kfac_enabled": precond is not None,
        "kfac_stage_times_s": stages,
        "kfac_time_fraction": kfac_share,
        "kfac_memory_bytes": memory() if memory is not None else None,
        "kfac_coverage": coverage().to_dict() if coverage is not None else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        "world_size": world_size,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "config": config,
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        # What it ran on: git tree state, host, GPU, driver, CUDA/NCCL and package versions.
        "environment": run_environment(device),
    }


def report_line(result: dict[str, Any], run_dir: Path) -> str:
    """The line a run prints when it ends: status, time-to-target (or why not) or a benchmark's throughput,
    run directory."""
    metric = result["target_metric"]
    bench = result.get("benchmark")
    if bench is not None:
        times = bench["step_time_s"]
        line = (
            f"benchmark: {bench['timed_steps']} steps timed after {bench['warmup_steps']} warm-up"
        )
        if times is not None:
            line += f": {bench['samples_per_s']:.1f} samples/s, step time " + ", ".join(
                f"{q} {times[q] * 1e3:.1f} ms" for q in ("p50", "p90", "p99")
            )
    elif result["reached_target"]:
        line = (
            f"time-to-target: {result['time_to_target_s']:.1f} s "
            f"({result['epochs_to_target']:.2f} epochs) for {metric} >= {result['target_value']}"
        )
    elif result["targets"]:
        line = (
            f"target {metric} {result['target_value']} not reached (best {result['best_metric']})"
        )
    else:
        line = f"no target set (best {metric} {result['best_metric']})"
    return f"kfac-bench: {result['status']} | {line} | run dir {run_dir}"


_OPTIMIZERS = {"sgd": "SGD", "adamw": "AdamW", "lamb": "LAMB"}
_STRATEGIES = {"comm_opt": "COMM-OPT", "mem_opt": "MEM-OPT", "hybrid_opt": "HYBRID-OPT"}


def _strategy(value: Any) -> str:
    text = str(value).strip().lower()
    if text in _STRATEGIES:
        return _STRATEGIES[text]
    try:
        fraction = float(text)
    except ValueError:
        return text
    return "COMM-OPT" if fraction == 1.0 else f"HYBRID-OPT {fraction:g}"


def arm_label(summary: dict[str, Any]) -> str:
    """ "SGD", "SGD + K-FAC (COMM-OPT)", "LAMB + K-FAC (HYBRID-OPT 0.5)", ... from a run's summary."""
    config = summary.get("config") or {}
    optimizer = config.get("optimizer") or {}
    kfac = config.get("kfac") or {}
    return label_of_arm(
        str(optimizer.get("name", "?")),
        bool(optimizer.get("nesterov")),
        None if first_order(summary) else kfac.get("grad_worker_fraction", "comm_opt"),
    )


def label_of_arm(optimizer: str, nesterov: bool, grad_worker_fraction: Any | None) -> str:
    """An arm's label from its optimizer and its K-FAC strategy (``grad_worker_fraction``; None: no
    K-FAC)."""
    label = _OPTIMIZERS.get(optimizer.lower(), optimizer)
    if nesterov:
        label += " (Nesterov)"
    if grad_worker_fraction is not None:
        label += f" + K-FAC ({_strategy(grad_worker_fraction)})"
    return label


def first_order(summary: dict[str, Any]) -> bool:
    enabled = summary.get("kfac_enabled")
    if enabled is None:
        enabled = ((summary.get("config") or {}).get("kfac") or {}).get("enabled", False)
    return not enabled
