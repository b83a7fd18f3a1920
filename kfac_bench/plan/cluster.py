"""How a cluster's steps grow with the number of GPUs beyond the ring model: one description of the hardware
and software stack, shared by every model profiled on it.

A profile measures one model at one world size. What happens at other world sizes on the same cluster is not
a property of the model: Horovod's coordination, stragglers and the network's behaviour at 64 nodes are the
cluster's. A cluster file (``profiles/cluster_v100_longhorn.yaml``) states them once, read off the runs of
one reference model at several world sizes, each with its source::

    device: TACC Longhorn ...
    reference: {model: resnet50, world_size: 64, gradient_bytes: 102228128, every_step_s: 0.025}
    baseline_growth_s: {value: {16: -0.040, 32: -0.030, 64: 0.0, 128: 0.027, 256: 0.112}, source: ...}
    kfac_growth: {value: {16: 1.2, 32: 1.3, 64: 1.0, 128: 1.1, 256: 2.0}, source: ...}
    spread: {value: 0.05, source: ...}

* ``baseline_growth_s``: seconds a baseline step takes at N beyond the planner's ring model, against the
  reference world size (the reference model's measured step less the model's compute and ring allreduce);
* ``kfac_growth``: how K-FAC's every-step work (preconditioning, gradient scaling) grows at N, as a
  ratio to the reference world size (the reference's every-step work at N over that there);
* ``spread``: the relative spread of repeated measurements of one configuration on that cluster.

Another model takes the baseline's growth *as it is*, in seconds, and K-FAC's split in two (the central
projection, :meth:`Cluster.every_step_factor`): a synchronous step waits for the slowest of N ranks, and
that wait, in proportion to the work each rank does between two waits, can only grow with N; so the part
of the reference's ratio that rises with N (:func:`rising_part`: the nearest non-decreasing sequence
through 1 at the reference world size) stretches the model's every-step work, and what it leaves (on
Longhorn: ResNet-50's every-step work at 16 and 32 GPUs above that at 64) is added as the reference's
seconds, the same for every model. The band takes the alternative readings
(:data:`VARIANTS`): the baseline's growth in proportion to its gradient bytes, K-FAC's all as a ratio or
all as the reference's seconds. Between listed world sizes the growth is interpolated linearly in log2 N;
outside them it stays at the nearest listed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_bench.errors import ConfigError

from .config import MAX_WORLD_SIZE
from .safe_yaml import load_yaml

__all__ = [
    "KFAC_READINGS",
    "VARIANTS",
    "Cluster",
    "Variant",
    "interpolate",
    "load_cluster",
    "rising_part",
]


#: Readings of K-FAC's every-step growth for another model: ``split`` (central) stretches the work by the
#: part of the reference's growth that rises with N and adds the rest as the reference's seconds; ``ratio``
#: stretches by all of it; ``seconds`` adds all of it.
KFAC_READINGS = ("split", "ratio", "seconds")


@dataclass(frozen=True)
class Variant:
    """One reading of the cluster's growth for another model: the baseline's growth scaled by gradient
    bytes (else as it is), K-FAC's by one of :data:`KFAC_READINGS`."""

    baseline_per_byte: bool = False
    kfac: str = "split"


#: The central reading first, then the alternatives that make the band.
VARIANTS = tuple(Variant(per_byte, kfac) for per_byte in (False, True) for kfac in KFAC_READINGS)


def _non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing sequence nearest ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def rising_part(table: dict[int, float], at: int) -> dict[int, float]:
    """The part of a growth ratio ``table`` (1 at ``at``) that rises with N: the nearest non-decreasing
    sequence through 1 at ``at`` (each side's least-squares fit, clipped there)."""
    keys = sorted(table)
    below = [k for k in keys if k < at]
    above = [k for k in keys if k > at]
    out = {at: 1.0}
    out |= {k: min(1.0, v) for k, v in zip(below, _non_decreasing([table[k] for k in below]))}
    out |= {k: max(1.0, v) for k, v in zip(above, _non_decreasing([table[k] for k in above]))}
    return out


def interpolate(table: dict[int, float], n: int) -> float:
    """``table`` at ``n``: linear in log2 N between listed world sizes, the nearest one outside them."""
    keys = sorted(table)
    if n <= keys[0]:
        return table[keys[0]]
    if n >= keys[-1]:
        return table[keys[-1]]
    hi = next(k for k in keys if k >= n)
    lo = max(k for k in keys if k <= n)
    if hi == lo:
        return table[lo]
    t = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + t * (table[hi] - table[lo])


@dataclass(frozen=True)
class Cluster:
    """A loaded cluster file (module docstring)."""

    path: str
    device: str
    reference_model: str
    reference_world_size: int
    reference_gradient_bytes: float
    reference_every_step_s: float
    baseline_growth_s: dict[int, float]
    kfac_growth: dict[int, float]
    spread: float
    sources: dict[str, str] = field(default_factory=dict)

    def baseline_extra(self, n: int, at: int, gradient_bytes: float, variant: Variant) -> float:
        """Seconds a baseline step gains at ``n`` GPUs over ``at`` (the profile's world size)."""
        extra = interpolate(self.baseline_growth_s, n) - interpolate(self.baseline_growth_s, at)
        return extra * (
            gradient_bytes / self.reference_gradient_bytes if variant.baseline_per_byte else 1
        )

    def every_step_factor(self, n: int, at: int, variant: Variant, every_step_s: float) -> float:
        """How K-FAC's every-step work, ``every_step_s`` in all at ``at`` GPUs (the profile's), stretches at
        ``n`` GPUs, by ``variant.kfac``: ``ratio``, the cluster's ratio; ``seconds``, the reference's
        seconds added in proportion; ``split`` (central), the ratio's rising part
        (:func:`rising_part`) as a ratio and the rest as the reference's seconds."""
        ratio = interpolate(self.kfac_growth, n) / interpolate(self.kfac_growth, at)
        if variant.kfac == "ratio" or every_step_s <= 0:
            return ratio
        rising = 1.0
        if variant.kfac == "split":
            table = rising_part(self.kfac_growth, self.reference_world_size)
            rising = interpolate(table, n) / interpolate(table, at)
        seconds = (ratio - rising) * self.reference_every_step_s
        return max(0.0, rising + seconds / every_step_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "device": self.device,
            "reference": {
                "model": self.reference_model,
                "world_size": self.reference_world_size,
                "gradient_bytes": self.reference_gradient_bytes,
                "every_step_s": self.reference_every_step_s,
            },
            "baseline_growth_s": self.baseline_growth_s,
            "kfac_growth": self.kfac_growth,
            "spread": self.spread,
            "sources": self.sources,
        }


def _table(doc: dict[str, Any], key: str, label: str, lo: float, hi: float) -> tuple[dict, str]:
    raw = doc.get(key)
    if not isinstance(raw, dict) or not isinstance(raw.get("value"), dict):
        raise ConfigError(
            f"{label}: {key} must be {{value: {{WORLD_SIZE: NUMBER, ...}}, source: TEXT}}"
        )
    source = raw.get("source")
    if not isinstance(source, str):
        raise ConfigError(f"{label}: {key}.source must be text")
    out: dict[int, float] = {}
    for n, v in raw["value"].items():
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORLD_SIZE:
            raise ConfigError(
                f"{label}: {key}: world size {n!r} must be an integer 1..{MAX_WORLD_SIZE}"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{label}: {key}[{n}]={v!r} must be a finite number")
        if not lo <= v <= hi:
            raise ConfigError(f"{label}: {key}[{n}]={v!r} must be within [{lo:g}, {hi:g}]")
        out[n] = float(v)
    if not out:
        raise ConfigError(f"{label}: {key} lists no world size")
    return out, source


def load_cluster(path: Path, label: str) -> Cluster:
    """Read and check a cluster file (``label`` names it in errors).

    Raises:
        ConfigError: a missing or bad file or value (one line).
    """
    from .stage_profile import LIMITS, number, words

    if not path.is_file():
        raise ConfigError(f"{label}: no such file (looked for {path})")
    doc = load_yaml(path, label)
    if not isinstance(doc, dict):
        raise ConfigError(f"{label}: expected a mapping of keys, got {type(doc).__name__}")
    ref = doc.get("reference")
    if not isinstance(ref, dict):
        raise ConfigError(
            f"{label}: reference (model, world_size, gradient_bytes, every_step_s) is missing"
        )
    sources: dict[str, str] = {}
    world = ref.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD_SIZE:
        raise ConfigError(f"{label}: reference.world_size must be an integer 1..{MAX_WORLD_SIZE}")
    grad = number(ref, "gradient_bytes", label, "reference", sources, 1e13)
    every = number(ref, "every_step_s", label, "reference", sources)
    if not grad or every is None:
        raise ConfigError(f"{label}: reference.gradient_bytes (> 0) and every_step_s are needed")
    day = LIMITS["seconds"]
    growth, sources["baseline_growth_s"] = _table(doc, "baseline_growth_s", label, -day, day)
    kfac, sources["kfac_growth"] = _table(doc, "kfac_growth", label, 1e-3, 1e3)
    spread = number(doc, "spread", label, "", sources, LIMITS["relative"])
    return Cluster(
        path=str(path),
        device=words(doc, "device", label, "unnamed cluster"),
        reference_model=words(ref, "model", f"{label}: reference", ""),
        reference_world_size=world,
        reference_gradient_bytes=grad,
        reference_every_step_s=every,
        baseline_growth_s=growth,
        kfac_growth=kfac,
        spread=spread or 0.0,
        sources=sources,
    )
