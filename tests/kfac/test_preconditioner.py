"""Behaviour of KFACPreconditioner: schedules, KL clip, skipping, lifecycle and robustness."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import ComputeMethod, FactorScaling, KFACPreconditioner


def mlp(d: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
    )


def batch(seed: int, n: int = 8, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 4, (n,), generator=g)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def train(
    model: nn.Module, precond: KFACPreconditioner | None, steps: range, lr: float = 0.1
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for s in steps:
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if precond is not None:
            precond.step()
        opt.step()


def test_kl_clip_matches_hand_computation() -> None:
    model = mlp()
    twin = copy.deepcopy(model)  # before attaching: a deep copy would copy the hooks too
    kappa, lr = 1e-4, 0.5
    p = KFACPreconditioner(model, kl_clip=None, lr=lr)
    q = KFACPreconditioner(twin, kl_clip=kappa, lr=lr)
    x, y = batch(0)
    for m in (model, twin):
        F.cross_entropy(m(x), y).backward()
    raw = grads(model)
    p.step()
    q.step()
    unclipped, clipped = grads(model), grads(q.model)
    vg = sum((u * r).sum() for u, r in zip(unclipped, raw)) * lr**2
    nu = min(1.0, math.sqrt(kappa / abs(vg.item())))
    assert nu < 1.0  # the case exercises the clip
    for u, c in zip(unclipped, clipped):
        torch.testing.assert_close(c, u * nu)


def test_kl_clip_leaves_small_updates_alone() -> None:
    model = mlp()
    twin = copy.deepcopy(model)
    p = KFACPreconditioner(model, kl_clip=None, lr=1e-6)
    q = KFACPreconditioner(twin, kl_clip=1.0, lr=1e-6)
    x, y = batch(1)
    for m in (model, q.model):
        F.cross_entropy(m(x), y).backward()
    p.step()
    q.step()
    for a, b in zip(grads(model), grads(q.model)):
        torch.testing.assert_close(a, b)


def test_scheduled_intervals_take_effect_at_the_right_steps() -> None:
    model = mlp()
    factor_steps: list[int] = []
    inv_steps: list[int] = []
    # Factors every step until step 4, then every 3rd step; decompositions every 4th step.
    p = KFACPreconditioner(
        model,
        factor_update_steps=lambda s: 1 if s < 4 else 3,
        inv_update_steps=lambda s: 4,
        damping=lambda s: 0.1 if s < 4 else 0.01,
    )
    layer = p.layers["0"]
    for s in range(10):
        before_a = None if layer.a_factor is None else layer.a_factor.clone()
        before_q = None if "a" not in layer.parts else layer.parts["a"]["q"].clone()
        train(model, p, range(s, s + 1))
        if before_a is None or not torch.equal(before_a, layer.a_factor):
            factor_steps.append(s)
        if before_q is None or not torch.equal(before_q, layer.parts["a"]["q"]):
            inv_steps.append(s)
    assert factor_steps == [0, 1, 2, 3, 6, 9]
    assert inv_steps == [0, 4, 8]
    # The damping in force at the last decomposition (step 8) is 0.01: outer = 1/(λGλA + 0.01).
    lam = torch.outer(layer.parts["g"]["eigenvalues"], layer.parts["a"]["eigenvalues"])
    torch.testing.assert_close(layer.parts["outer"]["outer"], 1.0 / (lam + 0.01))


def test_skip_layers_by_name_and_by_class() -> None:
    model = cnn()
    assert set(KFACPreconditioner(model).layers) == {"0", "3", "6"}
    assert set(KFACPreconditioner(model, skip_layers=["^3$"]).layers) == {"0", "6"}
    assert set(KFACPreconditioner(model, skip_layers=["Conv2d"]).layers) == {"6"}


def test_skipped_layers_keep_their_plain_gradient() -> None:
    model = cnn()
    ref = copy.deepcopy(model)
    p = KFACPreconditioner(model, skip_layers=["Linear"])
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    for m in (model, ref):
        F.cross_entropy(m(x), y).backward()
    p.step()
    torch.testing.assert_close(model[6].weight.grad, ref[6].weight.grad)
    assert not torch.allclose(model[0].weight.grad, ref[0].weight.grad)


@pytest.mark.parametrize("include_decompositions", [True, False])
def test_state_dict_round_trip_continues_bit_identically(include_decompositions: bool) -> None:
    """Checkpoint mid-training, restore into a fresh model + preconditioner, continue: same as never stopping.

    Without saved decompositions they are recomputed from the saved factors, which equals the uninterrupted
    run when the checkpoint is taken right after a decomposition step (here: step 6 with interval 3 -> the
    decomposition of step 6 used exactly the saved factors of step 6 ... so we save after step 7 only when
    decompositions are included)."""
    torch.manual_seed(0)
    base = mlp()
    kwargs = dict(factor_update_steps=1, inv_update_steps=3, damping=0.01)
    full = copy.deepcopy(base)
    p_full = KFACPreconditioner(full, **kwargs)
    train(full, p_full, range(12))

    stop = 8 if include_decompositions else 7  # 7 steps done: the last decomposition ran at step 6
    first = copy.deepcopy(base)
    p1 = KFACPreconditioner(first, **kwargs)
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    for s in range(stop):
        x, y = batch(s)
        opt1.zero_grad()
        F.cross_entropy(first(x), y).backward()
        p1.step()
        opt1.step()
    state = {
        "model": copy.deepcopy(first.state_dict()),
        "opt": copy.deepcopy(opt1.state_dict()),
        "kfac": copy.deepcopy(p1.state_dict(include_decompositions=include_decompositions)),
    }
    resumed = mlp()
    resumed.load_state_dict(state["model"])
    p2 = KFACPreconditioner(resumed, **kwargs)
    p2.load_state_dict(state["kfac"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(state["opt"])
    for s in range(stop, 12):
        x, y = batch(s)
        opt2.zero_grad()
        F.cross_entropy(resumed(x), y).backward()
        p2.step()
        opt2.step()
    assert p2.steps == p_full.steps == 12
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_tensors_land_on_the_module_device() -> None:
    model = mlp()
    p = KFACPreconditioner(model)
    train(model, p, range(2))
    state = p.state_dict()
    state["layers"]["0"]["a_factor"] = state["layers"]["0"]["a_factor"].to(torch.float64)
    q = KFACPreconditioner(model)
    q.load_state_dict(state)
    assert q.layers["0"].a_factor.dtype == torch.float32
    assert q.layers["0"].a_factor.device == model[0].weight.device
    assert q.steps == 2


def test_remove_restores_plain_training() -> None:
    torch.manual_seed(1)
    model = mlp()
    plain = copy.deepcopy(model)
    p = KFACPreconditioner(model)
    p.remove()
    x, y = batch(3)
    for m in (model, plain):
        F.cross_entropy(m(x), y).backward()
    assert all(not layer.handles for layer in p.layers.values())
    assert all(
        layer.a_batch.total is None for layer in p.layers.values()
    )  # hooks no longer collect
    for a, b in zip(grads(model), grads(plain)):
        assert torch.equal(a, b)


def test_multihead_attention_skipped_by_rule_leaves_out_proj_out_as_used_functionally(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.out = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.out(self.attn(h, h, h)[0].mean(1))

    model = Attn()
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model, skip_layers=["MultiheadAttention"])
    # Skipped, the attention module runs its own forward: F.multi_head_attention_forward reads out_proj's
    # weight directly, so that nn.Linear is left out, not preconditioned from hooks that never fire.
    assert "attn.out_proj" not in p.layers and set(p.layers) == {"inp", "out"}
    assert p.coverage().left_out["used_functionally"] == ("attn.out_proj",)
    assert p.coverage().left_out["skipped_by_rule"] == ("attn",)
    assert any("used functionally 1 (attn.out_proj)" in r.getMessage() for r in caplog.records)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        x, y = torch.randn(4, 5, 6), torch.randint(0, 4, (4,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        p.step()
        opt.step()
    assert all(torch.isfinite(q).all() for q in model.parameters())


def test_depthwise_convolutions_are_skipped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(num_classes=10)
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model, inv_update_steps=2)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "grouped conv" in text  # the depthwise layers are named as left out
    assert all(
        layer.module.groups == 1
        for layer in p.layers.values()
        if isinstance(layer.module, nn.Conv2d)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.randint(0, 10, (2,))).backward()
        p.step()
        opt.step()
    assert all(torch.isfinite(q).all() for q in model.parameters())


def test_nonfinite_batch_is_not_folded_into_running_factors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = mlp()
    p = KFACPreconditioner(model, inv_update_steps=2)
    train(model, p, range(1))
    before = p.layers["0"].a_factor.clone()
    x, y = batch(5)
    x[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        F.cross_entropy(model(x), y).backward()
        for q in model.parameters():
            q.grad = torch.nan_to_num(q.grad)
        p.step()
        train(model, p, range(2, 3))  # a decomposition step: the warning is reported there
    for layer in p.layers.values():
        assert torch.isfinite(layer.a_factor).all() and torch.isfinite(layer.g_factor).all()
    assert torch.equal(p.layers["0"].a_factor[:0], before[:0])
    assert any("non-finite batch factor of layer '0'" in r.getMessage() for r in caplog.records)


def test_failed_decomposition_keeps_the_last_good_one(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp()
    p = KFACPreconditioner(model, inv_update_steps=1, factor_update_steps=100)
    train(model, p, range(1))
    good = p.layers["2"].parts["g"]["q"].clone()
    p.layers["2"].g_factor = torch.full_like(p.layers["2"].g_factor, float("nan"))
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        train(model, p, range(1, 2))
    assert torch.equal(p.layers["2"].parts["g"]["q"], good)
    assert any("factor G of layer '2'" in r.getMessage() for r in caplog.records)


def test_grad_scaler_is_unscaled_out_of_g() -> None:
    """With a GradScaler (the current torch.amp class) the factors equal those of an unscaled run."""
    torch.manual_seed(2)
    model = mlp()
    other = copy.deepcopy(model)
    third = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    p = KFACPreconditioner(model, grad_scaler=scaler, factor_decay=0.0)
    q = KFACPreconditioner(other, factor_decay=0.0)
    x, y = batch(4)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    p.step()
    F.cross_entropy(other(x), y).backward()
    q.step()
    for name in p.layers:
        torch.testing.assert_close(p.layers[name].g_factor, q.layers[name].g_factor)
    for a, b in zip(grads(model), grads(other)):
        torch.testing.assert_close(a, b)
    # A callable returning the scale works the same way.
    r = KFACPreconditioner(third, grad_scaler=lambda: 8.0, factor_decay=0.0)
    (F.cross_entropy(r.model(x), y) * 8.0).backward()
    for prm in r.model.parameters():
        prm.grad /= 8.0
    r.step()
    torch.testing.assert_close(r.layers["0"].g_factor, q.layers["0"].g_factor)


def test_memory_usage_reports_categories() -> None:
    model = mlp()
    p = KFACPreconditioner(model, compute_eigenvalue_outer_product=True)
    assert p.memory_usage()["total"] == 0
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    # During the backward-to-step window the batch sums are held: A (7x7, 9x9) and G (8x8, 4x4).
    assert p.memory_usage()["batch_buffers"] == 4 * (49 + 64 + 81 + 16)
    p.step()
    mem = p.memory_usage()
    # Factors: A (7x7, 9x9) and G (8x8, 4x4) in float32.
    assert mem["factors"] == 4 * (49 + 64 + 81 + 16)
    # Eigenvectors + eigenvalues of each factor, plus the two outer products (8x7 and 4x9).
    assert mem["decompositions"] == 4 * (49 + 7 + 64 + 8 + 81 + 9 + 16 + 4 + 56 + 36)
    assert mem["outer_products"] == 4 * (56 + 36)
    assert mem["buffers"] == mem["batch_buffers"] == mem["comm_buffers"] == 0
    assert mem["total"] == mem["factors"] + mem["decompositions"] + mem["buffers"]


def test_invalid_options_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="ComputeMethod"):
        KFACPreconditioner(mlp(), compute_method="cholesky")
    with pytest.raises(ValueError, match="accumulation_steps"):
        KFACPreconditioner(mlp(), accumulation_steps=0)
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        KFACPreconditioner(mlp(), grad_worker_fraction=0.0)


def test_accepts_string_options_and_unbatched_inputs() -> None:
    def preconditioned(**options: object) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(0), nn.Linear(3 * 4 * 4, 2))
        p = KFACPreconditioner(model, **options)  # type: ignore[arg-type]
        torch.manual_seed(1)
        # An unbatched (C, H, W) input; the Linear layer sees a 1-D tensor.
        model(torch.randn(2, 6, 6)).sum().backward()
        p.step()
        return [q.grad.clone() for q in model.parameters() if q.grad is not None]

    strings = preconditioned(compute_method="inverse", factor_scaling="kaisa")
    enums = preconditioned(compute_method=ComputeMethod.INVERSE, factor_scaling=FactorScaling.KAISA)
    default = preconditioned()
    # The strings select exactly the enums' behaviour, which is not the default's.
    assert all(torch.equal(a, b) for a, b in zip(strings, enums))
    assert not all(torch.allclose(a, b) for a, b in zip(strings, default))
