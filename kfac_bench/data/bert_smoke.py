"""BERT shards for smoke runs and tests, made from Python's bundled documentation on first use.

:func:`build_bert_pydoc` is the dataset builder of the BERT smoke recipes: the first run prepares
NVIDIA-format shards from ``pydoc_data.topics`` (see :mod:`kfac_bench.data.bert_corpus`) into ``root``
and later runs reuse them, so a smoke run needs neither a download nor a separate preparation step.
The deterministic ``frequency`` vocabulary keeps the shards identical from machine to machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from kfac_bench import safe_files
from kfac_bench.data.base import DataSplits
from kfac_bench.data.bert import build_bert_pretraining
from kfac_bench.data.bert_corpus import write_pydoc_corpus
from kfac_bench.data.bert_prepare import PrepareResult, prepare_shards
from kfac_bench.errors import ConfigError

__all__ = ["build_bert_pydoc", "prepare_pydoc_shards"]

MARKER = "pydoc_shards.json"


def prepare_pydoc_shards(
    output_dir: str | os.PathLike[str],
    *,
    max_documents: int | None = None,
    vocab_size: int = 2000,
    max_seq_length: int = 128,
    max_predictions_per_seq: int = 20,
    dupe_factor: int = 1,
    num_shards: int = 2,
    heldout_fraction: float = 0.1,
    seed: int = 12345,
    vocab_trainer: str = "frequency",
    overwrite: bool = False,
) -> PrepareResult:
    """Shards (and a vocabulary) from the English documentation that ships with Python.

    Writes the corpus to ``output_dir/pydoc_corpus.txt``, then calls
    :func:`kfac_bench.data.bert_prepare.prepare_shards` on it with these arguments. The full corpus
    (77 documents) gives about 400 examples of 128 tokens per ``dupe_factor``.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = write_pydoc_corpus(out / "pydoc_corpus.txt", max_documents=max_documents)
    return prepare_shards(
        [corpus],
        out,
        vocab_size=vocab_size,
        max_seq_length=max_seq_length,
        max_predictions_per_seq=max_predictions_per_seq,
        dupe_factor=dupe_factor,
        num_shards=num_shards,
        seed=seed,
        heldout_fraction=heldout_fraction,
        vocab_trainer=vocab_trainer,
        overwrite=overwrite,
    )


def build_bert_pydoc(
    root: str = "data/bert_pydoc",
    vocab_size: int = 2000,
    max_seq_length: int = 128,
    max_predictions_per_seq: int = 20,
    dupe_factor: int = 2,
    max_documents: int | None = None,
    seed: int = 12345,
) -> DataSplits:
    """Dataset builder (``dataset._target_``) of the smoke recipes: pydoc shards in ``root``.

    Shards are (re)prepared when ``root`` has none or was prepared with other arguments (recorded in
    ``root/pydoc_shards.json``, written last); shards this builder did not make are never replaced.
    Under torch.distributed rank 0 prepares while the other ranks wait at a barrier. The model's
    ``vocab_size`` must be at least this ``vocab_size``.

    Returns:
        Training shards of ``root`` and held-out shards of ``root/heldout`` (10 % of the documents).
    """
    params: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_seq_length": max_seq_length,
        "max_predictions_per_seq": max_predictions_per_seq,
        "dupe_factor": dupe_factor,
        "max_documents": max_documents,
        "seed": seed,
    }
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        marker = Path(root) / MARKER
        if not marker.is_file() and any(Path(root).glob("*.hdf5")):
            raise ConfigError(
                f"{root} holds shards that build_bert_pydoc did not make: use an empty dataset.root for "
                "the pydoc smoke data, or the bert_pretraining dataset for these shards"
            )
        if not marker.is_file() or json.loads(marker.read_text()) != params:
            marker.unlink(missing_ok=True)
            prepare_pydoc_shards(root, overwrite=True, **params)
            safe_files.write_atomic(marker, json.dumps(params, indent=1))
    if distributed:
        torch.distributed.barrier()
    return build_bert_pretraining(root)
