"""The text side of BERT shard preparation: corpora, WordPiece vocabularies, tokenisation.

Corpus format (Google's ``create_pretraining_data.py``): one sentence per line, documents separated by a
blank line. :func:`write_pydoc_corpus` makes such a corpus of real English from Python's own documentation
(``pydoc_data.topics``, standard library), so tests and smoke runs need no download.

Vocabularies are BERT ``vocab.txt`` files read by ``tokenizers``' ``BertWordPieceTokenizer``. Two ways to
make one from the corpus:

* ``"wordpiece"``: ``tokenizers``' WordPiece trainer (the subword vocabulary BERT uses). Its merges break
  ties in hash-map order, so two runs on the same text can give slightly different vocabularies.
* ``"frequency"``: special tokens, every character (plain and ``##``-prefixed, so any word can be
  spelt), then the most frequent whole words, ties by spelling. Deterministic; for tests and smoke runs.

Either way the vocabulary is saved beside the shards; passing it back with ``--vocab-file`` reproduces them.
"""

from __future__ import annotations

import os
import re
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import BertWordPieceTokenizer

from kfac_bench import safe_files
from kfac_bench.errors import ConfigError, DatasetError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB_TRAINERS = ("wordpiece", "frequency")

Document = list["array[int]"]  # sentences of token ids (4 bytes each, however long the corpus)
#: The longest line (characters) read from a corpus: one sentence per line is the format, and a line far
#: longer is not a sentence (a file with no line breaks, or not text). Reading stops at this length, so a
#: huge line costs no more memory than this.
MAX_LINE_CHARS = 1 << 20
#: Characters of text tokenised at once (the tokenizer's encodings of a batch take ~100x its text).
_TOKENIZE_BATCH_CHARS = 1 << 20


@dataclass(frozen=True)
class Vocab:
    """Ids the instance builder needs from the tokenizer's vocabulary."""

    size: int
    pad: int
    cls: int
    sep: int
    mask: int


def corpus_lines(paths: Sequence[str | os.PathLike[str]]) -> Iterator[str]:
    """The stripped lines of text files, read one at a time, with ``""`` for a document break (a blank
    line or a file's end).

    Raises:
        DatasetError: a file that is missing or unreadable, not UTF-8 text, or holds a line longer than
            :data:`MAX_LINE_CHARS` (one line naming the file and line).
    """
    expected = "a UTF-8 text file with one sentence per line (documents separated by blank lines)"
    for path in paths:
        if not Path(path).is_file():
            raise DatasetError(path, expected)
        number = 0
        try:
            with open(path, encoding="utf-8") as f:
                while line := f.readline(MAX_LINE_CHARS + 1):
                    number += 1
                    if len(line) > MAX_LINE_CHARS:
                        raise DatasetError(
                            path,
                            f"{expected}; line {number} is longer than {MAX_LINE_CHARS:,} characters: "
                            "split the text into sentences, one per line",
                        )
                    yield line.strip()
        except UnicodeDecodeError:
            raise DatasetError(
                path, f"{expected}; near line {number + 1} it is not UTF-8"
            ) from None
        except OSError as err:
            raise DatasetError(path, f"{expected}; it cannot be read ({err.strerror})") from None
        yield ""


def count_documents(paths: Sequence[str | os.PathLike[str]]) -> int:
    """How many documents the text files hold, read as :func:`corpus_lines` reads them (a check of the
    input before anything is built from it)."""
    count, open_doc = 0, False
    for line in corpus_lines(paths):
        if line and not open_doc:
            count += 1
        open_doc = bool(line)
    return count


def load_tokenizer(
    vocab_file: str | os.PathLike[str], lowercase: bool = True
) -> BertWordPieceTokenizer:
    """A WordPiece tokenizer over an existing BERT ``vocab.txt``.

    Raises:
        DatasetError: the file is missing, not UTF-8 text, or lacks one of :data:`SPECIAL_TOKENS`.
    """
    expected = "a WordPiece vocab.txt (UTF-8, one token per line, with " + " ".join(SPECIAL_TOKENS)
    if not Path(vocab_file).is_file():
        raise DatasetError(vocab_file, expected + ")")
    try:
        tokens = set(Path(vocab_file).read_text(encoding="utf-8").splitlines())
    except UnicodeDecodeError:
        raise DatasetError(vocab_file, expected + "); it is not UTF-8 text") from None
    except OSError as err:
        raise DatasetError(
            vocab_file, expected + f"); it cannot be read ({err.strerror})"
        ) from None
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise DatasetError(vocab_file, expected + f"); it lacks {', '.join(missing)}")
    return BertWordPieceTokenizer(str(vocab_file), lowercase=lowercase)


def _frequency_vocab(
    files: Sequence[str | os.PathLike[str]], vocab_size: int, lowercase: bool
) -> list[str]:
    splitter = BertWordPieceTokenizer(lowercase=lowercase)  # only its normaliser and pre-tokeniser
    assert splitter.normalizer is not None and splitter.pre_tokenizer is not None
    counts: Counter[str] = Counter()
    for line in corpus_lines(files):
        text = splitter.normalizer.normalize_str(line)
        counts.update(w for w, _ in splitter.pre_tokenizer.pre_tokenize_str(text))
    chars = sorted({c for word in counts for c in word})
    base = [*SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)]
    if len(base) > vocab_size:
        raise ConfigError(
            f"vocab_size {vocab_size} is smaller than the {len(base)} special tokens and characters "
            "of the corpus: raise --vocab-size"
        )
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    return base + words[: vocab_size - len(base)]


def train_tokenizer(
    files: Sequence[str | os.PathLike[str]],
    vocab_size: int,
    output_dir: str | os.PathLike[str],
    lowercase: bool = True,
    trainer: str = "wordpiece",
) -> tuple[BertWordPieceTokenizer, Path]:
    """Make a vocabulary of at most ``vocab_size`` tokens from ``files``, save it as
    ``output_dir/vocab.txt`` and return a tokenizer over it (``trainer``: see the module docstring)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if trainer == "wordpiece":
        tokenizer = BertWordPieceTokenizer(lowercase=lowercase)
        tokenizer.train(
            [str(f) for f in files],
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
        )
        if tokenizer.get_vocab_size() > vocab_size:
            # The trainer keeps every character of the corpus whatever vocab_size asks for.
            raise ConfigError(
                f"vocab_size {vocab_size} is smaller than the {tokenizer.get_vocab_size()} tokens "
                "(special tokens and the corpus's characters) WordPiece needs: raise --vocab-size"
            )
        with (
            tempfile.TemporaryDirectory() as private
        ):  # the tokenizer writes by path: a private folder
            (saved,) = tokenizer.save_model(private)
            vocab_path = safe_files.write_atomic(out / "vocab.txt", Path(saved).read_bytes())
    elif trainer == "frequency":
        vocab_path = safe_files.write_atomic(
            out / "vocab.txt", "\n".join(_frequency_vocab(files, vocab_size, lowercase)) + "\n"
        )
    else:
        raise ConfigError(
            f"unknown vocab trainer '{trainer}': use one of {', '.join(VOCAB_TRAINERS)}"
        )
    # Reload from the file so this run and a later --vocab-file run tokenise identically.
    return load_tokenizer(vocab_path, lowercase), vocab_path


def vocab_ids(tokenizer: BertWordPieceTokenizer) -> Vocab:
    """The special-token ids of ``tokenizer``; raises if the vocabulary lacks one."""
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise DatasetError("vocab.txt", f"a vocabulary containing {', '.join(missing)}")
    return Vocab(
        tokenizer.get_vocab_size(), ids["[PAD]"], ids["[CLS]"], ids["[SEP]"], ids["[MASK]"]
    )


def tokenize_files(
    tokenizer: BertWordPieceTokenizer, paths: Sequence[str | os.PathLike[str]]
) -> list[Document]:
    """Token ids per sentence per document of the text files (sentences and documents that tokenise to
    nothing are dropped), streamed: lines are read (:func:`corpus_lines`) and tokenised a batch of about a
    million characters at a time, and only the ids are kept, so memory grows with the corpus's tokens,
    not with its text or the tokenizer's encodings."""
    out: list[Document] = []
    current: Document = []
    batch: list[str] = []  # lines waiting, "" for a document break
    chars = 0

    def flush() -> None:
        nonlocal current
        text = [line for line in batch if line]
        encoded = iter(tokenizer.encode_batch(text, add_special_tokens=False)) if text else iter(())
        for line in batch:
            if not line:
                if current:
                    out.append(current)
                current = []
                continue
            ids = next(encoded).ids
            if ids:
                current.append(array("i", ids))
        batch.clear()

    for line in corpus_lines(paths):
        batch.append(line)
        chars += len(line)
        if chars >= _TOKENIZE_BATCH_CHARS:
            flush()
            chars = 0
    flush()
    if current:
        out.append(current)
    return out


# --- Python's documentation as an English corpus ------------------------------------------------

# A sentence ends at . ! or ? followed by whitespace and an upper-case letter or an opening quote.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")
_MIN_WORDS = 3


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running text: not indented (code, grammar), not tables, not headings."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        first = lines[0]
        if not first.strip() or first[0].isspace() or first.lstrip()[0] in "+|":
            continue
        if any(_UNDERLINE.match(line.strip()) for line in lines):
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


def pydoc_documents(max_documents: int | None = None) -> list[list[str]]:
    """Documents (lists of sentences) from ``pydoc_data.topics``: one per help topic, sorted by topic.

    The full set is 77 documents, ~2,200 sentences, ~37,000 words.

    Args:
        max_documents: keep only the first this many documents (small corpora for tests).
    """
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        sentences = [
            s.strip()
            for paragraph in _prose_paragraphs(topics[name])
            for s in _SENTENCE_END.split(paragraph)
            if len(s.split()) >= _MIN_WORDS
        ]
        if len(sentences) >= 2:  # a one-sentence document cannot give a real next sentence
            documents.append(sentences)
        if max_documents is not None and len(documents) >= max_documents:
            break
    return documents


def write_pydoc_corpus(path: str | os.PathLike[str], max_documents: int | None = None) -> Path:
    """Write :func:`pydoc_documents` as a corpus file (one sentence per line, a blank line between
    documents) and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join("\n".join(doc) for doc in pydoc_documents(max_documents))
    safe_files.write_atomic(out, text + "\n")
    return out
