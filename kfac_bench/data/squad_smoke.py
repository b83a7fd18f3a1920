"""A tiny SQuAD v1.1 data set made from Python's own documentation, for smoke runs and tests.

:func:`write_pydoc_squad` writes ``train-v1.1.json`` and ``dev-v1.1.json`` in the official format from the
documents of :func:`kfac_bench.data.bert_corpus.pydoc_documents` (``pydoc_data.topics``, standard
library): each document, cut to ``max_context_words`` words, is a context; each question is one of its
sentences with a span of one to three words replaced by "what", and that span (a real span of the
context, ``answer_start`` exact) is the answer. Development questions carry a second, longer answer as
the official development file carries several. Many contexts are longer than a 384-token window, so the
sliding window is exercised. The output depends only on the Python version's documentation and ``seed``.

:func:`pydoc_vocab` writes the vocabulary of the BERT smoke shards
(:func:`kfac_bench.data.bert_smoke.prepare_pydoc_shards`: the same corpus, the same deterministic
``frequency`` trainer), so a model pretrained by the smoke recipes reads these questions with the
vocabulary it was trained with.

:func:`build_squad_pydoc` is the dataset builder of the SQuAD smoke recipe: it writes both files and the
vocabulary into its own ``root`` on first use (never into the pretraining shards' folder) and reads them
through :func:`kfac_bench.data.squad.load_squad_splits`, as the real files are read.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kfac_bench import safe_files
from kfac_bench.data.base import DataSplits
from kfac_bench.data.bert_corpus import pydoc_documents, train_tokenizer, write_pydoc_corpus
from kfac_bench.data.squad import load_squad_splits
from kfac_bench.errors import ConfigError

__all__ = [
    "MARKER",
    "SmokeSquadFiles",
    "build_squad_pydoc",
    "pydoc_squad_articles",
    "pydoc_vocab",
    "write_pydoc_squad",
]

#: Written last into ``root`` by :func:`build_squad_pydoc`: the arguments its files were made with.
MARKER = "squad_pydoc.json"

# A word: letters/digits, possibly joined by apostrophes or hyphens ("don't", "built-in").
_WORD = re.compile(r"\w+(?:['-]\w+)*")
_ARTICLES = ("a", "an", "the")


class SmokeSquadFiles(NamedTuple):
    train: Path
    dev: Path


def _context(sentences: list[str], max_words: int) -> list[str]:
    kept: list[str] = []
    words = 0
    for sentence in sentences:
        if kept and words + len(sentence.split()) > max_words:
            break
        kept.append(sentence)
        words += len(sentence.split())
    return kept


def _qa(
    qid: str, context: str, sentence_start: int, sentence: str, rng: random.Random, dev: bool
) -> dict[str, Any] | None:
    """A question on ``sentence`` (at ``sentence_start`` in ``context``), or None if it has too few words."""
    words = [(m.start(), m.end()) for m in _WORD.finditer(sentence)]
    if len(words) < 4:
        return None
    length = rng.randint(1, 3)
    # Never start at an article: an answer such as "The" normalises to nothing and scores 0 even when
    # predicted exactly (evaluate-v1.1.py's F1).
    starts = [
        i
        for i in range(len(words) - length + 1)
        if sentence[words[i][0] : words[i][1]].lower() not in _ARTICLES
    ]
    if not starts:
        return None
    first = rng.choice(starts)
    begin, end = words[first][0], words[first + length - 1][1]
    question = (sentence[:begin] + "what" + sentence[end:]).rstrip(" .!?:;,") + "?"
    answers = [{"text": sentence[begin:end], "answer_start": sentence_start + begin}]
    if dev and first + length < len(words):  # a second annotator's longer span
        wider = words[first + length][1]
        answers.append({"text": sentence[begin:wider], "answer_start": sentence_start + begin})
    return {"id": qid, "question": question, "answers": answers}


def pydoc_squad_articles(
    dev: bool,
    seed: int = 12345,
    max_context_words: int = 400,
    questions_per_context: int = 4,
    dev_every: int = 5,
) -> list[dict[str, Any]]:
    """The ``data`` list of the smoke training (``dev=False``) or development file.

    Document ``i`` goes to the development file when ``i % dev_every == dev_every - 1``.
    """
    rng = random.Random(f"{seed}-{'dev' if dev else 'train'}")
    articles = []
    for d, sentences in enumerate(pydoc_documents()):
        if (d % dev_every == dev_every - 1) != dev:
            continue
        kept = _context(sentences, max_context_words)
        context = " ".join(kept)
        starts = [sum(len(s) + 1 for s in kept[:i]) for i in range(len(kept))]
        chosen = sorted(rng.sample(range(len(kept)), min(questions_per_context, len(kept))))
        qas = [
            qa
            for n, i in enumerate(chosen)
            if (qa := _qa(f"pydoc-{d:03d}-{n}", context, starts[i], kept[i], rng, dev)) is not None
        ]
        if qas:
            articles.append(
                {
                    "title": f"pydoc_data.topics {d}",
                    "paragraphs": [{"context": context, "qas": qas}],
                }
            )
    return articles


def write_pydoc_squad(
    output_dir: str | os.PathLike[str],
    seed: int = 12345,
    max_context_words: int = 400,
    questions_per_context: int = 4,
) -> SmokeSquadFiles:
    """Write ``output_dir/train-v1.1.json`` and ``output_dir/dev-v1.1.json`` (see the module docstring).

    About 60 training and 15 development contexts with up to ``questions_per_context`` questions each.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = SmokeSquadFiles(out / "train-v1.1.json", out / "dev-v1.1.json")
    for path, dev in ((files.train, False), (files.dev, True)):
        data = pydoc_squad_articles(dev, seed, max_context_words, questions_per_context)
        safe_files.write_atomic(path, json.dumps({"version": "1.1", "data": data}, indent=1))
    return files


def pydoc_vocab(output_dir: str | os.PathLike[str], vocab_size: int = 2000) -> Path:
    """Write the BERT smoke shards' vocabulary to ``output_dir/vocab.txt`` and return its path.

    It equals the ``vocab.txt`` that :func:`kfac_bench.data.bert_smoke.prepare_pydoc_shards` writes with
    the same ``vocab_size`` over all documents (its default, and the smoke recipes' setting).
    """
    out = Path(output_dir)
    corpus = write_pydoc_corpus(out / "pydoc_corpus.txt")
    _, path = train_tokenizer([corpus], vocab_size, out, lowercase=True, trainer="frequency")
    return path


def _prepare(root: Path, params: dict[str, Any]) -> None:
    """(Re)write the smoke files into ``root`` unless the marker says they were made with ``params``."""
    marker = root / MARKER
    made = json.loads(marker.read_text()) if marker.is_file() else None
    if made == params:
        return
    foreign = [p.name for p in (root / "train-v1.1.json", root / "vocab.txt") if p.is_file()]
    if made is None and (foreign or any(root.glob("*.hdf5"))):
        raise ConfigError(
            f"{root} holds files build_squad_pydoc did not make ({', '.join(foreign) or 'HDF5 shards'}): "
            "give the SQuAD smoke data its own empty dataset.root (e.g. data/squad_pydoc)"
        )
    marker.unlink(missing_ok=True)
    write_pydoc_squad(root, seed=params["seed"])
    pydoc_vocab(root, params["vocab_size"])
    safe_files.write_atomic(marker, json.dumps(params, indent=1))


def build_squad_pydoc(
    root: str = "data/squad_pydoc",
    vocab_size: int = 2000,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    seed: int = 12345,
) -> DataSplits:
    """Dataset builder (``dataset=squad_pydoc``) of the SQuAD smoke recipe.

    On first use (or when ``vocab_size`` or ``seed`` changed, as recorded in ``root/squad_pydoc.json``,
    written last) writes ``train-v1.1.json``, ``dev-v1.1.json`` (:func:`write_pydoc_squad`) and the smoke
    shards' ``vocab.txt`` (:func:`pydoc_vocab`) into ``root``; files this builder did not make are never
    replaced. Under torch.distributed rank 0 writes while the other ranks wait at a barrier. The model's
    ``vocab_size`` must be at least ``vocab_size``.

    Returns:
        The features of both files, as :func:`kfac_bench.data.squad.load_squad_splits` reads the real ones.
    """
    out = Path(root)
    params: dict[str, Any] = {"vocab_size": vocab_size, "seed": seed}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        _prepare(out, params)
    if distributed:
        torch.distributed.barrier()
    return load_squad_splits(
        out / "train-v1.1.json",
        out / "dev-v1.1.json",
        out / "vocab.txt",
        max_seq_length=max_seq_length,
        doc_stride=doc_stride,
        max_query_length=max_query_length,
    )
