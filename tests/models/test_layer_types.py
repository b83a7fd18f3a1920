"""Third-party layer types through the harness's registration: GPT-2's Conv1D, tied decoders (HF, offline)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.config.schema import KFACConfig
from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.models.layer_types import register_harness_layer_types

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

CONV1D = [
    f"transformer.h.{i}.{m}"
    for i in range(2)
    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]


def gpt2_tiny() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


def as_linear(model: nn.Module) -> nn.Module:
    """A copy with every Conv1D rewritten as the equivalent nn.Linear (weight transposed)."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, Conv1D):
            lin = nn.Linear(m.weight.shape[0], m.weight.shape[1], dtype=m.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(m.weight.t())
                lin.bias.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, lin)
    return twin


def test_gpt2_conv1d_is_preconditioned_like_the_equivalent_linear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    register_harness_layer_types()
    model = gpt2_tiny()
    twin = as_linear(model)
    kw = dict(factor_decay=0.0, damping=0.01, kl_clip=0.001, lr=0.1)
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model, **kw)
    q = KFACPreconditioner(twin, **kw)
    assert sorted(p.layers) == sorted(q.layers) == sorted(CONV1D)  # lm_head: tied with wte
    cov = p.coverage()
    assert cov.left_out["tied"] == ("lm_head",) and cov.layers == 8
    text = " ".join(r.getMessage() for r in caplog.records)
    assert (
        "'lm_head'" in text
        and "'transformer.wte'" in text
        and "K-FAC preconditions 8 layers" in text
    )
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    for m in (model, twin):
        m(input_ids=ids, labels=ids).loss.backward()
    p.step()
    q.step()
    for name in CONV1D:
        conv, lin = model.get_submodule(name), twin.get_submodule(name)
        torch.testing.assert_close(
            p.layers[name].a_factor, q.layers[name].a_factor, rtol=1e-12, atol=1e-14
        )
        torch.testing.assert_close(
            p.layers[name].g_factor, q.layers[name].g_factor, rtol=1e-12, atol=1e-14
        )
        torch.testing.assert_close(conv.weight.grad.t(), lin.weight.grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(conv.bias.grad, lin.bias.grad, rtol=1e-10, atol=1e-13)
    # The tied lm_head/wte weight keeps its plain gradient, the same in both models.
    torch.testing.assert_close(model.lm_head.weight.grad, twin.lm_head.weight.grad)


def test_harness_builder_registers_conv1d_and_reports_coverage() -> None:
    model = gpt2_tiny()
    p = build_preconditioner(
        model, KFACConfig(), steps_per_epoch=1, world_size=1, accumulation_steps=1, lr=0.1
    )
    assert p is not None and sorted(p.layers) == sorted(CONV1D)
    cov = p.coverage()
    weights = sum(
        model.get_submodule(n).weight.numel() + model.get_submodule(n).bias.numel() for n in CONV1D
    )
    assert cov.preconditioned_params == weights
    assert cov.to_dict()["left_out"]["tied"] == ["lm_head"]
    assert cov.unsupported_types == {"Embedding": 2}  # wte (with lm_head) and wpe


def test_bert_decoder_tied_to_the_word_embeddings_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.BertForPreTraining(cfg)
    decoder = model.cls.predictions.decoder
    assert decoder.weight is model.bert.embeddings.word_embeddings.weight
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model)
    assert "cls.predictions.decoder" not in p.layers
    assert "cls.predictions.decoder" in p.coverage().left_out["tied"]
    tied = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert any(
        "'cls.predictions.decoder'" in m and "'bert.embeddings.word_embeddings'" in m for m in tied
    )
    # The recipes' rule skips the whole prediction head first (reason: skipped by rule, no tied line).
    p2 = KFACPreconditioner(model, skip_layers=["(^|\\.)cls(\\.|$)"])
    assert "cls.predictions.decoder" in p2.coverage().left_out["skipped_by_rule"]
