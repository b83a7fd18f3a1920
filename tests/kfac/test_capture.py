"""The patterns real training code has: eval-mode forwards, several forwards per micro-batch, a layer called
k times per forward, frozen biases, tied weights, failed decompositions, layers that do not run, resuming.

Each check compares with dense float64 math on captured tensors, a single-process run, or a copy of the
model trained without K-FAC, never with the engine's own output.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

from ..distributed import run_distributed
from .reference import eigen_dense, kfac_factors

D = torch.float64


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(D)


def data(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=D), torch.randint(0, 4, (n,), generator=g)


def factors(p: KFACPreconditioner) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (s.a_factor.clone(), s.g_factor.clone()) for n, s in p.layers.items()}


# ---------------------------------------------------------------------------------------- eval mode
def test_eval_mode_forwards_touch_neither_factors_nor_counters() -> None:
    runs = []
    for extra_eval in (False, True):
        model = mlp()
        p = KFACPreconditioner(model, factor_decay=0.5, kl_clip=None, accumulation_steps=2)
        for step in range(3):
            for micro in range(2):
                x, y = data(10 * step + micro)
                (F.cross_entropy(model(x), y) / 2).backward()
                if extra_eval:  # validation inside the loop, gradients enabled, even backpropagated
                    model.eval()
                    F.cross_entropy(model(data(99)[0]), data(99)[1]).backward()
                    model.train()
            assert p.capture.backwards == 2  # the eval backward passes are not micro-batches
            p.step()
            model.zero_grad()
        runs.append(factors(p))
    for name in runs[0]:
        for a, b in zip(runs[0][name], runs[1][name]):
            assert torch.equal(a, b)


# ----------------------------------------------------------------- several forwards per micro-batch
LOCAL, STEPS = 4, 3


def two_view_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    n = LOCAL * 2 * world  # 2 micro-batches per rank
    x = torch.randn(n, 6, generator=g, dtype=D)
    return (
        x,
        x + 0.1 * torch.randn(n, 6, generator=g, dtype=D),
        torch.randint(0, 4, (n,), generator=g),
    )


def two_view_loss(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(model(x1), y) + F.cross_entropy(model(x2), y)


def two_view_worker(rank: int, world: int) -> list[list[torch.Tensor]]:
    import torch.distributed as dist

    model = mlp()
    p = KFACPreconditioner(
        model,
        accumulation_steps=2,
        grad_worker_fraction="mem_opt",
        inv_update_steps=2,
        damping=0.01,
    )
    out = []
    for step in range(STEPS):
        x1, x2, y = two_view_batch(step, world)
        for micro in range(2):
            sl = slice((2 * rank + micro) * LOCAL, (2 * rank + micro + 1) * LOCAL)
            (two_view_loss(model, x1[sl], x2[sl], y[sl]) / 2).backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        p.step()
        out.append([q.grad.clone() for q in model.parameters()])
        model.zero_grad()
    return out


@pytest.mark.distributed
def test_two_forwards_per_micro_batch_on_two_ranks_equal_one_process() -> None:
    world = 2
    results = run_distributed(two_view_worker, world)
    model = mlp()
    p = KFACPreconditioner(model, inv_update_steps=2, damping=0.01)
    for step in range(STEPS):
        x1, x2, y = two_view_batch(step, world)
        two_view_loss(model, x1, x2, y).backward()
        p.step()
        want = [q.grad.clone() for q in model.parameters()]
        model.zero_grad()
        for res in results:
            for got, w in zip(res[step], want):
                torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- a layer called k times
class Shared(nn.Module):
    """One Linear applied to k time steps (weight sharing across positions), then a fixed read-out."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.cell = nn.Linear(6, 5, dtype=D)
        self.head_w = nn.Parameter(torch.randn(4, 5, dtype=D))
        self.outputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, k, 6)
        self.outputs = [self.cell(x[:, t]) for t in range(self.k)]
        for o in self.outputs:
            o.retain_grad()
        return F.linear(torch.stack(self.outputs, 1).tanh().mean(1), self.head_w)


@pytest.mark.parametrize("scaling", ["per_example", "kaisa"])
def test_a_layer_called_k_times_is_k_position_sets_of_the_same_examples(scaling: str) -> None:
    k, n = 3, 8
    torch.manual_seed(1)
    model = Shared(k)
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, factor_scaling=scaling)
    x, y = torch.randn(n, k, 6, dtype=D), torch.randint(0, 4, (n,))
    F.cross_entropy(model(x), y).backward()
    p.step()
    # The dense definition: the k calls are the k positions of each example (kfac_bench/kfac/factors.py).
    delta = torch.stack([o.grad for o in model.outputs], 1) * n  # (N, k, 5) per-example gradients
    a_ref, g_ref = kfac_factors(model.cell, x, delta, scaling)
    torch.testing.assert_close(p.layers["cell"].a_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(p.layers["cell"].g_factor, g_ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------- frozen bias
def test_frozen_bias_is_left_out_of_the_block_and_keeps_no_grad() -> None:
    model = mlp()
    model[2].bias.requires_grad_(False)
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=0.01)
    assert p.layers["2"].a_dim == 8  # no bias column
    x, y = data(3)
    F.cross_entropy(model(x), y).backward()
    raw = model[2].weight.grad.clone()
    p.step()
    assert model[2].bias.grad is None
    got = model[2].weight.grad.clone()
    h = torch.tanh(model[0](x)).detach()
    out = model[2](h)
    out.retain_grad()
    F.cross_entropy(out, y).backward()
    a_ref = h.t() @ h / len(x)  # A without the column of ones
    g_ref = out.grad.t() @ out.grad * len(x)
    torch.testing.assert_close(p.layers["2"].a_factor, a_ref)
    torch.testing.assert_close(p.layers["2"].g_factor, g_ref)
    torch.testing.assert_close(got, eigen_dense(a_ref, g_ref, raw, 0.01))


# --------------------------------------------------------------------- tied weights (Linear/Conv)
def test_tied_linear_layers_are_left_out_with_one_line_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))
    model[2].weight = model[0].weight
    plain = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model)
    tied_lines = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert len([m for m in tied_lines if "hold the same parameter" in m]) == 1
    assert "'0'" in tied_lines[0] and "'2'" in tied_lines[0]
    assert set(p.layers) == {"4"} and set(p.coverage().left_out["tied"]) == {"0", "2"}
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    for m in (model, plain):
        F.cross_entropy(m(x), y).backward()
    p.step()
    for name in ("0", "2"):  # the summed gradient of the shared weight is left as it is
        assert torch.equal(
            model.get_submodule(name).weight.grad, plain.get_submodule(name).weight.grad
        )


# -------------------------------------------------------------- first decomposition fails in float64
def _failing_eigh(dim: int):  # type: ignore[no-untyped-def]
    real = torch.linalg.eigh

    def fake(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if f.shape[-1] == dim:
            raise torch.linalg.LinAlgError("injected: did not converge")
        return real(f)

    return fake


def test_first_decomposition_failing_leaves_the_gradient_plain_and_recovers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = mlp()
    plain = copy.deepcopy(model)
    p = KFACPreconditioner(model, inv_update_steps=2, kl_clip=None)
    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh(9))  # layer '2': A is 9×9, in any dtype
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        for step in range(2):
            x, y = data(step)
            for m in (model, plain):
                m.zero_grad()
                F.cross_entropy(m(x), y).backward()
            p.step()
            assert torch.equal(model[2].weight.grad, plain[2].weight.grad)  # plain, not an error
            assert not torch.equal(model[0].weight.grad, plain[0].weight.grad)
    failed = [r.getMessage() for r in caplog.records if "failed even in float64" in r.getMessage()]
    assert len(failed) == 1 and "'2'" in failed[0] and "plain" in failed[0]
    assert p.coverage().left_out["decomposition_failed"] == ("2",)
    monkeypatch.undo()
    x, y = data(2)
    F.cross_entropy(model(x), y).backward()
    p.step()  # the next decomposition step succeeds: preconditioned from now on
    assert p.layers["2"].ready and "decomposition_failed" not in p.coverage().left_out


def owner_failure_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    model = mlp()
    p = KFACPreconditioner(model, grad_worker_fraction="mem_opt", kl_clip=0.01, lr=0.1)
    owner = p.layers["2"].work.a_owner
    if rank == owner:
        torch.linalg.eigh = _failing_eigh(9)  # a forked process of its own: nothing to restore
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = data(step, n=4 * world)
        sl = slice(rank * 4, (rank + 1) * 4)
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        plain = model[2].weight.grad.clone()
        p.step()
        assert torch.equal(model[2].weight.grad, plain)  # not preconditioned, not KL-scaled
        opt.step()
    return {"params": [q.detach() for q in model.parameters()], "ready": p.layers["2"].ready}


@pytest.mark.distributed
def test_a_failure_on_the_owner_is_agreed_by_every_rank() -> None:
    results = run_distributed(owner_failure_worker, 2)
    assert not results[0]["ready"] and not results[1]["ready"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(
            a, b
        )  # the same decision (plain gradient, KL clip without it) on both ranks


# ------------------------------------------------------------------------ layers that did not run
class Branchy(nn.Module):
    """``extra`` runs only when asked (a conditional branch, LayerDrop); ``unused`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8, dtype=D)
        self.extra = nn.Linear(8, 8, dtype=D)
        self.unused = nn.Linear(8, 8, dtype=D)
        self.out = nn.Linear(8, 4, dtype=D)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.use_extra:
            h = torch.tanh(self.extra(h))
        return self.out(h)


def test_layers_that_did_not_run_are_checked_again_later(caplog: pytest.LogCaptureFixture) -> None:
    model = Branchy()
    p = KFACPreconditioner(model, inv_update_steps=2)
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        for step in range(5):
            model.use_extra = step >= 1  # runs from step 1; its first decomposition step is 2
            x, y = data(step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            p.step()
            assert p.layers["extra"].ready == (step >= 2)
    assert not p.layers["unused"].ready
    assert p.coverage().left_out["did_not_run"] == ("unused",)
    messages = [r.getMessage() for r in caplog.records if "has not run" in r.getMessage()]
    assert len([m for m in messages if "'unused'" in m]) == 1  # logged once, not every step
    assert any("'extra'" in m for m in messages)


def test_step_before_any_backward_is_a_clear_error() -> None:
    model = mlp()
    p = KFACPreconditioner(model)
    with pytest.raises(RuntimeError, match="before any backward pass"):
        p.step()
    model.eval()  # a forward in eval mode is not a training micro-batch either
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="before any backward pass"):
        p.step()


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.layer = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.unused = nn.Linear(8, 8)  # registered, never runs
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(self.inp(x)).mean(1))


def _train(
    model: nn.Module, p: KFACPreconditioner, opt: torch.optim.Optimizer, steps: range
) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 5, 6, generator=g), torch.randint(0, 4, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        p.step()
        opt.step()


@pytest.mark.parametrize(("include_decompositions", "stop"), [(True, 5), (False, 4)])
def test_state_dict_round_trip_with_excluded_layers_resumes_bit_identically(
    include_decompositions: bool, stop: int
) -> None:
    """Without saved decompositions they are recomputed from the saved factors: equal to the uninterrupted
    run when the checkpoint follows a decomposition step (interval 3: steps 0 and 3 -> stop after 4)."""
    kwargs: dict[str, Any] = dict(inv_update_steps=3, damping=0.01)
    full = Encoder()
    p_full = KFACPreconditioner(full, **kwargs)
    _train(full, p_full, torch.optim.SGD(full.parameters(), lr=0.1, momentum=0.9), range(8))

    first = Encoder()
    p1 = KFACPreconditioner(first, **kwargs)
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    _train(first, p1, opt1, range(stop))
    assert p1.layers["layer.self_attn.out_proj"].ready and p1.layers["layer.self_attn.q_proj"].ready
    assert not p1.layers["unused"].ready
    state = copy.deepcopy(
        {
            "model": first.state_dict(),
            "opt": opt1.state_dict(),
            "kfac": p1.state_dict(include_decompositions),
        }
    )
    resumed = Encoder()
    resumed.load_state_dict(state["model"])
    p2 = KFACPreconditioner(resumed, **kwargs)
    p2.load_state_dict(state["kfac"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(state["opt"])
    _train(resumed, p2, opt2, range(stop, 8))
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
