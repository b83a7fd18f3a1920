"""BERT for pretraining (masked LM + next-sentence prediction), built locally from a ``BertConfig``.

The model is ``transformers.BertForPreTraining`` with randomly initialised weights: nothing is ever
downloaded (``HF_HUB_OFFLINE`` is set before transformers is imported). Phase 2 of the paper's recipe
starts from the phase-1 model through ``init_checkpoint``.

K-FAC (TPDS §6.3.3) preconditions only the encoder's ``nn.Linear`` layers: the embeddings and the
prediction heads are skipped, because the MLM decoder's input/output factors would be 30522 x 30522
(:data:`BERT_KFAC_SKIP_LAYERS`). The encoder's Linear layers see inputs of shape (batch, seq, features);
every token counts as one row of the Kronecker factors (the reference's "expand" treatment), so a factor
averages over ``batch * seq`` rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: building never needs the Hub

from transformers import BertConfig, BertForPreTraining

from kfac_bench.checkpoint import torchfile
from kfac_bench.errors import ConfigError

__all__ = ["BERT_KFAC_SKIP_LAYERS", "BERT_PRESETS", "bert_config", "build_bert", "load_model_state"]

#: Architecture sizes by preset name. ``large`` is BERT-Large uncased (Devlin et al.; NVIDIA's
#: ``bert_config.json``); ``tiny`` is for smoke runs and tests on CPU.
BERT_PRESETS: dict[str, dict[str, int]] = {
    "large": {
        "vocab_size": 30522,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "max_position_embeddings": 512,
    },
    "base": {
        "vocab_size": 30522,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 512,
    },
    "tiny": {
        "vocab_size": 30522,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 512,
    },
}

#: ``skip_layers`` for the K-FAC engine (regexes, matched with ``re.search`` against each module's
#: qualified name and its class name) that leave exactly the encoder's Linear layers
#: (``bert.encoder.layer.N.{attention.self.query,key,value, attention.output.dense, intermediate.dense,
#: output.dense}``). Names are matched at a dot boundary so they also work under a DDP ``module.`` prefix.
BERT_KFAC_SKIP_LAYERS: tuple[str, ...] = (
    r"embeddings",  # word/position/token-type embeddings (the reference's 'embedding')
    r"BertLMPredictionHead",  # the MLM head as a whole (the reference's skip), by class name
    r"(^|\.)cls(\.|$)",  # every Linear of the pretraining heads: MLM transform, decoder, NSP classifier
    r"(^|\.)pooler(\.|$)",  # the [CLS] pooler feeding NSP: a head, not part of the encoder
)


def bert_config(preset: str = "large", vocab_size: int | None = None) -> BertConfig:
    """The ``BertConfig`` of ``preset`` (GELU, dropout 0.1, 2 token types, as BERT-Large uncased).

    Args:
        preset: a key of :data:`BERT_PRESETS`.
        vocab_size: overrides the preset's 30522, e.g. for a vocabulary trained by
            ``kfac-bench prepare-bert``; it must be at least that vocabulary's size.
    """
    if preset not in BERT_PRESETS:
        raise ConfigError(
            f"unknown BERT preset '{preset}': choose one of {', '.join(sorted(BERT_PRESETS))}"
        )
    sizes: dict[str, Any] = dict(BERT_PRESETS[preset])
    if vocab_size is not None:
        if vocab_size < 5:
            raise ConfigError(
                f"vocab_size must hold at least the 5 special tokens, got {vocab_size}"
            )
        sizes["vocab_size"] = vocab_size
    return BertConfig(**sizes)


def load_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model ``state_dict`` inside a checkpoint file.

    Accepts a plain ``state_dict`` or a dict holding it under ``"model"`` (a kfac-bench training
    checkpoint); strips the ``module.`` prefix of DDP and the ``_orig_mod.`` prefix of ``torch.compile``.

    The file is read as data only (:func:`kfac_bench.checkpoint.torchfile.load`): a file whose pickle names
    code is refused unread.

    Raises:
        ConfigError: the file is missing or holds no model state_dict.
        kfac_bench.checkpoint.torchfile.RefusedFile, kfac_bench.checkpoint.torchfile.UnreadableFile: one
            line naming the file.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"model.init_checkpoint '{file}' does not exist: give the phase-1 run's checkpoint file "
            "(e.g. RUN_DIR/checkpoints/last.pt)"
        )
    obj: Any = torchfile.load(file, what="model.init_checkpoint")
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(
            f"model.init_checkpoint '{file}' holds neither a state_dict nor a dict with a 'model' state_dict"
        )
    state = {}
    for key, value in obj.items():
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        state[key] = value
    return state


def build_bert(
    preset: str = "large", vocab_size: int | None = None, init_checkpoint: str | None = None
) -> BertForPreTraining:
    """Model builder (``model._target_``): ``BertForPreTraining`` of ``preset``.

    Args:
        preset: ``"large"`` (BERT-Large uncased: 24 layers, hidden 1024, 16 heads, intermediate 4096,
            vocab 30522, 512 positions), ``"base"`` or ``"tiny"`` (2 layers, hidden 128, 2 heads,
            intermediate 512).
        vocab_size: overrides the preset's vocabulary size (see :func:`bert_config`).
        init_checkpoint: a checkpoint whose model state initialises every weight (phase 2 starts from
            phase 1); see :func:`load_model_state`. Keys and shapes must match exactly.

    Raises:
        ConfigError: unknown preset, bad vocab size, missing or mismatching checkpoint.
    """
    model = BertForPreTraining(bert_config(preset, vocab_size))
    if init_checkpoint is not None:
        state = load_model_state(init_checkpoint)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            # The message lists one problem per line after a header; one line is enough to act on.
            problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
            raise ConfigError(
                f"model.init_checkpoint '{init_checkpoint}' does not fit BERT preset '{preset}' "
                f"(vocab_size={model.config.vocab_size}): {(problems[0] if problems else str(err))[:200]} "
                f"({len(problems)} problems)"
            ) from None
    return model
