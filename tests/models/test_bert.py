"""BERT builder: preset values, a forward/backward on reader batches, phase-1 -> phase-2 checkpoint
initialisation, and the K-FAC skip list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from kfac_bench.data.bert import BertPretrainingDataset
from kfac_bench.data.bert_smoke import prepare_pydoc_shards
from kfac_bench.errors import ConfigError
from kfac_bench.kfac.preconditioner import KFACPreconditioner
from kfac_bench.models.bert import BERT_KFAC_SKIP_LAYERS, bert_config, build_bert

ENCODER_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


def test_large_preset_is_bert_large_uncased() -> None:
    c = bert_config("large")  # the config only: the 340M-parameter model is too big for CPU tests
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (24, 1024, 16)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (4096, 30522, 512)
    assert (c.type_vocab_size, c.hidden_act) == (2, "gelu")
    assert c.hidden_dropout_prob == c.attention_probs_dropout_prob == 0.1
    t = bert_config("tiny", vocab_size=700)
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads) == (2, 128, 2)
    assert t.intermediate_size == 512
    assert t.vocab_size == 700
    with pytest.raises(ConfigError, match=r"unknown BERT preset 'huge'.*large"):
        bert_config("huge")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bert")
    prepare_pydoc_shards(
        out, max_documents=8, vocab_size=600, max_seq_length=32, max_predictions_per_seq=5,
        num_shards=1, heldout_fraction=0.0,
    )  # fmt: skip
    return out


def test_tiny_forward_backward_on_reader_batch(shards: Path) -> None:
    torch.manual_seed(0)
    model = build_bert("tiny", vocab_size=600)
    batch = next(iter(DataLoader(BertPretrainingDataset(shards), batch_size=4)))
    out = model(**batch)  # the reader's keys are BertForPreTraining's keyword arguments
    assert out.prediction_logits.shape == (4, 32, 600) and out.seq_relationship_logits.shape == (
        4,
        2,
    )
    assert torch.isfinite(out.loss) and 5.0 < out.loss.item() < 9.0  # ~ln(600) + ln(2) at init
    out.loss.backward()
    layer0 = model.bert.encoder.layer[0]
    for linear in (
        layer0.attention.self.query,
        layer0.intermediate.dense,
        model.cls.seq_relationship,
    ):
        assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def test_init_checkpoint_restores_phase_one_weights(tmp_path: Path) -> None:
    torch.manual_seed(1)
    phase1 = build_bert("tiny", vocab_size=300)
    state = phase1.state_dict()
    # a training checkpoint of a DDP-wrapped model, with other entries beside the model state
    ddp_state = {f"module.{k}": v for k, v in state.items()}
    torch.save(
        {"model": ddp_state, "step": 7038, "rng": {"python": (3, (1, 2))}}, tmp_path / "last.pt"
    )
    torch.save(state, tmp_path / "plain.pt")
    for name in ("last.pt", "plain.pt"):
        torch.manual_seed(2)
        phase2 = build_bert("tiny", vocab_size=300, init_checkpoint=str(tmp_path / name))
        restored = phase2.state_dict()
        assert restored.keys() == state.keys()
        assert all(torch.equal(restored[k], state[k]) for k in state)
    torch.manual_seed(2)
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(
        build_bert("tiny", vocab_size=300).state_dict()[key], state[key]
    )  # seed 2 differs
    with pytest.raises(ConfigError, match="does not exist"):
        build_bert("tiny", init_checkpoint=str(tmp_path / "missing.pt"))
    with pytest.raises(ConfigError, match=r"does not fit BERT preset 'tiny'.*size mismatch"):
        build_bert("tiny", vocab_size=400, init_checkpoint=str(tmp_path / "last.pt"))
    torch.save({"step": 1}, tmp_path / "nomodel.pt")
    with pytest.raises(ConfigError, match="neither a state_dict"):
        build_bert("tiny", init_checkpoint=str(tmp_path / "nomodel.pt"))


def kfac_layers(model: nn.Module) -> set[str]:
    """What the engine registers: Linear modules whose qualified name and class name match no skip regex."""
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not any(
            re.search(p, name) or re.search(p, type(module).__name__) for p in BERT_KFAC_SKIP_LAYERS
        )
    }


def test_skip_layers_leave_exactly_the_encoder_linears() -> None:
    model = build_bert("tiny", vocab_size=100)
    expected = {f"bert.encoder.layer.{i}.{sub}" for i in range(2) for sub in ENCODER_LINEARS}
    assert kfac_layers(model) == expected

    class Wrapper(nn.Module):  # DDP's naming: every name gains a 'module.' prefix
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    assert kfac_layers(Wrapper(model)) == {f"module.{n}" for n in expected}
    # the engine itself registers exactly these layers (it unwraps DDP's module)
    precond = KFACPreconditioner(model, skip_layers=BERT_KFAC_SKIP_LAYERS, factor_scaling="kaisa")
    assert set(precond.layers) == expected
    # the skipped heads are what the paper skips: the decoder's factors would be vocab x vocab
    skipped = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - expected
    assert skipped == {
        "bert.pooler.dense",
        "cls.predictions.transform.dense",
        "cls.predictions.decoder",
        "cls.seq_relationship",
    }
