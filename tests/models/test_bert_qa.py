"""BertForQuestionAnswering from BERT pretraining checkpoints: plain and harness-format state dicts, a
fresh span head, and one-line errors for checkpoints that are not BERT's or do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_bench.errors import ConfigError
from kfac_bench.models.bert import build_bert
from kfac_bench.models.bert_qa import build_bert_qa, load_pretrained_encoder

VOCAB = 300


@pytest.fixture(scope="module")
def pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return build_bert("tiny", vocab_size=VOCAB).state_dict()


def test_encoder_comes_from_a_plain_state_dict(tmp_path: Path, pretrained) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "phase2.pt"
    torch.save(pretrained, path)
    torch.manual_seed(2)
    model = build_bert_qa("tiny", init_checkpoint=str(path))
    assert model.config.vocab_size == VOCAB  # taken from the checkpoint's word embeddings
    state = model.state_dict()
    encoder = [k for k in state if k.startswith("bert.")]
    assert encoder and all(torch.equal(state[k], pretrained[k]) for k in encoder)
    assert not any(k.startswith(("cls.", "bert.pooler.")) for k in state)
    # The span head is new: BERT's initialiser, N(0, 0.02) weights and zero bias, not loaded weights.
    head = model.qa_outputs
    assert head.weight.shape == (2, 128) and torch.count_nonzero(head.bias) == 0
    assert 0.01 < head.weight.std().item() < 0.03


def test_encoder_comes_from_a_harness_checkpoint(tmp_path: Path, pretrained) -> None:  # type: ignore[no-untyped-def]
    # kfac_bench.checkpoint.manager saves {"model": state_dict, ...}; a DDP model's keys carry "module.".
    path = tmp_path / "last.pt"
    torch.save({"model": {f"module.{k}": v for k, v in pretrained.items()}, "step": 7}, path)
    model = build_bert_qa("tiny", vocab_size=VOCAB, init_checkpoint=str(path))
    key = "bert.encoder.layer.1.output.dense.weight"
    assert torch.equal(model.state_dict()[key], pretrained[key])
    assert set(load_pretrained_encoder(path)) == {
        k for k in pretrained if k.startswith("bert.") and not k.startswith("bert.pooler.")
    }


def _one_line(call) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_resnet_or_a_non_checkpoint_is_rejected(tmp_path: Path) -> None:
    resnet = tmp_path / "resnet.pt"
    torch.save(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).state_dict(), resnet)
    assert "not a BERT pretraining checkpoint" in _one_line(
        lambda: build_bert_qa("tiny", init_checkpoint=str(resnet))
    )
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a PyTorch checkpoint" in _one_line(
        lambda: build_bert_qa("tiny", init_checkpoint=str(text))
    )
    assert "does not exist" in _one_line(
        lambda: build_bert_qa("tiny", init_checkpoint=str(tmp_path / "missing.pt"))
    )


def test_a_checkpoint_of_another_size_is_rejected(tmp_path: Path, pretrained) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tiny.pt"
    torch.save(pretrained, path)
    message = _one_line(lambda: build_bert_qa("base", init_checkpoint=str(path)))
    assert "does not fit BERT preset 'base'" in message and "shape" in message
    message = _one_line(lambda: build_bert_qa("tiny", vocab_size=512, init_checkpoint=str(path)))
    assert "word_embeddings" in message


def test_a_vocabulary_larger_than_the_model_is_rejected(tmp_path: Path, pretrained) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tiny.pt"
    torch.save(pretrained, path)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    fits = tmp_path / "fits.txt"
    fits.write_text("\n".join([*special, *(f"w{i}" for i in range(VOCAB - 5))]) + "\n")
    too_big = tmp_path / "big.txt"
    too_big.write_text("\n".join([*special, *(f"w{i}" for i in range(VOCAB - 4))]) + "\n")
    # Exactly as many tokens as embedding rows fits; one more would index past the embeddings.
    model = build_bert_qa("tiny", init_checkpoint=str(path), vocab_file=str(fits))
    assert model.config.vocab_size == VOCAB
    message = _one_line(
        lambda: build_bert_qa("tiny", init_checkpoint=str(path), vocab_file=str(too_big))
    )
    assert f"has {VOCAB + 1} tokens but the model's vocab_size is {VOCAB}" in message
    assert "301 tokens" in _one_line(
        lambda: build_bert_qa("tiny", vocab_size=VOCAB, vocab_file=str(too_big))
    )


def test_the_recipe_placeholder_names_the_phase2_run(tmp_path: Path) -> None:
    message = _one_line(
        lambda: build_bert_qa("tiny", init_checkpoint="PHASE2_RUN_DIR/checkpoints/last.pt")
    )
    assert "'PHASE2_RUN_DIR/checkpoints/last.pt' does not exist" in message
    assert "phase-2 run" in message
