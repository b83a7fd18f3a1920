"""Checkpoint gathering: the preconditioner's state as one dict that every rank holds in full, and back.

``gather_state`` is collective under torch.distributed (every rank calls it, in the same order): factors kept
only by their owner (``factor_reduction='reduce'``) and decompositions held only inside a layer's block are
broadcast from where they live, so a checkpoint is complete whichever strategy wrote it and can be restored
on any rank. Tensors keep their memory layout (strides), so that a resumed run multiplies with the same
layouts, and therefore rounds the same way, as the run that was never interrupted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .options import FactorReduction
from .schedules import is_due, resolve
from .second_order import Result
from .state import LayerState

if TYPE_CHECKING:
    from .preconditioner import KFACPreconditioner

#: Constant hyperparameters saved with the state (callables are code: the resumed run supplies them).
HYPERPARAMETERS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)


def gather_state(p: KFACPreconditioner, include_decompositions: bool) -> dict[str, Any]:
    """See :meth:`KFACPreconditioner.state_dict`."""
    hyper = {k: getattr(p, k) for k in HYPERPARAMETERS if not callable(getattr(p, k))}
    layers: dict[str, dict[str, Any]] = {}
    for name, layer in p.layers.items():
        work = layer.work
        assert work is not None
        entry: dict[str, Any] = {
            "a_factor": _gather_factor(p, layer.a_factor, work.a_owner, work.a_dim),
            "g_factor": _gather_factor(p, layer.g_factor, work.g_owner, work.g_dim),
        }
        if include_decompositions:
            # Only ready layers have parts (every rank agrees which): the others resume not ready.
            entry["decompositions"] = _gather_parts(p, layer) if layer.ready else None
            entry["not_ready_reason"] = layer.not_ready_reason
        layers[name] = entry
    return {"steps": p.steps, "hyperparameters": hyper, "layers": layers}


def _gather_factor(
    p: KFACPreconditioner, t: torch.Tensor | None, owner: int, dim: int
) -> torch.Tensor | None:
    if not p.comm.distributed or p.factor_reduction is FactorReduction.ALLREDUCE:
        return None if t is None else t.clone()
    # Whether the owner has the factor yet is host state shared by all ranks (same step count).
    dev = p.comm.device  # NCCL sends CUDA tensors only
    has = torch.tensor([t is not None], dtype=torch.int32, device=dev)
    p.comm.broadcast_from(has, owner)
    if not has.item():
        return None
    buf = (
        t.to(dev, copy=True)
        if t is not None
        else torch.empty(dim, dim, dtype=p.factor_dtype, device=dev)
    )
    return p.comm.broadcast_from(buf, owner).cpu()


def _gather_parts(p: KFACPreconditioner, layer: LayerState) -> dict[str, Result | None]:
    """The layer's second-order parts, from its first gradient worker to every rank, layouts included."""
    names = ("a", "g", *p.method.derived)
    if not p.comm.distributed:
        return {
            k: None
            if layer.parts.get(k) is None
            else {n: v.clone() for n, v in layer.parts[k].items()}
            for k in names
        }
    work = layer.work
    assert work is not None
    src = work.grad_workers[0]
    dev = p.comm.device  # NCCL sends CUDA tensors only
    templates = {
        k: layer.parts.get(k)
        or p.method.empty(k, work.a_dim, work.g_dim, dev, layer.handler.spatial)
        for k in names
    }
    flat = [(k, n, v) for k in names for n, v in sorted(templates[k].items())]
    # Strides of every tensor, padded to two entries (1-D eigenvalues), from the source in one message.
    strides = torch.tensor([list(v.stride()) + [0] * (2 - v.dim()) for _, _, v in flat], device=dev)
    p.comm.broadcast_from(strides, src)
    out: dict[str, Result | None] = {k: {} for k in names}
    for (k, n, v), stride in zip(flat, strides.tolist()):
        data = p.comm.broadcast_from(
            v.detach().to(dev).clone(memory_format=torch.contiguous_format), src
        ).cpu()
        kept = torch.empty_strided(data.shape, stride[: data.dim()], dtype=data.dtype)
        result = out[k]
        assert result is not None
        result[n] = kept.copy_(data)
    return out


def restore_state(p: KFACPreconditioner, state: dict[str, Any]) -> None:
    """See :meth:`KFACPreconditioner.load_state_dict`."""
    saved = state["layers"]
    if set(saved) != set(p.layers):
        missing, extra = sorted(set(p.layers) - set(saved)), sorted(set(saved) - set(p.layers))
        raise ValueError(
            f"K-FAC state does not match this model's K-FAC layers (same model, skip_layers and layer "
            f"types?): missing {missing}, unexpected {extra}"
        )
    p.steps = int(state["steps"])
    for k, v in state.get("hyperparameters", {}).items():
        if not callable(getattr(p, k)):
            setattr(p, k, v)
    keep_all = p.factor_reduction is FactorReduction.ALLREDUCE
    with_parts = False
    for name, layer in p.layers.items():
        entry = saved[name]
        work = layer.work
        assert work is not None
        dev = layer.device
        for kind, owner in (("a", work.a_owner), ("g", work.g_owner)):
            t = entry.get(f"{kind}_factor")
            keep = t is not None and (keep_all or owner == p.comm.rank)
            setattr(layer, f"{kind}_factor", t.to(dev, p.factor_dtype) if keep else None)
        layer.parts, layer.ready, layer.not_ready_reason = {}, False, None
        if "decompositions" in entry:
            with_parts = True
            parts = entry["decompositions"]
            layer.ready = parts is not None
            layer.not_ready_reason = entry.get("not_ready_reason")
            if parts is not None and p.comm.rank in work.grad_workers:
                layer.parts = {k: {n: v.to(dev) for n, v in r.items()} for k, r in parts.items()}
    p.capture.ever = p.capture.ever or p.steps > 0
    p.capture.start_step(is_due(p.factor_update_steps, p.steps))
    if p.steps > 0 and not with_parts:
        p.curvature.update_second_order(resolve(p.damping, p.steps))
