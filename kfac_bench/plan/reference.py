"""KAISA Table 5 side by side: the memory the reference code holds per GPU, and what this engine holds.

KAISA §5.5 Table 5 measures the K-FAC memory overhead per GPU at 64 V100s for the smallest (1/64) and largest
(1) ``grad_worker_fraction``. The *reference layout* is what the KAISA code keeps per rank
(gpauloski/kfac-pytorch, branch ``hybrid-opt``: ``kfac/layers/base.py`` and ``kfac/kfac.py``):

* both running factors of every layer on every rank (all-reduced in place), in the precision of the
  forward/backward data: FP16 under AMP ("KFAC will store the factors in that precision", the ``grad_scaler``
  docstring of ``KFAC``), FP32 otherwise;
* on each gradient worker of a layer: the eigenvectors ``QA``, ``QG`` and the precomputed eigenvalue outer
  product ``dGdA`` (``precompute_outer_eigen=True``), in ``inv_dtype`` = FP32; the rank that decomposes the
  layer also keeps the eigenvalues ``dA``, ``dG``;
* on every rank, the preconditioned gradient of every layer, FP32 (``self.preconditioned_gradient``: computed
  by the gradient workers, a receive buffer on the others, kept between steps).

Its layer set is the reference code's: the Mask R-CNN fork skipped the box head's fc6/fc7
(``MASKRCNN_SKIP_LAYERS``, which the recipes follow too), and gpauloski/BERT-PyTorch's
``run_pretraining.py`` skipped only ``BertLMPredictionHead`` and the embeddings (a skipped module's
children too), so the pooler and the NSP classifier were preconditioned. Placement is LPT with factors
colocated (the outer product requires it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kfac_bench.kfac import LayerSpec, scan_model
from kfac_bench.kfac.assignment import assign
from kfac_bench.kfac.options import FactorReduction, Placement
from kfac_bench.kfac.second_order import EigenMethod
from kfac_bench.models.maskrcnn import MASKRCNN_SKIP_LAYERS

from .costs import Scenario, rank_loads
from .recipe import PlannedModel

__all__ = ["TABLE5", "TABLE5_WORLD", "Table5Row", "reference_memory", "table5_comparison"]

MIB = 2**20
TABLE5_WORLD = 64


@dataclass(frozen=True)
class Table5Row:
    """A row of KAISA Table 5: per-GPU memory in MB with SGD, and with K-FAC at the smallest and largest
    gradient-worker fraction, on 64 V100s."""

    model: str
    precision: str
    sgd: int
    kfac_min: int
    kfac_max: int

    @property
    def overhead(self) -> tuple[int, int]:
        return self.kfac_min - self.sgd, self.kfac_max - self.sgd

    @property
    def ratio(self) -> float:
        low, high = self.overhead
        return high / low


TABLE5: dict[str, Table5Row] = {
    "resnet18": Table5Row("ResNet-18", "FP32", 2454, 2838, 3260),
    "resnet50": Table5Row("ResNet-50", "FP32", 4762, 5396, 6608),
    "resnet101": Table5Row("ResNet-101", "FP32", 6313, 7463, 8755),
    "resnet152": Table5Row("ResNet-152", "FP32", 6620, 8204, 9092),
    "maskrcnn": Table5Row("Mask R-CNN", "FP32", 6553, 6650, 6743),
    "bert_large": Table5Row("BERT-Large", "FP16", 8254, 9555, 12038),
}

#: The reference code's skip rules where they differ from the recipe's (module docstring).
REFERENCE_SKIP: dict[str, tuple[str, ...]] = {
    "maskrcnn": MASKRCNN_SKIP_LAYERS,
    "bert_large": (r"embeddings", r"(^|\.)cls\.predictions\."),
}


def table5_key(planned: PlannedModel) -> str | None:
    """The Table 5 row of a recipe's model, or None."""
    target, args = planned.model_target, planned.model_args
    if target.endswith("build_torchvision_resnet"):
        arch = str(args.get("arch", "")).lower()
        return arch if arch in TABLE5 else None
    if target.endswith("build_maskrcnn"):
        return "maskrcnn"
    if target.endswith("build_bert") and args.get("preset") == "large":
        return "bert_large"
    return None


def reference_memory(
    layers: list[LayerSpec], world_size: int, grad_workers: int, factor_dtype: torch.dtype
) -> dict[str, int]:
    """Bytes the reference code holds on its fullest rank, by category (module docstring)."""
    cost = EigenMethod(torch.float32).decomposition_cost  # the reference code's method
    work = assign(layers, world_size, grad_workers / world_size, cost, placement=Placement.LPT)
    f_size = torch.empty((), dtype=factor_dtype).element_size()
    fp32 = 4
    every = {
        "factors": f_size * sum(s.a_dim**2 + s.g_dim**2 for s in layers),
        "preconditioned_gradients": fp32 * sum(s.g_dim * s.a_dim for s in layers),
    }
    decomp = [0] * world_size
    outer = [0] * world_size
    for w in work.values():
        for r in w.grad_workers:
            decomp[r] += fp32 * (w.a_dim**2 + w.g_dim**2 + w.g_dim * w.a_dim)
            outer[r] += fp32 * w.g_dim * w.a_dim
        decomp[w.a_owner] += fp32 * (w.a_dim + w.g_dim)  # dA, dG on the decomposing rank
    top = max(range(world_size), key=lambda r: decomp[r])
    out = dict(every, decompositions=decomp[top], outer_products=outer[top])
    out["total"] = out["factors"] + out["decompositions"] + out["preconditioned_gradients"]
    return out


def _ours(planned: PlannedModel, grad_workers: int) -> dict[str, int]:
    """This engine on its fullest rank (LPT, all-reduce): the state kept between steps and the peak."""
    loads = rank_loads(
        planned.layers,
        planned.settings,
        Scenario(TABLE5_WORLD, grad_workers, Placement.LPT, FactorReduction.ALLREDUCE),
        planned.accumulation(TABLE5_WORLD),
    )
    total = loads.total_memory()
    top = max(range(TABLE5_WORLD), key=lambda r: total[r])
    m = {k: v[top] for k, v in loads.memory.items()}
    m["state"] = m["factors"] + m["decompositions"]
    m["total"] = total[top]
    return m


def table5_comparison(planned: PlannedModel) -> dict[str, Any] | None:
    """The paper's Table 5 row, the reference layout and this engine, at fractions 1/64 and 1 (bytes)."""
    key = table5_key(planned)
    if key is None:
        return None
    paper = TABLE5[key]
    ref_layers = (
        scan_model(planned.model, REFERENCE_SKIP[key]).layers
        if key in REFERENCE_SKIP
        else planned.layers
    )
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}
    ref_dtype = low.get(planned.precision, torch.float32)
    rows: list[dict[str, Any]] = []
    for m in (1, TABLE5_WORLD):
        rows.append(
            {
                "grad_worker_fraction": m / TABLE5_WORLD,
                "paper_overhead_mb": paper.overhead[0 if m == 1 else 1],
                "reference": reference_memory(ref_layers, TABLE5_WORLD, m, ref_dtype),
                "ours": _ours(planned, m),
            }
        )
    return {
        "model": paper.model,
        "world_size": TABLE5_WORLD,
        "paper": {
            "precision": paper.precision,
            "sgd_mb": paper.sgd,
            "overhead_mb": list(paper.overhead),
            "ratio": paper.ratio,
        },
        "reference_layers": len(ref_layers),
        "reference_factor_dtype": str(ref_dtype).removeprefix("torch."),
        "rows": rows,
        "ratio": {
            "paper": paper.ratio,
            "reference": rows[1]["reference"]["total"] / rows[0]["reference"]["total"],
            "ours_state": rows[1]["ours"]["state"] / rows[0]["ours"]["state"],
            "ours_peak": rows[1]["ours"]["total"] / rows[0]["ours"]["total"],
        },
    }


def render_table5(cmp: dict[str, Any]) -> str:
    """The comparison as text lines (MB = 2^20 bytes)."""
    lines = [
        f"KAISA Table 5, {cmp['model']} at {cmp['world_size']} GPUs: K-FAC memory per GPU, MB "
        f"(reference layout: {cmp['reference_layers']} layers, factors in "
        f"{cmp['reference_factor_dtype']}; ours: this engine, fullest rank)",
        f"  {'fraction':>8} {'paper':>7} {'reference':>10} {'= factors':>10} {'+ decomp':>9} "
        f"{'+ pgrads':>9} {'ours state':>11} {'ours peak':>10}",
    ]
    for row in cmp["rows"]:
        ref, ours = row["reference"], row["ours"]
        frac = "1" if row["grad_worker_fraction"] == 1 else f"1/{cmp['world_size']}"
        lines.append(
            f"  {frac:>8} {'+' + str(row['paper_overhead_mb']):>7} {ref['total'] / MIB:>10.0f} "
            f"{ref['factors'] / MIB:>10.0f} {ref['decompositions'] / MIB:>9.0f} "
            f"{ref['preconditioned_gradients'] / MIB:>9.0f} {ours['state'] / MIB:>11.0f} "
            f"{ours['total'] / MIB:>10.0f}"
        )
    r = cmp["ratio"]
    lines.append(
        f"  max/min: paper {r['paper']:.2f}x, reference {r['reference']:.2f}x, ours {r['ours_state']:.2f}x "
        f"(state) / {r['ours_peak']:.2f}x (peak)"
    )
    return "\n".join(lines)
