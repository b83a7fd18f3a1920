"""What the engine reports matches what it did: ``model.train(False)`` mid-run (``eval_mode`` at ``step()``
and in ``coverage()``, plain gradients), an idle layer whose ``.grad`` the loop zero-filled (did not run,
not "used functionally"), and parameters that are not weight matrices (class token, position embedding,
layer scale) named as such, with advice that applies."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner, scan_model

D = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D)


def train_step(model: nn.Module, p: KFACPreconditioner, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, dtype=D, generator=g), torch.randint(0, 3, (6,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    p.step()


def test_train_false_mid_run_is_reported_at_step_and_in_coverage_with_plain_gradients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = mlp()
    p = KFACPreconditioner(model, kl_clip=None)
    train_step(model, p, 0)
    assert p.coverage().left_out == {}
    factor = p.layers["0"].a_factor.clone()
    model.train(False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, dtype=D, generator=g), torch.randint(0, 3, (6,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    plain = {n: q.grad.clone() for n, q in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        p.step()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "eval() mode" in text and "(0, 2)" in text
    assert "0 backward passes" not in text  # the eval-mode warning says what happened
    assert p.coverage().left_out == {"eval_mode": ("0", "2")}
    for n, q in model.named_parameters():  # plain gradients, not stale-factor ones
        assert torch.equal(q.grad, plain[n]), n
    torch.testing.assert_close(p.layers["0"].a_factor, factor, rtol=0, atol=0)
    model.train()
    train_step(model, p, 2)
    assert p.coverage().left_out == {}


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 3, dtype=D)
        self.idle = nn.Linear(4, 3, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_an_idle_layer_whose_grad_was_zero_filled_did_not_run() -> None:
    model = Experts()
    p = KFACPreconditioner(model, kl_clip=None)
    model(torch.randn(5, 4, dtype=D)).pow(2).mean().backward()
    for q in model.parameters():  # what a loop without DDP does before all_reduce
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    p.step()
    assert p.coverage().left_out == {"did_not_run": ("idle",)}


class TokenModel(nn.Module):
    """ViT-like root parameters and a ConvNeXt-like layer scale, around one Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.class_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.pos_embedding = nn.Parameter(torch.zeros(1, 5, 8))
        self.block = nn.Module()
        self.block.layer_scale = nn.Parameter(torch.ones(8, 1, 1))
        self.proj = nn.Linear(8, 8)
        self.table = nn.Embedding(
            10, 8
        )  # a real matrix without a handler: still an unsupported type


def test_tokens_position_embeddings_and_layer_scale_are_not_weight_matrices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TokenModel()
    scan = scan_model(model)
    cov = scan.coverage()
    assert cov.left_out["not_a_weight_matrix"] == ("", "block")
    assert (
        "class_token, pos_embedding" in scan.details[""] and "layer_scale" in scan.details["block"]
    )
    assert cov.left_out["unsupported_type"] == ("table",) and cov.unsupported_types == {
        "Embedding": 1
    }
    # Eligible: the Linear and the embedding table; not the token, the position embedding or the scale.
    assert cov.eligible_params == 8 * 8 + 8 + 10 * 8
    assert "not weight matrices" in str(cov)
    # Advice that applies: no layer type to register when only such tensors are left out.
    del model.table
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        KFACPreconditioner(model, coverage_threshold=1.1)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "register_layer_type" not in text and "coverage_threshold" in text


def test_conv3d_and_transposed_convolutions_are_unsupported_with_their_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Conv3d(2, 3, 2), nn.ConvTranspose2d(3, 2, 2), nn.Conv1d(2, 2, 3))
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        KFACPreconditioner(model)
    assert any("0: unsupported type" in r.getMessage() for r in caplog.records)
    scan = scan_model(model)
    assert [s.name for s in scan.layers] == ["2"]
    assert scan.coverage().left_out["unsupported_type"] == ("0", "1")
    assert "3-D" in scan.details["0"] and "dilated by the stride" in scan.details["1"]
