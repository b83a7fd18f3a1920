"""BERT for SQuAD: ``transformers.BertForQuestionAnswering`` started from a pretraining checkpoint.

The architecture is a preset of :mod:`kfac_bench.models.bert`; the encoder (embeddings and transformer
layers) is copied from a ``BertForPreTraining`` state dict, either a plain one or a kfac-bench training
checkpoint holding it under ``"model"`` (``RUN_DIR/checkpoints/last.pt`` of a phase-2 run). The span
head ``qa_outputs`` (hidden -> 2) is freshly initialised and the pretraining heads (pooler, masked-LM,
next-sentence) are dropped, as NVIDIA DeepLearningExamples ``run_squad.py`` does when it loads the
pretraining checkpoint into ``BertForQuestionAnswering`` (``strict=False``).

``vocab_file`` (the SQuAD recipes pass the dataset's) is the vocabulary the questions are tokenised with:
a token id at or above the model's ``vocab_size`` would index past the word embeddings (an IndexError on
the CPU, a device-side assert on a GPU, hours into a job), so the builder refuses that pairing at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: building never needs the Hub

from transformers import BertForQuestionAnswering

from kfac_bench.checkpoint import torchfile
from kfac_bench.data.squad import load_squad_tokenizer
from kfac_bench.errors import ConfigError, UserError
from kfac_bench.models.bert import bert_config, load_model_state

__all__ = ["build_bert_qa", "check_vocab_fits", "load_pretrained_encoder"]

_WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


def load_pretrained_encoder(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The ``bert.*`` encoder weights (pooler excluded) of a BERT pretraining checkpoint.

    Raises:
        ConfigError: a missing or unreadable file, or one without BERT encoder weights (e.g. a ResNet).
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"model.init_checkpoint '{file}' does not exist: give the BERT phase-2 run's checkpoint "
            "file (RUN_DIR/checkpoints/last.pt)"
        )
    try:
        state = load_model_state(file)
    except torchfile.UnreadableFile as err:
        raise ConfigError(
            f"model.init_checkpoint '{file}' is not a PyTorch checkpoint ({err.reason}): "
            "give a BERT phase-2 run's checkpoints/last.pt"
        ) from None
    except UserError:  # refused (it would run code), or no model state in it
        raise
    except Exception as err:  # torch.load raises format-specific errors for a non-checkpoint
        reason = (str(err).splitlines() or [""])[0][:120]
        raise ConfigError(
            f"model.init_checkpoint '{file}' is not a PyTorch checkpoint ({type(err).__name__}: {reason}): "
            "give a BERT phase-2 run's checkpoints/last.pt"
        ) from None
    encoder = {
        k: v for k, v in state.items() if k.startswith("bert.") and not k.startswith("bert.pooler.")
    }
    if _WORD_EMBEDDINGS not in encoder or not any(k.startswith("bert.encoder.") for k in encoder):
        sample = ", ".join(list(state)[:3]) or "nothing"
        raise ConfigError(
            f"model.init_checkpoint '{file}' is not a BERT pretraining checkpoint: it has no "
            f"'bert.embeddings' / 'bert.encoder' weights (it holds {sample}, ...); give a BERT phase-2 run's "
            "checkpoints/last.pt"
        )
    return encoder


def check_vocab_fits(vocab_file: str | os.PathLike[str], model_vocab_size: int) -> None:
    """Raise a one-line ConfigError if the tokenizer of ``vocab_file`` has more tokens than the model's
    word embeddings have rows."""
    tokens = load_squad_tokenizer(vocab_file).get_vocab_size()
    if tokens > model_vocab_size:
        raise ConfigError(
            f"the vocabulary '{vocab_file}' has {tokens} tokens but the model's vocab_size is "
            f"{model_vocab_size}: use the vocabulary the checkpoint was pretrained with (or raise "
            "model.vocab_size when training from scratch)"
        )


def build_bert_qa(
    preset: str = "large",
    vocab_size: int | None = None,
    init_checkpoint: str | None = None,
    vocab_file: str | None = None,
) -> BertForQuestionAnswering:
    """Model builder (``model._target_``): ``BertForQuestionAnswering`` of ``preset``.

    Args:
        preset: a key of :data:`kfac_bench.models.bert.BERT_PRESETS` (``large`` for the paper).
        vocab_size: overrides the preset's vocabulary size; by default the checkpoint's (its word
            embedding rows) when there is one, else the preset's.
        init_checkpoint: BERT pretraining checkpoint whose encoder initialises the model (see
            :func:`load_pretrained_encoder`); every encoder weight must be there with the right shape.
        vocab_file: the data's WordPiece vocabulary; if given, it must fit the model's ``vocab_size``.

    Raises:
        ConfigError: unknown preset, a checkpoint that is missing, not BERT, or of another size, or a
            vocabulary larger than the model's.
    """
    encoder = load_pretrained_encoder(init_checkpoint) if init_checkpoint is not None else None
    if vocab_size is None and encoder is not None:
        vocab_size = int(encoder[_WORD_EMBEDDINGS].shape[0])
    model = BertForQuestionAnswering(bert_config(preset, vocab_size))
    if vocab_file is not None:
        check_vocab_fits(vocab_file, model.config.vocab_size)
    if encoder is None:
        return model
    expected = {k: v.shape for k, v in model.state_dict().items() if k.startswith("bert.")}
    missing = sorted(set(expected) - set(encoder))
    wrong = [k for k in expected if k in encoder and encoder[k].shape != expected[k]]
    if missing or wrong:
        problem = (
            f"'{wrong[0]}' has shape {tuple(encoder[wrong[0]].shape)}, the model {tuple(expected[wrong[0]])}"
            if wrong
            else f"{len(missing)} encoder weights are missing (first: '{missing[0]}')"
        )
        raise ConfigError(
            f"model.init_checkpoint '{init_checkpoint}' does not fit BERT preset '{preset}' "
            f"(vocab_size={model.config.vocab_size}): {problem}; use the preset and vocab_size it was "
            "pretrained with"
        )
    model.load_state_dict({k: encoder[k] for k in expected}, strict=False)
    return model
