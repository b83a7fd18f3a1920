"""Schemas of the BERT pretraining builders: ``model=bert``, ``dataset=bert_shards`` /
``bert_pydoc``, ``task=masked_lm``.

Each dataclass is ``_target_`` plus the builder's keyword arguments, so a misspelt key fails when the config
is composed. The recipes ``recipes/bert_large_pretrain_phase{1,2}*.yaml`` select them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BertModelConfig:
    """:func:`kfac_bench.models.bert.build_bert`: ``BertForPreTraining`` of a preset (large/base/tiny);
    ``init_checkpoint`` (e.g. the phase-1 run's ``checkpoints/last.pt``) initialises every weight."""

    _target_: str = "kfac_bench.models.bert.build_bert"
    preset: str = "large"
    vocab_size: int | None = None
    init_checkpoint: str | None = None


@dataclass
class BertShardsConfig:
    """:func:`kfac_bench.data.bert.build_bert_pretraining`: NVIDIA-format HDF5 shards in ``root``, NVIDIA's
    folder as its scripts leave it (``*_training_N.hdf5`` train, ``*_test_N.hdf5`` held out) or
    ``kfac-bench prepare-bert``'s (held out: ``root/heldout``); ``heldout_root`` holds out another folder."""

    _target_: str = "kfac_bench.data.bert.build_bert_pretraining"
    root: str = "data/bert/phase1"
    heldout_root: str | None = None


@dataclass
class BertPydocConfig:
    """:func:`kfac_bench.data.bert_smoke.build_bert_pydoc`: shards prepared from Python's bundled
    ``pydoc_data.topics`` into ``root`` on first use (smoke runs and tests)."""

    _target_: str = "kfac_bench.data.bert_smoke.build_bert_pydoc"
    root: str = "data/bert_pydoc"
    vocab_size: int = 2000
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    dupe_factor: int = 2
    max_documents: int | None = None
    seed: int = 12345


@dataclass
class MaskedLMTaskConfig:
    """:func:`kfac_bench.tasks.masked_lm.build_masked_lm`: MLM + NSP loss; target metric ``mlm_accuracy``."""

    _target_: str = "kfac_bench.tasks.masked_lm.build_masked_lm"


SCHEMAS: list[tuple[str, str, type]] = [
    ("model", "bert", BertModelConfig),
    ("dataset", "bert_shards", BertShardsConfig),
    ("dataset", "bert_pydoc", BertPydocConfig),
    ("task", "masked_lm", MaskedLMTaskConfig),
]
