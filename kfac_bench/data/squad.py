"""SQuAD v1.1 for BERT fine-tuning: the official JSON files, read unchanged, and their model features.

A SQuAD v1.1 file (``train-v1.1.json``, ``dev-v1.1.json``) is ``{"version": "1.1", "data": [article...]}``;
an article holds ``paragraphs``, each a ``context`` and its ``qas``; each question has an ``id``, the
``question`` text and ``answers``: one or more ``{"text", "answer_start"}`` spans of the context (one in
the training file, usually three in the development file). :func:`read_squad` checks that shape and
rejects SQuAD 2.0 files (``is_impossible``, ``plausible_answers``).

:class:`SquadFeatures` turns examples into BERT inputs as NVIDIA DeepLearningExamples
``PyTorch/LanguageModeling/BERT/run_squad.py`` (``convert_examples_to_features``) does, with the fast
tokenizer's character offsets in place of its whitespace words: ``[CLS] question [SEP] window [SEP]``
with the question cut to ``max_query_length`` tokens and the context split into windows of at most
``max_seq_length - len(question) - 3`` tokens whose starts are ``doc_stride`` tokens apart. A training
feature is labelled with the token positions of the answer's first and last token, or 0 (``[CLS]``) for
both when its window does not hold the whole answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import BertWordPieceTokenizer
from torch.utils.data import Dataset

from kfac_bench.data.base import DataSplits
from kfac_bench.data.bert_corpus import load_tokenizer
from kfac_bench.errors import ConfigError, DatasetError

__all__ = [
    "SquadAnswer",
    "SquadExample",
    "SquadFeature",
    "SquadFeatures",
    "doc_windows",
    "load_squad_splits",
    "load_squad_tokenizer",
    "max_context_mask",
    "read_squad",
    "squad_collate",
]

SQUAD_VERSION = "1.1"
_HOW_TO_GET = (
    "Use the official train-v1.1.json / dev-v1.1.json (https://rajpurkar.github.io/SQuAD-explorer/)"
)
_SQUAD2_KEYS = ("is_impossible", "plausible_answers")


@dataclass(frozen=True)
class SquadAnswer:
    text: str
    answer_start: int  # character offset of ``text`` in the context


@dataclass(frozen=True)
class SquadExample:
    """One question with its context; examples of one paragraph share ``context``."""

    id: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]
    title: str = ""


def _bad(path: Path, problem: str) -> DatasetError:
    return DatasetError(path, f"a SQuAD v1.1 JSON file; {problem}", _HOW_TO_GET)


def _field(obj: Any, key: str, kind: type, path: Path, where: str) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(path, f"{where} has no '{key}' of type {kind.__name__}")
    return value


def read_squad(path: str | os.PathLike[str]) -> list[SquadExample]:
    """The examples of a SQuAD v1.1 file, in file order.

    Raises:
        DatasetError: a missing file, invalid JSON, another version (e.g. SQuAD 2.0) or a missing or
            mistyped field; the one-line message names the file and the first problem.
    """
    file = Path(path)
    if not file.is_file():
        raise DatasetError(
            file, "a SQuAD v1.1 JSON file (train-v1.1.json or dev-v1.1.json)", _HOW_TO_GET
        )
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _bad(file, f"it is not valid JSON ({err})") from None
    except RecursionError:
        raise _bad(file, "its JSON is nested too deeply to read") from None
    if not isinstance(raw, dict) or "data" not in raw:
        raise _bad(file, "no top-level 'version' and 'data'")
    if raw.get("version") != SQUAD_VERSION:
        raise _bad(
            file, f"version is {raw.get('version')!r}, not '1.1' (SQuAD 2.0 is not supported)"
        )
    articles = _field(raw, "data", list, file, "the file")
    examples: list[SquadExample] = []
    for a, article in enumerate(articles):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for p, paragraph in enumerate(_field(article, "paragraphs", list, file, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", str, file, where)
            for q, qa in enumerate(_field(paragraph, "qas", list, file, where)):
                examples.append(_read_qa(qa, context, str(title), file, f"{where}.qas[{q}]"))
    seen: set[str] = set()
    for example in examples:
        if example.id in seen:
            raise _bad(file, f"question id {example.id!r} occurs more than once")
        seen.add(example.id)
    return examples


def _read_qa(qa: Any, context: str, title: str, file: Path, where: str) -> SquadExample:
    if isinstance(qa, dict) and any(k in qa for k in _SQUAD2_KEYS):
        raise _bad(file, f"{where} has SQuAD 2.0 fields ({', '.join(_SQUAD2_KEYS)})")
    qid = _field(qa, "id", str, file, where)
    question = _field(qa, "question", str, file, where)
    answers = []
    for i, ans in enumerate(_field(qa, "answers", list, file, where)):
        text = _field(ans, "text", str, file, f"{where}.answers[{i}]")
        start = _field(ans, "answer_start", int, file, f"{where}.answers[{i}]")
        if not 0 <= start <= len(context):
            raise _bad(file, f"{where}.answers[{i}].answer_start {start} is outside its context")
        answers.append(SquadAnswer(text, start))
    if not answers:
        raise _bad(file, f"{where} (id {qid!r}) has no answers")
    return SquadExample(qid, question, context, tuple(answers), title)


def load_squad_tokenizer(
    vocab_file: str | os.PathLike[str], lowercase: bool = True
) -> BertWordPieceTokenizer:
    """The fast WordPiece tokenizer of a BERT ``vocab.txt`` (uncased: lower-case and strip accents).

    This is the Rust tokenizer that ``transformers.BertTokenizerFast`` wraps (same ids and offsets) and
    the one :mod:`kfac_bench.data.bert_prepare` makes pretraining shards with, so fine-tuning reads text
    exactly as pretraining did.
    """
    tokenizer = load_tokenizer(vocab_file, lowercase)
    missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]") if tokenizer.token_to_id(t) is None]
    if missing:
        raise DatasetError(vocab_file, f"a BERT vocabulary containing {', '.join(missing)}")
    return tokenizer


def doc_windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of the context windows: NVIDIA run_squad.py's ``doc_spans`` loop.

    Windows hold at most ``max_tokens`` tokens and start ``min(length, doc_stride)`` tokens after the
    previous one; the last ends at the last token. An empty context still gets one (empty) window so that
    every question is predicted (the reference drops such questions, which then score 0 either way).
    """
    windows: list[tuple[int, int]] = []
    start = 0
    while True:
        length = min(num_tokens - start, max_tokens)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += min(length, doc_stride)


def max_context_mask(windows: Sequence[tuple[int, int]], k: int) -> np.ndarray:
    """For each token of window ``k``: is ``k`` the window where it has the most context?

    NVIDIA run_squad.py ``_check_is_max_context``: score = min(left, right context) + 0.01 * window
    length; the first window with the highest score wins.
    """
    start, length = windows[k]
    positions = np.arange(start, start + length)
    scores = np.full((len(windows), length), -np.inf)
    for j, (s, n) in enumerate(windows):
        inside = (positions >= s) & (positions < s + n)
        context = np.minimum(positions - s, s + n - 1 - positions) + 0.01 * n
        scores[j, inside] = context[inside]
    return np.argmax(scores, axis=0) == k if length else np.zeros(0, dtype=bool)


@dataclass(frozen=True)
class SquadFeature:
    """One model input: a window of an example's context.

    Attributes:
        example_index: index of the example in :attr:`SquadFeatures.examples`.
        window: index of this window among the example's windows.
        doc_start, doc_length: the window's first context token and its number of context tokens.
        start_position, end_position: token positions of the first answer in the input sequence, or 0
            (``[CLS]``) when the window does not hold it whole.
    """

    example_index: int
    window: int
    doc_start: int
    doc_length: int
    start_position: int
    end_position: int


class SquadFeatures(Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset of the features of ``examples`` (see the module docstring).

    Items are dicts of int64 tensors padded to ``max_seq_length`` (the reference pads every feature to
    it): ``input_ids``, ``token_type_ids``, ``attention_mask`` and, with ``training``,
    ``start_positions`` / ``end_positions``; otherwise ``feature_index``, which evaluation maps back to
    :meth:`offset_mapping` and the example.

    Args:
        training: label from each example's first answer and leave out examples whose answer is not
            where ``answer_start`` says (the reference skips them too); evaluation keeps every example.
    """

    def __init__(
        self,
        examples: Sequence[SquadExample],
        tokenizer: BertWordPieceTokenizer,
        max_seq_length: int = 384,
        doc_stride: int = 128,
        max_query_length: int = 64,
        training: bool = False,
    ) -> None:
        if max_seq_length - max_query_length - 3 < 1:
            raise ConfigError(
                f"max_seq_length {max_seq_length} leaves no room for context after a question of "
                f"max_query_length {max_query_length} and 3 special tokens: raise it or lower "
                "max_query_length"
            )
        if doc_stride < 1:
            raise ConfigError(f"doc_stride must be at least 1 token, got {doc_stride}")
        self.max_seq_length = max_seq_length
        self.training = training
        self.vocab_size = tokenizer.get_vocab_size()
        self.pad_id, self.cls_id, self.sep_id = (
            tokenizer.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]")
        )
        contexts = sorted({e.context for e in examples})
        encoded = tokenizer.encode_batch(contexts, add_special_tokens=False)
        context_index = {c: i for i, c in enumerate(contexts)}
        self._context_ids = [np.asarray(enc.ids, dtype=np.int64) for enc in encoded]
        self._offsets = [np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2) for enc in encoded]
        questions = [
            enc.ids
            for enc in tokenizer.encode_batch(
                [e.question for e in examples], add_special_tokens=False
            )
        ]
        self.examples: list[SquadExample] = []
        self.features: list[SquadFeature] = []
        self._question_ids: list[np.ndarray] = []
        self._paragraph: list[int] = []
        self._windows: list[list[tuple[int, int]]] = []
        self.skipped_examples = 0
        for example, q_ids in zip(examples, questions):
            c = context_index[example.context]
            span = self._answer_tokens(example, c)
            if training and span is None:
                self.skipped_examples += 1
                continue
            q_ids = q_ids[:max_query_length]
            windows = doc_windows(
                len(self._context_ids[c]), max_seq_length - len(q_ids) - 3, doc_stride
            )
            e = len(self.examples)
            self.examples.append(example)
            self._question_ids.append(np.asarray(q_ids, dtype=np.int64))
            self._paragraph.append(c)
            self._windows.append(windows)
            for w, (start, length) in enumerate(windows):
                label = (0, 0)
                if span is not None and start <= span[0] and span[1] < start + length:
                    offset = len(q_ids) + 2 - start  # context token i sits at position i + offset
                    label = (span[0] + offset, span[1] + offset)
                self.features.append(SquadFeature(e, w, start, length, *label))

    def _answer_tokens(self, example: SquadExample, c: int) -> tuple[int, int] | None:
        """First and last context token of the first answer, or None if the text is not found there."""
        answer = example.answers[0]
        begin, end = answer.answer_start, answer.answer_start + len(answer.text)
        if example.context[begin:end].split() != answer.text.split() or not answer.text.strip():
            return None
        offsets = self._offsets[c]
        hit = np.nonzero((offsets[:, 1] > begin) & (offsets[:, 0] < end))[0]
        return (int(hit[0]), int(hit[-1])) if len(hit) else None

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        f = self.features[index]
        q = self._question_ids[f.example_index]
        doc = self._context_ids[self._paragraph[f.example_index]][
            f.doc_start : f.doc_start + f.doc_length
        ]
        ids = np.full(self.max_seq_length, self.pad_id, dtype=np.int64)
        n = len(q) + len(doc) + 3
        ids[:n] = np.concatenate([[self.cls_id], q, [self.sep_id], doc, [self.sep_id]])
        types = np.zeros(self.max_seq_length, dtype=np.int64)
        types[len(q) + 2 : n] = 1
        item = {
            "input_ids": torch.from_numpy(ids),
            "token_type_ids": torch.from_numpy(types),
            "attention_mask": (torch.arange(self.max_seq_length) < n).long(),
        }
        if self.training:
            item["start_positions"] = torch.tensor(f.start_position)
            item["end_positions"] = torch.tensor(f.end_position)
        else:
            item["feature_index"] = torch.tensor(index)
        return item

    # --- what post-processing needs --------------------------------------------------------------

    def context_position(self, index: int) -> int:
        """Position of the window's first context token in the input sequence."""
        return len(self._question_ids[self.features[index].example_index]) + 2

    def context_offsets(self, index: int) -> np.ndarray:
        """(doc_length, 2) character [start, end) of each context token of the window in the context."""
        f = self.features[index]
        return self._offsets[self._paragraph[f.example_index]][
            f.doc_start : f.doc_start + f.doc_length
        ]

    def token_is_max_context(self, index: int) -> np.ndarray:
        """(doc_length,) bool: this window is where each of its context tokens has the most context."""
        f = self.features[index]
        return max_context_mask(self._windows[f.example_index], f.window)

    def offset_mapping(self, index: int) -> list[tuple[int, int] | None]:
        """Character span in the context of every input position; None outside the context (as the
        ``offset_mapping`` of Hugging Face's ``run_qa.py`` after its post-processing mask)."""
        first, offsets = self.context_position(index), self.context_offsets(index)
        mapping: list[tuple[int, int] | None] = [None] * self.max_seq_length
        for i, (s, e) in enumerate(offsets.tolist()):
            mapping[first + i] = (s, e)
        return mapping

    def example_id(self, index: int) -> str:
        return self.examples[self.features[index].example_index].id


def squad_collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack :class:`SquadFeatures` items (already padded to one length) into a dict batch."""
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def load_squad_splits(
    train_file: str | os.PathLike[str] = "data/squad/train-v1.1.json",
    dev_file: str | os.PathLike[str] = "data/squad/dev-v1.1.json",
    vocab_file: str | os.PathLike[str] = "data/bert/vocab.txt",
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    lowercase: bool = True,
) -> DataSplits:
    """Dataset builder (``dataset=squad``): training features of ``train_file`` and evaluation features of
    ``dev_file``, tokenised with ``vocab_file`` (the vocabulary the model was pretrained with; defaults:
    NVIDIA run_squad.py's 384 / 128 / 64 and an uncased vocabulary).

    Returns:
        :class:`~kfac_bench.data.base.DataSplits` of two :class:`SquadFeatures` (training, evaluation) and
        :func:`squad_collate`.
    """
    tokenizer = load_squad_tokenizer(vocab_file, lowercase)
    sizes = {
        "max_seq_length": max_seq_length,
        "doc_stride": doc_stride,
        "max_query_length": max_query_length,
    }
    train = SquadFeatures(read_squad(train_file), tokenizer, training=True, **sizes)
    val = SquadFeatures(read_squad(dev_file), tokenizer, training=False, **sizes)
    return DataSplits(train, val, squad_collate)
