"""The preconditioner's checkpoint restores onto another number of ranks and another layer assignment:
state saved by 2 ranks (MEM-OPT, factors kept by their owners only) and restored on 1 or 4 ranks (other
strategies) gathers back to exactly the saved state, and training continues from it (gloo on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kfac_bench.kfac import KFACPreconditioner

from ..distributed import run_distributed
from .test_distributed import kfac_kwargs, make_model, train

pytestmark = pytest.mark.distributed


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    return {prefix: state}


def _save_worker(rank: int, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model = make_model()
    p = KFACPreconditioner(
        model,
        **kfac_kwargs(
            inv_update_steps=3, grad_worker_fraction="mem_opt", factor_reduction="reduce"
        ),
    )
    train(model, p, world, rank, range(4), sync_grads=True)  # decompositions of step 3 are current
    return p.state_dict(include_decompositions=True), model.state_dict()


def _load_worker(
    rank: int,
    world: int,
    state: dict[str, Any],
    model_state: dict[str, torch.Tensor],
    fraction: str,
    reduction: str,
) -> float:
    model = make_model()
    model.load_state_dict(model_state)
    p = KFACPreconditioner(
        model,
        **kfac_kwargs(
            inv_update_steps=3, grad_worker_fraction=fraction, factor_reduction=reduction
        ),
    )
    p.load_state_dict(state)
    again = _flat(p.state_dict(include_decompositions=True))
    saved = _flat(state)
    assert again.keys() == saved.keys()
    diff = 0.0
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            diff = max(diff, (again[key] - value).abs().max().item())
        else:
            assert again[key] == value, key
    grads = train(model, p, world, rank, range(4, 6), sync_grads=True)
    assert all(torch.isfinite(g).all() for step in grads for g in step)
    return diff


@pytest.mark.parametrize(
    ("world", "fraction", "reduction"),
    [(1, "comm_opt", "allreduce"), (4, "hybrid_opt", "reduce")],
)
def test_state_saved_on_2_ranks_restores_onto_another_world_and_assignment(
    world: int, fraction: str, reduction: str
) -> None:
    state, model_state = run_distributed(_save_worker, 2)[0]
    diffs = run_distributed(_load_worker, world, state, model_state, fraction, reduction)
    assert diffs == [0.0] * world
