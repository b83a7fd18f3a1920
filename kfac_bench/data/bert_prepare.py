"""Build NVIDIA-format BERT pretraining shards from plain text (behind ``kfac-bench prepare-bert``).

Input text follows Google's ``create_pretraining_data.py`` convention: one sentence per line, documents
separated by blank lines. The steps, each as in Google's/NVIDIA's script so that shards are
interchangeable with theirs:

1. WordPiece tokenisation with ``tokenizers``' ``BertWordPieceTokenizer``: either a given ``vocab.txt``
   or one made from the input and saved as ``OUTPUT/vocab.txt`` (see :mod:`kfac_bench.data.bert_corpus`).
2. Sentence pairs for next-sentence prediction: segment B is the real continuation of A, or (with
   probability 0.5, and always when the chunk holds a single sentence) a span of a random other
   document (label 1). 10 % of sequences get a shorter random target length.
3. Masked LM: ``min(max_predictions_per_seq, max(1, round(0.15 * len(tokens))))`` positions chosen among
   non-``[CLS]``/``[SEP]`` tokens; each becomes ``[MASK]`` (80 %), stays (10 %) or a random vocabulary
   id (10 %).
4. ``dupe_factor`` passes over the documents (different pairs and masks each), a global shuffle, and
   round-robin distribution over ``num_shards`` HDF5 files (layout in :mod:`kfac_bench.data.bert`).

Everything is drawn from one ``random.Random(seed)``, so a given vocabulary, input and seed always give
the same shards (a vocabulary trained with ``tokenizers``' WordPiece trainer can differ between runs; the
``frequency`` trainer cannot). A held-out fraction of *documents* can be written to ``OUTPUT/heldout``
for evaluation. The input is read a line at a time and tokenised in batches, keeping only token ids
(a line longer than :data:`~kfac_bench.data.bert_corpus.MAX_LINE_CHARS` is refused); all instances are
kept in memory, so for a Wikipedia-sized corpus run the command once per text shard (as NVIDIA does)
with the same ``--vocab-file`` and different seeds.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from kfac_bench import safe_files
from kfac_bench.data.bert import HELDOUT_SUBDIR
from kfac_bench.data.bert_corpus import (
    Document,
    Vocab,
    count_documents,
    load_tokenizer,
    tokenize_files,
    train_tokenizer,
    vocab_ids,
)
from kfac_bench.errors import ConfigError, DatasetError

#: HDF5 dtypes of NVIDIA's writer.
SHARD_DTYPES = {
    "input_ids": "i4",
    "input_mask": "i1",
    "segment_ids": "i1",
    "masked_lm_positions": "i4",
    "masked_lm_ids": "i4",
    "next_sentence_labels": "i1",
}


@dataclass
class Instance:
    """One pretraining example before padding.

    ``tokens`` is ``[CLS] A [SEP] B [SEP]`` after masking; ``masked_positions`` is ascending and
    ``masked_labels[i]`` is the original id at ``masked_positions[i]``.
    """

    tokens: list[int]
    segment_ids: list[int]
    is_random_next: bool
    masked_positions: list[int]
    masked_labels: list[int]


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare_shards` wrote."""

    shards: list[Path]
    heldout_shards: list[Path]
    vocab_file: Path
    vocab_size: int
    num_examples: int
    num_heldout_examples: int


def truncate_seq_pair(a: list[int], b: list[int], max_num_tokens: int, rng: random.Random) -> None:
    """Trim the longer of ``a``/``b`` from a random end until both fit in ``max_num_tokens``."""
    while len(a) + len(b) > max_num_tokens:
        longer = a if len(a) > len(b) else b
        # Trimming either end avoids a bias towards sequences that always end at a sentence end.
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def mask_tokens(
    tokens: list[int],
    vocab: Vocab,
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    rng: random.Random,
) -> tuple[list[int], list[int], list[int]]:
    """Apply the 80/10/10 masking rule.

    Returns:
        (masked tokens, ascending masked positions, original ids at those positions).
    """
    candidates = [i for i, t in enumerate(tokens) if t not in (vocab.cls, vocab.sep)]
    rng.shuffle(candidates)
    num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))
    output = list(tokens)
    chosen = sorted(candidates[:num_to_predict])
    for index in candidates[:num_to_predict]:
        if rng.random() < 0.8:
            output[index] = vocab.mask
        elif rng.random() < 0.5:
            output[index] = tokens[index]
        else:
            output[index] = rng.randint(0, vocab.size - 1)
    return output, chosen, [tokens[i] for i in chosen]


def instances_from_document(
    documents: Sequence[Document],
    doc_index: int,
    vocab: Vocab,
    max_seq_length: int,
    max_predictions_per_seq: int,
    masked_lm_prob: float,
    short_seq_prob: float,
    rng: random.Random,
) -> list[Instance]:
    """Sentence-pair instances from one document (Google's ``create_instances_from_document``)."""
    document = documents[doc_index]
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    target_length = max_num_tokens
    if rng.random() < short_seq_prob:
        # Shorter sequences now and then so the model also sees lengths it meets when fine-tuned.
        target_length = rng.randint(2, max_num_tokens)
    instances: list[Instance] = []
    chunk: list[Sequence[int]] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for s in chunk[:a_end] for t in s]
            tokens_b: list[int] = []
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                target_b_length = target_length - len(tokens_a)
                other = doc_index
                for _ in range(10):
                    other = rng.randint(0, len(documents) - 1)
                    if other != doc_index:
                        break
                random_doc = documents[other]
                for sentence in random_doc[rng.randint(0, len(random_doc) - 1) :]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target_b_length:
                        break
                # The unused sentences of this chunk start the next chunk instead of being wasted.
                i -= len(chunk) - a_end
            else:
                tokens_b = [t for s in chunk[a_end:] for t in s]
            truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            tokens = [vocab.cls, *tokens_a, vocab.sep, *tokens_b, vocab.sep]
            segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
            masked, positions, labels = mask_tokens(
                tokens, vocab, masked_lm_prob, max_predictions_per_seq, rng
            )
            instances.append(Instance(masked, segment_ids, is_random_next, positions, labels))
            chunk, chunk_length = [], 0
        i += 1
    return instances


def create_instances(
    documents: Sequence[Document],
    vocab: Vocab,
    max_seq_length: int,
    max_predictions_per_seq: int,
    dupe_factor: int,
    rng: random.Random,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
) -> list[Instance]:
    """``dupe_factor`` passes of :func:`instances_from_document` over all documents, shuffled."""
    if len(documents) < 2:
        raise DatasetError("input", "at least two documents (separated by a blank line) for NSP")
    instances: list[Instance] = []
    for _ in range(dupe_factor):
        for doc_index in range(len(documents)):
            instances.extend(
                instances_from_document(
                    documents,
                    doc_index,
                    vocab,
                    max_seq_length,
                    max_predictions_per_seq,
                    masked_lm_prob,
                    short_seq_prob,
                    rng,
                )
            )
    rng.shuffle(instances)
    return instances


def write_shard(
    folder: safe_files.Folder,
    name: str,
    instances: Sequence[Instance],
    vocab: Vocab,
    max_seq_length: int,
    max_predictions_per_seq: int,
) -> Path:
    """Pad ``instances`` and write them as one NVIDIA-layout HDF5 shard ``name`` of ``folder`` (gzip,
    NVIDIA's dtypes): an unpredictable temporary file renamed into place, so a crash never leaves a
    half-written shard that the reader would pick up, and a link at the name is never written through."""
    n = len(instances)
    arrays: dict[str, np.ndarray] = {
        "input_ids": np.full((n, max_seq_length), vocab.pad, dtype=np.int32),
        "input_mask": np.zeros((n, max_seq_length), dtype=np.int8),
        "segment_ids": np.zeros((n, max_seq_length), dtype=np.int8),
        "masked_lm_positions": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "masked_lm_ids": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "next_sentence_labels": np.zeros((n,), dtype=np.int8),
    }
    for row, inst in enumerate(instances):
        length, num_masked = len(inst.tokens), len(inst.masked_positions)
        arrays["input_ids"][row, :length] = inst.tokens
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, :length] = inst.segment_ids
        arrays["masked_lm_positions"][row, :num_masked] = inst.masked_positions
        arrays["masked_lm_ids"][row, :num_masked] = inst.masked_labels
        arrays["next_sentence_labels"][row] = int(inst.is_random_next)
    fd, tmp = folder.temp(name, read=True)  # HDF5 reads back what it wrote
    try:
        with os.fdopen(fd, "w+b") as raw:
            with h5py.File(raw, "w") as f:
                for key, dtype in SHARD_DTYPES.items():
                    f.create_dataset(key, data=arrays[key], dtype=dtype, compression="gzip")
            raw.flush()
        folder.rename(tmp, name)
    except BaseException:
        folder.unlink(tmp)
        raise
    return folder / name


def _write_shards(
    out: safe_files.Folder,
    instances: Sequence[Instance],
    num_shards: int,
    vocab: Vocab,
    seq: int,
    preds: int,
) -> list[Path]:
    if len(instances) < num_shards:
        raise ConfigError(
            f"only {len(instances)} examples for {num_shards} shards in {out.path}: "
            "lower --num-shards or add text"
        )
    paths = []
    path = out.path
    try:
        for k in range(num_shards):
            path = out / f"part-{k:05d}-of-{num_shards:05d}.hdf5"
            paths.append(write_shard(out, path.name, instances[k::num_shards], vocab, seq, preds))
    except OSError as err:  # a full disk, a quota, a file where the heldout folder goes
        raise ConfigError(
            f"cannot write {path} ({err.strerror or err}): free space, move what is in the way, "
            "or pass another --output-dir"
        ) from None
    return paths


def _check_args(
    max_seq_length: int,
    max_predictions_per_seq: int,
    masked_lm_prob: float,
    dupe_factor: int,
    num_shards: int,
    heldout: float,
    short_seq_prob: float,
    vocab_size: int,
) -> None:
    if max_seq_length < 8:
        raise ConfigError(f"max_seq_length must be at least 8, got {max_seq_length}")
    if not 1 <= max_predictions_per_seq <= max_seq_length:
        raise ConfigError(
            f"max_predictions_per_seq must be in [1, max_seq_length], got {max_predictions_per_seq}"
        )
    if dupe_factor < 1 or num_shards < 1:
        raise ConfigError("dupe_factor and num_shards must be at least 1")
    if not 0.0 < masked_lm_prob <= 1.0:
        raise ConfigError(f"masked_lm_prob must be in (0, 1], got {masked_lm_prob}")
    if not 0.0 <= heldout < 1.0:
        raise ConfigError(f"heldout_fraction must be in [0, 1), got {heldout}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ConfigError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be at least 1, got {vocab_size}")


def _make_output_dir(out: Path) -> safe_files.Folder:
    """``out`` (created with its parents), open, after a probe that it takes files; or one line why not."""
    try:
        folder = safe_files.Folder.open(out, create=True, follow=True)
    except safe_files.LinkRefused:
        raise ConfigError(
            f"--output-dir {out} is not a directory: pass a writable directory (it is created if missing)"
        ) from None
    except OSError as err:
        raise ConfigError(
            f"--output-dir {out} cannot be used ({err.strerror or err}): "
            "pass a writable directory (it is created if missing)"
        ) from None
    try:
        fd, probe = folder.temp("prepare-bert.probe")
        os.close(fd)
        folder.unlink(probe)
    except OSError as err:
        folder.close()
        raise ConfigError(
            f"--output-dir {out} cannot be used ({err.strerror or err}): "
            "pass a writable directory (it is created if missing)"
        ) from None
    return folder


def prepare_shards(
    input_files: Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    *,
    vocab_file: str | os.PathLike[str] | None = None,
    vocab_size: int = 30522,
    max_seq_length: int = 128,
    max_predictions_per_seq: int = 20,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    dupe_factor: int = 5,
    num_shards: int = 1,
    seed: int = 12345,
    heldout_fraction: float = 0.0,
    heldout_shards: int = 1,
    lowercase: bool = True,
    vocab_trainer: str = "wordpiece",
    overwrite: bool = False,
) -> PrepareResult:
    """Tokenise, pair, mask and shard ``input_files`` into ``output_dir`` (see the module docstring).

    Training shards go to ``output_dir/part-*.hdf5``; with ``heldout_fraction > 0`` that fraction of the
    documents (at least two) goes to ``output_dir/heldout/part-*.hdf5`` instead. Without ``vocab_file`` a
    vocabulary of at most ``vocab_size`` tokens is made from the input by ``vocab_trainer``
    (``"wordpiece"`` or ``"frequency"``, see :mod:`kfac_bench.data.bert_corpus`) and saved as
    ``output_dir/vocab.txt``.

    Raises:
        ConfigError: bad sizes, an ``output_dir`` that cannot be created or written, a ``vocab_size``
            smaller than the vocabulary the corpus needs, or shards already in ``output_dir`` and not
            ``overwrite``.
        DatasetError: a missing, unreadable or non-UTF-8 input or vocab file, an input line longer than
            ``MAX_LINE_CHARS``, or fewer than two documents per split.
    """
    _check_args(
        max_seq_length,
        max_predictions_per_seq,
        masked_lm_prob,
        dupe_factor,
        num_shards,
        heldout_fraction,
        short_seq_prob,
        vocab_size,
    )
    out = Path(output_dir)
    if vocab_file is not None:
        load_tokenizer(vocab_file, lowercase)  # a bad vocabulary stops the command before any work
    old = _old_shards(out, overwrite)
    count_documents(input_files)  # every input file is UTF-8 text of bounded lines
    with _make_output_dir(out) as folder:
        return _prepare(
            folder, input_files, old, vocab_file, vocab_size, (max_seq_length, max_predictions_per_seq),
            (masked_lm_prob, short_seq_prob, dupe_factor), num_shards, seed, heldout_fraction,
            heldout_shards, lowercase, vocab_trainer,
        )  # fmt: skip


def _prepare(
    folder: safe_files.Folder,
    input_files: Sequence[str | os.PathLike[str]],
    old: list[tuple[str, str]],
    vocab_file: str | os.PathLike[str] | None,
    vocab_size: int,
    sizes: tuple[int, int],
    masking: tuple[float, float, int],
    num_shards: int,
    seed: int,
    heldout_fraction: float,
    heldout_shards: int,
    lowercase: bool,
    vocab_trainer: str,
) -> PrepareResult:
    """:func:`prepare_shards` once its arguments are checked and ``folder`` is open."""
    out = folder.path
    masked_lm_prob, short_seq_prob, dupe_factor = masking
    if vocab_file is None:
        tokenizer, vocab_path = train_tokenizer(
            input_files, vocab_size, out, lowercase, vocab_trainer
        )
    else:
        tokenizer, vocab_path = load_tokenizer(vocab_file, lowercase), Path(vocab_file)
    vocab = vocab_ids(tokenizer)
    documents = tokenize_files(tokenizer, input_files)
    rng = random.Random(seed)
    rng.shuffle(documents)
    num_heldout = max(2, round(heldout_fraction * len(documents))) if heldout_fraction > 0 else 0
    heldout_docs, train_docs = documents[:num_heldout], documents[num_heldout:]
    train = create_instances(
        train_docs, vocab, *sizes, dupe_factor, rng, masked_lm_prob, short_seq_prob
    )
    for sub, name in old:  # only now: a failure above leaves the previous shards as they were
        if sub:
            with folder.sub(sub, create=False) as d:  # a link planted at heldout/ is refused
                d.unlink(name)
        else:
            folder.unlink(name)
    shards = _write_shards(folder, train, num_shards, vocab, *sizes)
    heldout_paths: list[Path] = []
    heldout: list[Instance] = []
    if num_heldout:
        heldout = create_instances(
            heldout_docs, vocab, *sizes, dupe_factor, rng, masked_lm_prob, short_seq_prob
        )
        with folder.sub(HELDOUT_SUBDIR) as held:
            heldout_paths = _write_shards(held, heldout, heldout_shards, vocab, *sizes)
    return PrepareResult(shards, heldout_paths, vocab_path, vocab.size, len(train), len(heldout))


def is_own_output(name: str) -> bool:
    """Whether ``name`` (in an output folder) is something this module writes: a shard, the held-out
    folder, the vocabulary, a temporary file a killed run left."""
    return (
        _is_shard_name(name)
        or name in (HELDOUT_SUBDIR, "vocab.txt")
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def _is_shard_name(name: str) -> bool:
    return name.endswith((".hdf5", ".h5"))


def _old_shards(out: Path, overwrite: bool) -> list[tuple[str, str]]:
    """(sub-folder, name) of the shards a previous run left in ``out`` and its held-out folder (the
    reader would mix them with the new ones); names only, read without following a link."""
    old: list[tuple[str, str]] = []
    for sub in ("", HELDOUT_SUBDIR):
        # No directory there: nothing old (a link at heldout/ is refused: LinkRefused).
        gone = (FileNotFoundError, NotADirectoryError) + (() if sub else (safe_files.LinkRefused,))
        with (
            contextlib.suppress(*gone),
            safe_files.Folder.open(out / sub if sub else out, follow=not sub) as d,
        ):
            old += [(sub, n) for n in d.names() if _is_shard_name(n) and d.is_file(n)]
    if old and not overwrite:
        raise ConfigError(
            f"{out} already holds {len(old)} shard files: pass --overwrite or use a new --output-dir"
        )
    return old
