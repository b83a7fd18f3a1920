"""``factor_batch_fraction``: exact at 1, the drawn examples' factors below 1, the same on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.kfac.options import FactorScaling
from kfac_bench.kfac.subsample import ExampleSubset

from ..distributed import run_distributed
from .test_distributed import make_model  # the same small conv + linear net in float64

D = torch.float64


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=D), torch.randint(0, 5, (n,), generator=g)


def run(steps: int, **kfac: Any) -> tuple[list[list[torch.Tensor]], KFACPreconditioner]:
    """SGD + K-FAC for ``steps`` steps; the gradients after each ``step()`` and the preconditioner."""
    model = make_model()
    precond = KFACPreconditioner(model, damping=0.01, lr=0.1, **kfac)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, precond


def test_fraction_one_is_the_exact_path_bit_for_bit() -> None:
    default, _ = run(4, inv_update_steps=2)
    one, _ = run(4, inv_update_steps=2, factor_batch_fraction=1.0)
    for a, b in zip(default, one):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def factors(p: KFACPreconditioner) -> dict[str, torch.Tensor]:
    return {f"{n}/{k}": getattr(s, f"{k}_factor") for n, s in p.layers.items() for k in "ag"}


@pytest.mark.parametrize("scaling", ["per_example", "kaisa"])
def test_factors_are_those_of_the_drawn_examples(scaling: str) -> None:
    """With factor_decay=0 the running factors are the batch factors: those of the k drawn examples (for
    'kaisa', whose G carries autograd's 1/N of the loss mean, G of the full batch's loss)."""
    n, fraction = 8, 0.5
    kw = dict(factor_decay=0.0, kl_clip=None, factor_scaling=scaling)
    model = make_model()
    sub = KFACPreconditioner(model, factor_batch_fraction=fraction, **kw)
    x, y = batch(0, n)
    F.cross_entropy(model(x), y).backward()
    sub.step()

    drawn = ExampleSubset(fraction, FactorScaling.parse(scaling), lambda: 0).rows(x, 0, True)
    assert drawn is not None and drawn.numel() == 4 and drawn.unique().numel() == 4
    model2 = make_model()
    exact = KFACPreconditioner(model2, **kw)
    F.cross_entropy(model2(x[drawn]), y[drawn]).backward()
    exact.step()
    # 'kaisa': the sub-batch's own loss mean gives each gradient 1/k instead of 1/N
    g_ratio = (drawn.numel() / n) ** 2 if scaling == "kaisa" else 1.0
    got, want = factors(sub), factors(exact)
    for key in got:
        scale = g_ratio if key.endswith("/g") else 1.0
        torch.testing.assert_close(got[key], want[key] * scale, rtol=1e-10, atol=1e-12, msg=key)


def test_draws_differ_by_step_and_micro_batch_and_repeat_on_resume() -> None:
    x = torch.zeros(16, 3)
    step = [0]
    s = ExampleSubset(0.25, FactorScaling.PER_EXAMPLE, lambda: step[0])
    first = s.rows(x, 0, False)
    assert first is not None and first.numel() == 4
    assert torch.equal(s.rows(x, 0, False), first)  # every layer of the micro-batch: the same draw
    other_micro = s.rows(x, 1, False)
    step[0] = 1
    next_step = s.rows(x, 0, False)
    assert not (torch.equal(first, other_micro) and torch.equal(first, next_step))
    step[0] = 0  # a fresh object at the same step (a resumed run) draws the same examples
    fresh = ExampleSubset(0.25, FactorScaling.PER_EXAMPLE, lambda: 0)
    assert torch.equal(fresh.rows(x, 0, False), first)
    assert s.rows(torch.zeros(3), 0, False) is None  # 1-D: one example
    assert s.rows(torch.zeros(3, 8, 8), 0, True) is None  # an unbatched image
    assert s.rows(torch.zeros(2, 3), 0, False) is not None  # round(0.25 * 2) -> at least one row
    assert ExampleSubset(0.9, FactorScaling.KAISA, lambda: 0).rows(x[:4], 0, False) is None


#: The two opt-in factor subsets: examples of each micro-batch, rows of a convolution's output positions.
SUBSETS = [{"factor_batch_fraction": 0.5}, {"factor_position_fraction": 0.5}]


@pytest.mark.parametrize("subset", SUBSETS, ids=str)
def test_resume_continues_identically(subset: dict[str, float]) -> None:
    kw: dict[str, Any] = dict(inv_update_steps=2, **subset)
    full, _ = run(5, **kw)
    _, first = run(3, **kw)
    state = first.state_dict(include_decompositions=True)
    model = make_model()
    p = KFACPreconditioner(model, damping=0.01, lr=0.1, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(first.model.state_dict())  # weights after 3 steps (plain SGD: no state)
    p.load_state_dict(state)
    for s in (3, 4):
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        p.step()
        assert all(torch.equal(a, b.grad) for a, b in zip(full[s], model.parameters()))
        opt.step()


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_fraction_outside_zero_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="factor_batch_fraction"):
        KFACPreconditioner(make_model(), factor_batch_fraction=fraction)


def distributed_worker(rank: int, world: int, subset: dict[str, float]) -> dict[str, Any]:
    model = make_model()
    p = KFACPreconditioner(model, damping=0.01, lr=0.1, factor_decay=0.0, kl_clip=None, **subset)
    x, y = batch(0, 8 * world)
    sl = slice(rank * 8, (rank + 1) * 8)
    F.cross_entropy(model(x[sl]), y[sl]).backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
        q.grad /= world
    p.step()
    return {"factors": factors(p), "grads": [q.grad.clone() for q in model.parameters()]}


@pytest.mark.distributed
@pytest.mark.parametrize("subset", SUBSETS, ids=str)
def test_ranks_agree_and_average_their_drawn_subsets(subset: dict[str, float]) -> None:
    """Examples (``factor_batch_fraction``) or output positions (``factor_position_fraction``)."""
    world = 2
    results = run_distributed(distributed_worker, world, subset, timeout=240)
    for key, value in results[0]["factors"].items():
        assert torch.equal(value, results[1]["factors"][key]), key
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        assert torch.equal(a, b)
    # the reduced factor is the mean of each rank's factor of its own drawn subset
    x, y = batch(0, 8 * world)
    local = []
    for rank in range(world):
        model = make_model()
        p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, **subset)
        sl = slice(rank * 8, (rank + 1) * 8)
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        p.step()
        local.append(factors(p))
    for key, value in results[0]["factors"].items():
        torch.testing.assert_close(value, (local[0][key] + local[1][key]) / 2, msg=key)
