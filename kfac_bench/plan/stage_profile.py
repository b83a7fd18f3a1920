"""``plan.profile_file=PATH``: per-stage costs and the baseline's step time measured elsewhere (another
cluster, a paper, ``make gpu-check`` on a GPU), as a YAML file with a source for every value.

The file (``profiles/paper_v100_resnet50.yaml`` is an example)::

    device: 64 V100 ...                  # words
    model: resnet50                      # the recipe's model (model.arch, else the builder's name)
    precision: fp32
    measured_at: {world_size: 64, batch_size: 32, grad_workers: 64, placement: round_robin}
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

A value is a number or ``{value: NUMBER, source: TEXT}``. Errors name the file and the key, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_bench.errors import ConfigError

__all__ = [
    "COMM_STAGES",
    "COMPUTE_STAGES",
    "MeasuredAt",
    "StageProfile",
    "dump_profile",
    "load_profile",
]

#: Stages the projection takes from the profile (scaled to each world size and strategy by the planner's
#: loads); the communication stages it models instead, so theirs are shown beside the model only.
COMPUTE_STAGES = ("factor", "decomposition", "precondition", "kl_clip")
COMM_STAGES = ("factor_comm", "decomposition_comm", "grad_broadcast")
PLACEMENTS = ("lpt", "round_robin")


@dataclass(frozen=True)
class MeasuredAt:
    """The configuration the profile's figures were measured in."""

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
            "sources": self.sources,
        }


def _value(
    doc: dict[str, Any], key: str, label: str, section: str, sources: dict[str, str]
) -> float | None:
    """A number at ``doc[key]`` (plain or ``{value, source}``), its source recorded under
    ``section.key``; None if absent. ``label`` names the file in errors."""
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
                f"{sorted(raw)}"
            )
        raw, source = raw["value"], raw.get("source")
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw >= 0:
        raise ConfigError(f"{label}: {name}={raw!r} must be a number >= 0")
    if source is not None:
        sources[name] = str(source)
    return float(raw)


def _int(doc: dict[str, Any], key: str, where: str, least: int = 1) -> int:
    raw = doc.get(key)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < least:
        raise ConfigError(f"{where}.{key}={raw!r} must be an integer >= {least}")
    return raw


def load_profile(path: str | Path) -> StageProfile:
    """Read and check a profile file.

    Raises:
        ConfigError: a missing or unreadable file, invalid YAML, or a missing or bad value (one line).
    """
    import yaml

    p = Path(path)
    label = f"plan.profile_file={path}"
    if not p.is_file():
        raise ConfigError(
            f"{label}: no such file; give a profile YAML (e.g. profiles/paper_v100_resnet50.yaml, or "
            "the gpu-profile.yaml that make gpu-check writes)"
        )
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{label}: not a readable YAML file ({first})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{label}: expected a mapping of keys, got {type(doc).__name__}")
    sources: dict[str, str] = {}
    at = doc.get("measured_at")
    if not isinstance(at, dict):
        raise ConfigError(
            f"{label}: measured_at (world_size, batch_size, grad_workers, placement) is missing"
        )
    placement = str(at.get("placement", "lpt"))
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"{label}: measured_at.placement={placement!r} must be one of {PLACEMENTS}"
        )
    n = _int(at, "world_size", f"{label}: measured_at")
    m = _int(at, "grad_workers", f"{label}: measured_at")
    if n % m:
        raise ConfigError(
            f"{label}: measured_at.grad_workers={m} does not divide world_size={n} (equal groups)"
        )
    measured = MeasuredAt(n, _int(at, "batch_size", f"{label}: measured_at"), m, placement)
    step = _value(doc, "baseline_step_s", label, "", sources)
    if step is None or step <= 0:
        raise ConfigError(f"{label}: baseline_step_s (seconds per baseline step, > 0) is missing")
    stages_doc = doc.get("stages_s") or {}
    if not isinstance(stages_doc, dict):
        raise ConfigError(f"{label}: stages_s must be a mapping of stage -> seconds")
    unknown = set(stages_doc) - set(COMPUTE_STAGES) - set(COMM_STAGES)
    if unknown:
        raise ConfigError(
            f"{label}: unknown stage stages_s.{sorted(unknown)[0]}; stages: "
            f"{', '.join(COMPUTE_STAGES + COMM_STAGES)}"
        )
    stages = {}
    for key in COMPUTE_STAGES + COMM_STAGES:
        v = _value(stages_doc, key, label, "stages_s", sources)
        if v is None and key in COMPUTE_STAGES:
            raise ConfigError(f"{label}: stages_s.{key} (seconds per occurrence) is missing")
        if v is not None:
            stages[key] = v
    net = doc.get("network") or {}
    if not isinstance(net, dict):
        raise ConfigError(f"{label}: network must be a mapping (bandwidth_gb_s, latency_us)")
    bw = _value(net, "bandwidth_gb_s", label, "network", sources)
    lat = _value(net, "latency_us", label, "network", sources)
    if bw is not None and bw <= 0:
        raise ConfigError(f"{label}: network.bandwidth_gb_s must be > 0")
    return StageProfile(
        path=str(path),
        device=str(doc.get("device", "unnamed device")),
        model=str(doc.get("model", "")),
        precision=str(doc.get("precision", "unstated")),
        measured_at=measured,
        baseline_step_s=step,
        stages_s=stages,
        bandwidth_bytes=None if bw is None else bw * 1e9,
        latency_s=None if lat is None else lat * 1e-6,
        sources=sources,
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
