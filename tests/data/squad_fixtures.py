"""Small SQuAD v1.1 files in the official format for the SQuAD tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from kfac_bench.data.squad_smoke import pydoc_vocab, write_pydoc_squad


class Smoke(NamedTuple):
    train: Path
    dev: Path
    vocab: Path


def make_smoke(root: Path) -> Smoke:
    """The pydoc smoke set and the smoke shards' 2000-token vocabulary under ``root``."""
    files = write_pydoc_squad(root)
    return Smoke(files.train, files.dev, pydoc_vocab(root))


def squad_json(articles: list[dict[str, Any]], version: Any = "1.1") -> dict[str, Any]:
    return {"version": version, "data": articles}


def one_article(context: str, qas: list[dict[str, Any]]) -> dict[str, Any]:
    return {"title": "t", "paragraphs": [{"context": context, "qas": qas}]}


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def write_vocab(path: Path, words: list[str]) -> Path:
    """A WordPiece ``vocab.txt``: the special tokens, then ``words``."""
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return path
