"""What happens to a model after the preconditioner was built is followed or reported with its true reason:
pruning, replaced and Lazy modules, a dtype change, a submodule in eval() mode, a gradient penalty, and a
weight also read outside its module's call (a tied autoencoder). Plain gradients are compared against a
twin model without K-FAC (float64)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

D = torch.float64


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)
    ).to(D)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, dtype=D, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train_step(model: nn.Module, p: KFACPreconditioner) -> None:
    x, y = _batch()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    p.step()


def _plain_grad(model: nn.Module, name: str) -> torch.Tensor:
    """``name``'s gradient in a copy of ``model`` without K-FAC (hooks of a copy feed nothing)."""
    twin = copy.deepcopy(model)
    x, y = _batch()
    F.cross_entropy(twin(x), y).backward()
    return dict(twin.named_parameters())[name].grad


def test_pruning_after_construction_is_detected_reported_and_leaves_the_plain_gradient(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _mlp()
    p = KFACPreconditioner(model, kl_clip=None)
    _train_step(model, p)
    prune.l1_unstructured(model[2], "weight", amount=0.5)
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        for _ in range(3):
            _train_step(model, p)
    warnings = [r.getMessage() for r in caplog.records if "left out now" in r.getMessage()]
    assert len(warnings) == 1 and "'2'" in warnings[0] and "torch.nn.utils.prune" in warnings[0]
    cov = p.coverage()
    assert cov.left_out == {"computed_weight": ("2",)} and cov.layers == 2
    assert "2" not in p.layers
    got = model[2].weight_orig.grad.clone()
    p.remove()  # the plain gradient of the same model and batch
    x, y = _batch()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(got, model[2].weight_orig.grad, rtol=0, atol=0)


def test_old_api_spectral_norm_has_a_reason_not_frozen() -> None:
    model = _mlp()
    nn.utils.spectral_norm(model[4])
    cov = KFACPreconditioner(model).coverage()
    assert cov.left_out == {"computed_weight": ("4",)}
    assert "spectral_norm" in str(KFACPreconditioner(model).layer_set.scan.details["4"])


def test_a_replaced_module_is_registered_under_its_name_and_preconditioned() -> None:
    model = _mlp()
    p = KFACPreconditioner(model, kl_clip=None)
    _train_step(model, p)
    old = model[4]
    model[4] = nn.Linear(4, 3).to(D)
    for _ in range(2):
        _train_step(model, p)
    assert p.layers["4"].module is model[4] and p.layers["4"].module is not old
    assert p.layers["4"].ready and p.coverage().left_out == {}
    # Preconditioned: its gradient is no longer the plain one.
    assert (model[4].weight.grad - _plain_grad(model, "4.weight")).abs().max() > 1e-6


def test_lazy_modules_are_reported_then_registered_after_their_first_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.LazyLinear(3)).to(D)
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model, kl_clip=None)
    cov = p.coverage()
    assert cov.layers == 0 and cov.below_threshold
    assert cov.left_out == {"lazy_uninitialised": ("0", "2")}
    assert any("Lazy modules" in r.getMessage() for r in caplog.records)
    for _ in range(3):
        _train_step(model, p)
    assert sorted(p.layers) == ["0", "2"] and all(s.ready for s in p.layers.values())
    assert p.coverage().left_out == {} and not p.coverage().below_threshold


def test_a_dtype_change_after_construction_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp().float()
    p = KFACPreconditioner(model, kl_clip=None)
    model.double()
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        for _ in range(2):
            _train_step(model, p)
    warned = [r.getMessage() for r in caplog.records if "factor_dtype" in r.getMessage()]
    assert len(warned) == 1 and "float64" in warned[0] and "torch.float32" in warned[0]
    assert all(s.ready for s in p.layers.values())


def test_explicit_factor_dtypes_are_no_dtype_change(caplog: pytest.LogCaptureFixture) -> None:
    """float64 factors asked for on a float32 model: a structural change (a replaced module) is no dtype
    change, and converting the model to the factors' dtype neither."""
    model = _mlp().float()
    p = KFACPreconditioner(model, kl_clip=None, factor_dtype=torch.float64)

    def step() -> None:
        x, y = _batch()
        model.zero_grad()
        F.cross_entropy(model(x.to(model[0].weight.dtype)), y).backward()
        p.step()

    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        step()
        model[2] = nn.Linear(model[2].in_features, model[2].out_features)
        step()
        model.double()
        step()
    assert not [r for r in caplog.records if "factor_dtype" in r.getMessage()]
    assert all(s.ready for s in p.layers.values())


def test_a_submodule_in_eval_mode_is_reported_as_such_not_as_used_functionally() -> None:
    model = _mlp()
    p = KFACPreconditioner(model, kl_clip=None)
    model.train()
    model[2].eval()
    _train_step(model, p)
    assert p.coverage().left_out == {"eval_mode": ("2",)}
    torch.testing.assert_close(model[2].weight.grad, _plain_grad(model, "2.weight"), rtol=0, atol=0)


def test_a_gradient_penalty_names_itself_and_its_workarounds() -> None:
    model = _mlp()
    p = KFACPreconditioner(model)
    x, y = _batch()
    x = x.requires_grad_()
    loss = F.cross_entropy(model(x), y)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"gradient penalty.*eval\(\).*factor_update_steps"):
        (loss + gx.pow(2).sum()).backward()
    del p


class TiedAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.enc = nn.Linear(6, 3, dtype=D)
        self.mid = nn.Linear(3, 3, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.enc(x))))
        return F.linear(h, self.enc.weight.t())  # the decoder reads the encoder's weight


def test_a_weight_also_read_outside_its_module_call_is_left_out_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TiedAutoencoder()
    p = KFACPreconditioner(model, kl_clip=None)
    x = torch.randn(10, 6, dtype=D, generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        for _ in range(3):
            model.zero_grad()
            F.mse_loss(model(x), x).backward()
            p.step()
    assert p.coverage().left_out == {"read_outside_call": ("enc",)}
    assert sum("outside its module's call" in r.getMessage() for r in caplog.records) == 1
    twin = copy.deepcopy(model)
    F.mse_loss(twin(x), x).backward()
    torch.testing.assert_close(model.enc.weight.grad, twin.enc.weight.grad, rtol=0, atol=0)
    assert (model.mid.weight.grad - twin.mid.weight.grad).abs().max() > 1e-8  # preconditioned


def test_a_layer_called_twice_is_not_taken_for_a_weight_read_outside_its_call() -> None:
    model = _mlp()
    p = KFACPreconditioner(model, kl_clip=None)
    x, y = _batch()
    F.cross_entropy(model(x) + model(x.flip(0)), y).backward()  # two calls of every layer (siamese)
    p.step()
    assert p.coverage().left_out == {}


def test_stage_times_says_when_it_is_not_tracking(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    quiet, timed = KFACPreconditioner(model), KFACPreconditioner(_mlp(), track_stage_times=True)
    _train_step(model, quiet)
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        assert quiet.stage_times() == {} and quiet.stage_times() == {}
    assert sum("not tracking" in r.getMessage() for r in caplog.records) == 1
    _train_step(timed.model, timed)
    assert timed.stage_times()["decomposition"] > 0


def test_a_decomposition_step_expected_to_be_long_is_announced_first(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kfac_bench.kfac import curvature

    model = _mlp()
    p = KFACPreconditioner(model)
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        _train_step(model, p)  # tiny factors: expected to take microseconds, not announced
        monkeypatch.setattr(curvature, "LONG_DECOMPOSITION_S", 0.0)
        for _ in range(2):
            _train_step(model, p)
    lines = [r.getMessage() for r in caplog.records if "expected to take" in r.getMessage()]
    assert len(lines) == 1 and "decomposing 6 factors" in lines[0] and "largest 7²" in lines[0]
