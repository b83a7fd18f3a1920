"""Hugging Face models (GPT-2, BERT) under activation checkpointing, reentrant or not: the recomputed forward
must not capture a layer twice or lose it, so every layer's factors equal the plain run's and K-FAC covers the
same parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.models.layer_types import register_harness_layer_types

from .test_layer_types import gpt2_tiny

transformers = pytest.importorskip("transformers")


def bert_tiny() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).double()


def factor_step(model: torch.nn.Module, batches: list[torch.Tensor]) -> KFACPreconditioner:
    p = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, accumulation_steps=len(batches))
    for ids in batches:
        (model(input_ids=ids, labels=ids).loss / len(batches)).backward()
    p.step()
    return p


@pytest.mark.parametrize("build", [gpt2_tiny, bert_tiny], ids=["gpt2", "bert"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_gives_the_factors_of_the_plain_run(build, reentrant: bool) -> None:  # type: ignore[no-untyped-def]
    register_harness_layer_types()
    model = build()
    model.train()
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 10), generator=g) for _ in range(2)]
    ref, got = factor_step(model, batches), factor_step(ckpt, batches)
    assert set(ref.layers) == set(got.layers) and len(ref.layers) >= 8
    for name, layer in ref.layers.items():
        other = got.layers[name]
        assert other.ready, name
        for a, b in ((other.a_factor, layer.a_factor), (other.g_factor, layer.g_factor)):
            assert (a - b).norm() <= 1e-10 * b.norm(), name
    assert got.coverage().preconditioned_params == ref.coverage().preconditioned_params
