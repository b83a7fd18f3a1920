"""Which layers K-FAC preconditions on third-party model code: subclasses with their own forward,
layers used functionally (known from the tree or found at run time), sequence-first inputs, layers frozen or
unfrozen after construction. Each layer is either exact (dense float64 of what it received, or a twin run
that has no such pattern) or left out with its reason in ``coverage()``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import (
    KFACPreconditioner,
    LinearHandler,
    register_layer_type,
    scan_model,
    unregister_layer_type,
)

from .test_hooks_on_model_code import dense_linear_factors, one_step, received

D = torch.float64


# ------------------------------------------------------------------ subclasses are not their base class
class PadSame(nn.Conv2d):
    """Pads inside its forward (like timm's Conv2dSame): A from the unpadded input would be wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride, 0)


class PlainSubclass(nn.Linear):
    """A subclass that keeps nn.Linear's forward: it is an nn.Linear."""


def test_a_subclass_with_its_own_forward_is_left_out_with_its_reason() -> None:
    model = nn.Sequential(PadSame(2, 3, 2), nn.Flatten(), PlainSubclass(3 * 4 * 4, 2))
    coverage = scan_model(model).coverage()
    assert coverage.left_out == {"subclass_own_forward": ("0",)}
    assert "subclass with its own forward — register a handler 1 (0)" in str(coverage)
    assert [s.name for s in scan_model(model).layers] == ["2"]


def test_timm_subclasses_with_their_own_forward_are_left_out_and_timm_linear_kept() -> None:
    timm_layers = pytest.importorskip("timm.layers")
    from kfac_bench.models.layer_types import register_harness_layer_types

    register_harness_layer_types()
    model = nn.Sequential(
        timm_layers.Conv2dSame(3, 4, 3, stride=2),
        timm_layers.StdConv2d(4, 4, 3),
        nn.Flatten(),
        timm_layers.Linear(4, 2),
    )
    scan = scan_model(model)
    assert scan.coverage().left_out == {"subclass_own_forward": ("0", "1")}
    assert [s.name for s in scan.layers] == ["3"]


def test_a_handler_registered_for_the_subclass_brings_it_back() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    assert scan_model(nn.Sequential(Scaled(3, 2))).layers == []
    register_layer_type(Scaled, LinearHandler())
    try:
        assert [s.name for s in scan_model(nn.Sequential(Scaled(3, 2))).layers] == ["0"]
    finally:
        unregister_layer_type(Scaled)


def test_the_root_module_is_named_in_the_coverage_line() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(4, 4))
            self.fc = nn.Linear(4, 4)

    line = str(scan_model(Root()).coverage())
    assert "(Root×1: (root))" in line and ": ," not in line


# ------------------------------------------------------------------ used functionally
class Functional(nn.Module):
    """Reads ``fc.weight`` with F.linear, as torchvision Swin's attention reads ``qkv.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.fc.weight, self.fc.bias)))


def test_a_layer_used_functionally_is_found_at_run_time_and_the_share_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Functional().to(D)
    p = KFACPreconditioner(model, coverage_threshold=0.5)
    assert p.coverage().left_out == {}  # the module tree cannot tell
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        model(torch.randn(4, 6, dtype=D)).sum().backward()
        p.step()
    coverage = p.coverage()
    assert coverage.left_out == {"used_functionally": ("fc",)}
    assert coverage.preconditioned_params == 6 * 2 + 2
    runtime = [r.getMessage() for r in caplog.records if "at run time" in r.getMessage()]
    assert len(runtime) == 1 and f"{100 * coverage.eligible_share:.1f}%" in runtime[0]


def test_torchvision_swin_attention_weights_are_known_to_be_used_functionally() -> None:
    tv = pytest.importorskip("torchvision.models.swin_transformer")
    for block in (tv.SwinTransformerBlock, tv.SwinTransformerBlockV2):
        model = tv.SwinTransformer([2, 2], 8, [2], [1], [2, 2], block=block, num_classes=3)
        coverage = scan_model(model).coverage()
        assert coverage.left_out["used_functionally"] == tuple(
            f"features.1.{i}.attn.{n}" for i in (0, 1) for n in ("qkv", "proj")
        )


def test_swin_v2_cpb_mlp_gets_exact_factors_through_its_inplace_relu() -> None:
    tv = pytest.importorskip("torchvision.models.swin_transformer")
    torch.manual_seed(0)
    model = tv.SwinTransformer(
        [2, 2],
        8,
        [2],
        [1],
        [2, 2],
        block=tv.SwinTransformerBlockV2,
        num_classes=3,
        stochastic_depth_prob=0.0,
    ).to(D)
    twin = copy.deepcopy(model)
    attn = twin.features[1][0].attn
    attn.cpb_mlp[1] = nn.ReLU()  # same numbers without the in-place op
    x = torch.randn(2, 3, 8, 8, dtype=D)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum()

    got = received(twin, ["features.1.0.attn.cpb_mlp.0"], loss)
    p = one_step(model, loss)
    layer = p.layers["features.1.0.attn.cpb_mlp.0"]
    assert layer.ready
    a_ref, g_ref = dense_linear_factors(*got["features.1.0.attn.cpb_mlp.0"])
    for got_f, ref_f in ((layer.a_factor, a_ref), (layer.g_factor, g_ref)):
        assert ref_f.norm() > 0 and (got_f - ref_f).norm() <= 1e-12 * ref_f.norm()


# ------------------------------------------------------------------ sequence-first inputs
def test_sequence_first_transformer_layer_counts_examples_along_dim_1() -> None:
    torch.manual_seed(1)
    kwargs = dict(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, dtype=D)
    seq_first = nn.TransformerEncoderLayer(**kwargs)  # PyTorch's default: batch_first=False
    batch_first = nn.TransformerEncoderLayer(batch_first=True, **kwargs)
    batch_first.load_state_dict(seq_first.state_dict())
    # Attention's projections and out_proj are fed batch first by the engine's attention forward.
    assert {s.name: s.batch_dim for s in scan_model(seq_first).layers} == {
        "linear1": 1,
        "linear2": 1,
        "self_attn.q_proj": 0,
        "self_attn.k_proj": 0,
        "self_attn.v_proj": 0,
        "self_attn.out_proj": 0,
    }
    x = torch.randn(3, 5, 8, dtype=D)  # 3 examples of 5 tokens
    ref = one_step(batch_first, lambda m: m(x).pow(2).sum())
    got = one_step(seq_first, lambda m: m(x.transpose(0, 1)).pow(2).sum())
    assert set(got.layers) == set(ref.layers)
    for name in got.layers:
        torch.testing.assert_close(got.layers[name].a_factor, ref.layers[name].a_factor)
        torch.testing.assert_close(got.layers[name].g_factor, ref.layers[name].g_factor)


@pytest.mark.parametrize("batch_dim", [1, {r"^0$": 1}])
def test_batch_dim_option_sets_the_examples_dimension(batch_dim: int | dict[str, int]) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3)).to(D)
    x = torch.randn(6, 2, 4, dtype=D)  # (T=6, N=2, features)
    ref = one_step(copy.deepcopy(model), lambda m: m(x.transpose(0, 1)).pow(2).sum())
    got = one_step(model, lambda m: m(x).pow(2).sum(), batch_dim=batch_dim)
    assert got.layers["0"].batch_dim == 1
    torch.testing.assert_close(got.layers["0"].a_factor, ref.layers["0"].a_factor)
    torch.testing.assert_close(got.layers["0"].g_factor, ref.layers["0"].g_factor)


def test_batch_dim_on_a_convolution_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"K-FAC layer '0' \(Conv2d\): batch_dim=1"):
        KFACPreconditioner(nn.Sequential(nn.Conv2d(1, 1, 1)), batch_dim=1)


# ------------------------------------------------------------------ requires_grad read at step time
def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)


def test_a_bias_frozen_after_construction_keeps_no_grad_and_the_layer_rejoins_without_it() -> None:
    model = mlp()
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=0.01)
    x = torch.randn(5, 4, dtype=D)
    model(x).pow(2).sum().backward()
    p.step()
    model.zero_grad(set_to_none=True)
    model[2].bias.requires_grad_(False)
    assert p.coverage().preconditioned_params == 4 * 6 + 6 + 6 * 2  # read now, not at construction
    model(x).pow(2).sum().backward()
    plain = model[2].weight.grad.clone()
    p.step()
    assert model[2].bias.grad is None
    torch.testing.assert_close(model[2].weight.grad, plain, rtol=0, atol=0)  # plain in that step
    assert p.layers["2"].a_dim == 6 and not p.layers["2"].bias
    model.zero_grad(set_to_none=True)
    got = received(copy.deepcopy(model), ["2"], lambda m: m(x).pow(2).sum())
    model(x).pow(2).sum().backward()
    p.step()
    h, g = got["2"]
    torch.testing.assert_close(p.layers["2"].a_factor, h.t() @ h / 5)
    torch.testing.assert_close(p.layers["2"].g_factor, g.t() @ g * 5)
    assert p.layers["2"].ready and model[2].bias.grad is None


def test_a_layer_unfrozen_after_construction_is_preconditioned() -> None:
    model = mlp()
    model[0].requires_grad_(False)
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None)
    assert list(p.layers) == ["2"]
    x = torch.randn(5, 4, dtype=D)
    model(x).pow(2).sum().backward()
    p.step()
    model[0].requires_grad_(True)
    assert p.coverage().preconditioned_params == 4 * 6 + 6 + 6 * 2 + 2
    model(x).pow(2).sum().backward()
    p.step()  # plain this step, registered at its end
    assert list(p.layers) == ["0", "2"]
    model.zero_grad(set_to_none=True)
    got = received(copy.deepcopy(model), ["0"], lambda m: m(x).pow(2).sum())
    model(x).pow(2).sum().backward()
    p.step()
    a_ref, g_ref = dense_linear_factors(*got["0"])
    torch.testing.assert_close(p.layers["0"].a_factor, a_ref)
    torch.testing.assert_close(p.layers["0"].g_factor, g_ref)
    assert p.layers["0"].ready and p.coverage().left_out == {}
