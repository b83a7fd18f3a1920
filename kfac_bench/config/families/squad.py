"""Schemas of the SQuAD v1.1 fine-tuning builders: ``model=bert_qa``, ``dataset=squad`` / ``squad_pydoc``,
``task=squad``.

Each dataclass is ``_target_`` plus the builder's keyword arguments (same names and defaults; a test keeps
them in step), so a misspelt key fails when the config is composed. The recipes
``recipes/bert_large_squad*.yaml`` select them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEMAS"]


@dataclass
class BertQAModelConfig:
    """:func:`kfac_bench.models.bert_qa.build_bert_qa`: ``BertForQuestionAnswering`` of a preset whose
    encoder comes from ``init_checkpoint`` (a BERT phase-2 run's ``checkpoints/last.pt``); ``vocab_file``
    (the data's vocabulary) must fit the model's ``vocab_size``."""

    _target_: str = "kfac_bench.models.bert_qa.build_bert_qa"
    preset: str = "large"
    vocab_size: int | None = None
    init_checkpoint: str | None = None
    vocab_file: str | None = None


@dataclass
class SquadConfig:
    """:func:`kfac_bench.data.squad.load_squad_splits`: the official ``train-v1.1.json`` /
    ``dev-v1.1.json``, tokenised with the pretraining ``vocab_file``; NVIDIA run_squad.py's window sizes."""

    _target_: str = "kfac_bench.data.squad.load_squad_splits"
    train_file: str = "data/squad/train-v1.1.json"
    dev_file: str = "data/squad/dev-v1.1.json"
    vocab_file: str = "data/bert/vocab.txt"
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    lowercase: bool = True


@dataclass
class SquadPydocConfig:
    """:func:`kfac_bench.data.squad_smoke.build_squad_pydoc`: a tiny SQuAD v1.1 set made from Python's
    ``pydoc_data.topics`` and the BERT smoke shards' vocabulary, written to ``root`` on first use."""

    _target_: str = "kfac_bench.data.squad_smoke.build_squad_pydoc"
    root: str = "data/squad_pydoc"
    vocab_size: int = 2000
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    seed: int = 12345


@dataclass
class SquadTaskConfig:
    """:func:`kfac_bench.tasks.squad.build_squad_task`: span loss; evaluation by the reference
    post-processing and the official exact match / F1 (percent); target metric ``f1``."""

    _target_: str = "kfac_bench.tasks.squad.build_squad_task"
    n_best_size: int = 20
    max_answer_length: int = 30


SCHEMAS: list[tuple[str, str, type]] = [
    ("model", "bert_qa", BertQAModelConfig),
    ("dataset", "squad", SquadConfig),
    ("dataset", "squad_pydoc", SquadPydocConfig),
    ("task", "squad", SquadTaskConfig),
]
