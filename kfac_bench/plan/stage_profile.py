"""``plan.profile_file=PATH``: per-stage costs and the baseline's step time measured elsewhere (another
cluster, a paper, ``make gpu-check`` on a GPU), as a YAML file with a source for every value.

The file (``profiles/paper_v100_resnet50.yaml`` is an example)::

    device: 64 V100 ...                  # words
    model: resnet50                      # the recipe's model (model.arch, else the builder's name)
    precision: fp32
    measured_at: {world_size: 64, batch_size: 32, grad_workers: 64, placement: round_robin}
                                         # batch_size: examples per rank per optimizer step (all
                                         # micro-batches of a step together)
    baseline_step_s: {value: 0.1899, source: ...}   # one step of the baseline, gradient allreduce included
    stages_s:                            # K-FAC's stages, seconds per occurrence (factor step, ...)
      factor: {value: 0.092, source: ...}
      decomposition: {value: 1.341, source: ...}
      precondition: {value: 0.020, source: ...}
      kl_clip: {value: 0.005, source: ...}
      factor_comm: {value: 0.095, source: ...}        # optional: shown beside the network model
      decomposition_comm: {value: 0.243, source: ...} # optional, the same
    network:
      bandwidth_gb_s: {value: 12.5, source: ...}
      latency_us: {value: 6.6, source: ...}
    uncertainty: {value: 0.05, source: ...}  # optional: relative uncertainty of the values above
    cluster: cluster_v100_longhorn.yaml      # optional: how steps grow with N there (:mod:`.cluster`)

A value is a number or ``{value: NUMBER, source: TEXT}``, finite and within :data:`LIMITS`; the words
(``device``, ``model``, ``precision``, ``placement``) are strings. ``model`` is the name users give the model
(``resnet152``, ``bert_large``, ``maskrcnn``: :func:`~kfac_bench.plan.time_to_solution.model_name`). The file
is read by :func:`~kfac_bench.plan.safe_yaml.load_yaml` (bounded, ``2e-2`` is a number). Errors name the
file and the key, in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_bench.errors import ConfigError

from .cluster import Cluster, load_cluster
from .config import MAX_WORLD_SIZE
from .safe_yaml import load_yaml

__all__ = [
    "COMM_STAGES",
    "COMPUTE_STAGES",
    "LIMITS",
    "MeasuredAt",
    "StageProfile",
    "dump_profile",
    "load_profile",
    "number",
    "words",
]

#: Stages the projection takes from the profile (scaled to each world size and strategy by the planner's
#: loads); the communication stages it models instead, so theirs are shown beside the model only.
COMPUTE_STAGES = ("factor", "decomposition", "precondition", "kl_clip")
COMM_STAGES = ("factor_comm", "decomposition_comm", "grad_broadcast")
PLACEMENTS = ("lpt", "round_robin")
#: Upper bounds of a profile's numbers (a day per stage, a cluster's fastest links, ...): a value past them
#: is a typo or a hostile file, and some (world sizes) size the planner's own work.
LIMITS = {
    "seconds": 86_400.0,
    "bandwidth_gb_s": 1e5,
    "latency_us": 1e6,
    "batch_size": 10_000_000,
    "relative": 1.0,
}
#: Longest text accepted where a profile gives words.
MAX_WORDS = 500


@dataclass(frozen=True)
class MeasuredAt:
    """The configuration the profile's figures were measured in; ``batch_size`` is the examples each rank
    processes per optimizer step (every micro-batch of the step), not the micro-batch."""

    world_size: int
    batch_size: int
    grad_workers: int
    placement: str


@dataclass(frozen=True)
class StageProfile:
    """A loaded profile: figures in seconds (bandwidth in bytes/s, latency in s), each with its source."""

    path: str
    device: str
    model: str
    precision: str
    measured_at: MeasuredAt
    baseline_step_s: float
    stages_s: dict[str, float]
    bandwidth_bytes: float | None
    latency_s: float | None
    sources: dict[str, str] = field(default_factory=dict)
    uncertainty: float | None = None
    cluster: Cluster | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "device": self.device,
            "model": self.model,
            "precision": self.precision,
            "measured_at": vars(self.measured_at),
            "baseline_step_s": self.baseline_step_s,
            "stages_s": self.stages_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes,
            "latency_s": self.latency_s,
            "uncertainty": self.uncertainty,
            "cluster": None if self.cluster is None else self.cluster.to_dict(),
            "sources": self.sources,
        }


def number(
    doc: dict[str, Any],
    key: str,
    label: str,
    section: str,
    sources: dict[str, str],
    limit: float = LIMITS["seconds"],
) -> float | None:
    """A finite number in [0, ``limit``] at ``doc[key]`` (plain or ``{value, source}``), its source recorded
    under ``section.key``; None if absent. ``label`` names the file in errors."""
    name = f"{section}.{key}" if section else key
    raw = doc.get(key)
    if raw is None:
        return None
    source = None
    if isinstance(raw, dict):
        unknown = set(raw) - {"value", "source"}
        if unknown or "value" not in raw:
            raise ConfigError(
                f"{label}: {name} must be a number or {{value: NUMBER, source: TEXT}}, got keys "
                f"{sorted(map(str, raw))}"
            )
        raw, source = raw["value"], raw.get("source")
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"{label}: {name}.source must be text")
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ConfigError(f"{label}: {name}={_short(raw)} must be a number")
    if not math.isfinite(raw) or not 0 <= raw <= limit:
        raise ConfigError(f"{label}: {name}={raw!r} must be a finite number >= 0 and <= {limit:g}")
    if source is not None:
        sources[name] = source
    return float(raw)


def _short(raw: Any) -> str:
    text = repr(raw) if not isinstance(raw, (dict, list)) else type(raw).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def words(doc: dict[str, Any], key: str, label: str, default: str) -> str:
    """The text at ``doc[key]`` (``default`` if absent): a string of at most :data:`MAX_WORDS` characters."""
    raw = doc.get(key, default)
    if not isinstance(raw, str):
        raise ConfigError(f"{label}: {key} must be text, got {type(raw).__name__}")
    if len(raw) > MAX_WORDS:
        raise ConfigError(f"{label}: {key} is longer than {MAX_WORDS} characters")
    return raw


def _int(doc: dict[str, Any], key: str, where: str, least: int = 1, most: int = 1 << 62) -> int:
    raw = doc.get(key)
    if isinstance(raw, bool) or not isinstance(raw, int) or not least <= raw <= most:
        raise ConfigError(
            f"{where}.{key}={_short(raw)} must be an integer >= {least} and <= {most}"
        )
    return raw


def load_profile(path: str | Path) -> StageProfile:
    """Read and check a profile file.

    Raises:
        ConfigError: a missing or unreadable file, invalid YAML, or a missing or bad value (one line).
    """
    p = Path(path)
    label = f"plan.profile_file={path}"
    if not p.is_file():
        raise ConfigError(
            f"{label}: no such file; give a profile YAML (e.g. profiles/paper_v100_resnet50.yaml, or "
            "the gpu-profile.yaml that make gpu-check writes)"
        )
    doc = load_yaml(p, label)
    if not isinstance(doc, dict):
        raise ConfigError(f"{label}: expected a mapping of keys, got {type(doc).__name__}")
    sources: dict[str, str] = {}
    at = doc.get("measured_at")
    if not isinstance(at, dict):
        raise ConfigError(
            f"{label}: measured_at (world_size, batch_size, grad_workers, placement) is missing"
        )
    placement = words(at, "placement", f"{label}: measured_at", "lpt")
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"{label}: measured_at.placement={placement!r} must be one of {PLACEMENTS}"
        )
    where = f"{label}: measured_at"
    n = _int(at, "world_size", where, most=MAX_WORLD_SIZE)
    m = _int(at, "grad_workers", where, most=MAX_WORLD_SIZE)
    if n % m:
        raise ConfigError(
            f"{label}: measured_at.grad_workers={m} does not divide world_size={n} (equal groups)"
        )
    batch = _int(at, "batch_size", where, most=int(LIMITS["batch_size"]))
    measured = MeasuredAt(n, batch, m, placement)
    step = number(doc, "baseline_step_s", label, "", sources)
    if step is None or step <= 0:
        raise ConfigError(f"{label}: baseline_step_s (seconds per baseline step, > 0) is missing")
    stages_doc = doc.get("stages_s") or {}
    if not isinstance(stages_doc, dict):
        raise ConfigError(f"{label}: stages_s must be a mapping of stage -> seconds")
    unknown = set(map(str, stages_doc)) - set(COMPUTE_STAGES) - set(COMM_STAGES)
    if unknown:
        raise ConfigError(
            f"{label}: unknown stage stages_s.{sorted(unknown)[0]}; stages: "
            f"{', '.join(COMPUTE_STAGES + COMM_STAGES)}"
        )
    stages = {}
    for key in COMPUTE_STAGES + COMM_STAGES:
        v = number(stages_doc, key, label, "stages_s", sources)
        if v is None and key in COMPUTE_STAGES:
            raise ConfigError(f"{label}: stages_s.{key} (seconds per occurrence) is missing")
        if v is not None:
            stages[key] = v
    net = doc.get("network") or {}
    if not isinstance(net, dict):
        raise ConfigError(f"{label}: network must be a mapping (bandwidth_gb_s, latency_us)")
    bw = number(net, "bandwidth_gb_s", label, "network", sources, LIMITS["bandwidth_gb_s"])
    lat = number(net, "latency_us", label, "network", sources, LIMITS["latency_us"])
    if bw is not None and bw <= 0:
        raise ConfigError(f"{label}: network.bandwidth_gb_s must be > 0")
    unc = number(doc, "uncertainty", label, "", sources, LIMITS["relative"])
    cluster = None
    if doc.get("cluster") is not None:
        name = words(doc, "cluster", label, "")
        cluster = load_cluster(p.parent / name, f"{label}: cluster={name}")
    known = {"device", "model", "precision", "measured_at", "baseline_step_s", "stages_s"}
    known |= {"network", "uncertainty", "cluster"}
    extra = sorted(set(map(str, doc)) - known)
    if extra:
        raise ConfigError(f"{label}: unknown key {extra[0]}; keys: {', '.join(sorted(known))}")
    return StageProfile(
        path=str(path),
        device=words(doc, "device", label, "unnamed device"),
        model=words(doc, "model", label, ""),
        precision=words(doc, "precision", label, "unstated"),
        measured_at=measured,
        baseline_step_s=step,
        stages_s=stages,
        bandwidth_bytes=None if bw is None else bw * 1e9,
        latency_s=None if lat is None else lat * 1e-6,
        sources=sources,
        uncertainty=unc,
        cluster=cluster,
    )


def dump_profile(
    *,
    device: str,
    model: str,
    precision: str,
    measured_at: MeasuredAt,
    baseline_step_s: tuple[float, str],
    stages_s: dict[str, tuple[float, str]],
    header: str = "",
) -> str:
    """A profile file's text (the values with their sources), as :func:`load_profile` reads it."""
    import yaml

    doc = {
        "device": device,
        "model": model,
        "precision": precision,
        "measured_at": vars(measured_at),
        "baseline_step_s": {"value": baseline_step_s[0], "source": baseline_step_s[1]},
        "stages_s": {k: {"value": v, "source": s} for k, (v, s) in stages_s.items()},
    }
    lines = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return lines + yaml.safe_dump(doc, sort_keys=False, width=110)
