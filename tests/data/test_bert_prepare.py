"""Shard preparation: NVIDIA's HDF5 layout, masking and NSP statistics, determinism, the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from kfac_bench.commands.prepare_bert import main
from kfac_bench.data.bert_corpus import SPECIAL_TOKENS, pydoc_documents, write_pydoc_corpus
from kfac_bench.data.bert_prepare import prepare_shards
from kfac_bench.data.bert_smoke import prepare_pydoc_shards
from kfac_bench.errors import ConfigError, DatasetError

SEQ, PREDS = 128, 20  # the paper's phase 1
PAD, UNK, CLS, SEP, MASK = range(5)  # the order every vocabulary made here starts with
EXPECTED_DTYPES = {
    "input_ids": np.int32,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int32,
    "masked_lm_ids": np.int32,
    "next_sentence_labels": np.int8,
}


def read_all(paths: list[Path]) -> dict[str, np.ndarray]:
    """Every dataset of every shard, concatenated, read with plain h5py."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in EXPECTED_DTYPES}
    for path in paths:
        with h5py.File(path, "r") as f:
            for key in out:
                out[key].append(f[key][:])
    return {k: np.concatenate(v) for k, v in out.items()}


def unmasked_ids(a: dict[str, np.ndarray]) -> np.ndarray:
    """``input_ids`` with the original token put back at every masked position."""
    ids = a["input_ids"].copy()
    real = a["masked_lm_positions"] != 0
    ids[np.nonzero(real)[0], a["masked_lm_positions"][real]] = a["masked_lm_ids"][real]
    return ids


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    return prepare_pydoc_shards(
        tmp_path_factory.mktemp("bert"),
        max_documents=40,
        vocab_size=1000,
        max_seq_length=SEQ,
        max_predictions_per_seq=PREDS,
        dupe_factor=3,
        num_shards=3,
        heldout_fraction=0.1,
    )


def test_pydoc_corpus_is_english_documents(tmp_path: Path) -> None:
    docs = pydoc_documents()
    assert len(docs) > 50 and sum(len(d) for d in docs) > 1500
    path = write_pydoc_corpus(tmp_path / "c.txt", max_documents=3)
    blocks = path.read_text().strip().split("\n\n")
    assert len(blocks) == 3
    for block in blocks:
        for line in block.splitlines():
            assert len(line.split()) >= 3 and not line.startswith(" ")
    assert (
        "The simple form" in path.read_text()
    )  # from the 'assert' topic, the first in sorted order


def test_fields_dtypes_and_shapes(prepared) -> None:
    assert len(prepared.shards) == 3 and len(prepared.heldout_shards) == 1
    counts = []
    for path in prepared.shards + prepared.heldout_shards:
        with h5py.File(path, "r") as f:
            assert set(f) == set(EXPECTED_DTYPES)
            n = f["input_ids"].shape[0]
            counts.append(n)
            for key, dtype in EXPECTED_DTYPES.items():
                assert f[key].dtype == dtype, key
                width = {"masked_lm_positions": PREDS, "masked_lm_ids": PREDS}.get(key, SEQ)
                assert f[key].shape == ((n,) if key == "next_sentence_labels" else (n, width))
    assert sum(counts[:3]) == prepared.num_examples and counts[3] == prepared.num_heldout_examples
    assert max(counts[:3]) - min(counts[:3]) <= 1  # round-robin over shards
    vocab = prepared.vocab_file.read_text().split("\n")
    assert vocab[:5] == list(SPECIAL_TOKENS) and prepared.vocab_size == 1000


def test_sequence_structure(prepared) -> None:
    a = read_all(prepared.shards)
    # A random replacement may draw any id, [SEP] included, so check the structure before masking.
    original = unmasked_ids(a)
    for row in range(len(original)):
        ids, mask, seg = original[row], a["input_mask"][row], a["segment_ids"][row]
        length = int(mask.sum())
        assert 5 <= length <= SEQ and mask[:length].all() and not mask[length:].any()
        assert (ids[length:] == PAD).all() and (seg[length:] == 0).all()
        seps = np.flatnonzero(ids[:length] == SEP)
        assert ids[0] == CLS and len(seps) == 2 and seps[-1] == length - 1  # [CLS] A [SEP] B [SEP]
        first_sep = seps[0]
        assert (seg[: first_sep + 1] == 0).all() and (seg[first_sep + 1 : length] == 1).all()
        assert first_sep >= 2 and length - first_sep >= 3  # both segments non-empty


def test_masking_rate_and_positions(prepared) -> None:
    a = read_all(prepared.shards)
    lengths = a["input_mask"].sum(1).astype(int)
    positions = a["masked_lm_positions"]
    num_masked = (positions != 0).sum(1)
    # Google's rule per sequence: min(max_predictions, max(1, round(0.15 * length))).
    expected = np.minimum(PREDS, np.maximum(1, np.round(lengths * 0.15).astype(int)))
    assert (num_masked == expected).all()
    assert 0.14 < num_masked.sum() / lengths.sum() < 0.16
    for row in range(len(positions)):
        k = num_masked[row]
        pos = positions[row, :k]
        assert (np.diff(pos) > 0).all() and (positions[row, k:] == 0).all()
        assert (a["masked_lm_ids"][row, k:] == 0).all()
        assert pos.max() < lengths[row] - 1  # never the final [SEP]
        assert not np.isin(a["masked_lm_ids"][row, :k], [CLS, SEP]).any()


def test_80_10_10_rule(prepared) -> None:
    a = read_all(prepared.shards)
    real = a["masked_lm_positions"] != 0
    shown = np.take_along_axis(a["input_ids"], a["masked_lm_positions"], axis=1)[real]
    original = a["masked_lm_ids"][real]
    assert len(original) > 10_000
    as_mask = (shown == MASK).mean()
    kept = (shown == original).mean()  # includes random picks of the same id (p = 1/1000)
    replaced = ((shown != MASK) & (shown != original)).mean()
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(replaced - 0.1) < 0.015


def test_next_sentence_labels_about_half_random(prepared) -> None:
    labels = read_all(prepared.shards)["next_sentence_labels"]
    assert set(np.unique(labels)) == {0, 1}
    # 50 % by the coin, plus the chunks of a single sentence, which are always random.
    assert 0.45 < labels.mean() < 0.6


def test_pairs_follow_or_jump_documents(tmp_path: Path) -> None:
    """A corpus whose every sentence is one unique word 'dDsI' shows where each segment came from."""
    docs, sentences = 6, 40
    corpus = tmp_path / "c.txt"
    corpus.write_text(
        "\n\n".join("\n".join(f"d{d}s{i}" for i in range(sentences)) for d in range(docs)) + "\n"
    )
    words = [f"d{d}s{i}" for d in range(docs) for i in range(sentences)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL_TOKENS, *words]) + "\n")
    result = prepare_shards(
        [corpus], tmp_path / "out", vocab_file=vocab, max_seq_length=16, max_predictions_per_seq=3,
        dupe_factor=4, seed=7,
    )  # fmt: skip
    a = read_all(result.shards)
    ids = unmasked_ids(a)
    seen = {0: 0, 1: 0}
    for row in range(len(ids)):
        tokens = ids[row, : a["input_mask"][row].sum()]
        sep = int(np.flatnonzero(tokens == SEP)[0])
        seg_a = [divmod(int(t) - 5, sentences) for t in tokens[1:sep]]
        seg_b = [divmod(int(t) - 5, sentences) for t in tokens[sep + 1 : -1]]
        for seg in (
            seg_a,
            seg_b,
        ):  # one document, consecutive sentences (truncation trims ends only)
            assert len({d for d, _ in seg}) == 1
            assert [i for _, i in seg] == list(range(seg[0][1], seg[0][1] + len(seg)))
        label = int(a["next_sentence_labels"][row])
        seen[label] += 1
        if label == 0:
            assert seg_b[0][0] == seg_a[0][0] and seg_b[0][1] > seg_a[-1][1]
        else:
            assert seg_b[0][0] != seg_a[0][0]
    assert seen[0] > 50 and seen[1] > 50


@pytest.mark.slow
def test_deterministic_and_cli_in_fresh_process(prepared, tmp_path: Path, capsys) -> None:
    corpus = prepared.vocab_file.parent / "pydoc_corpus.txt"
    args = [
        "--input", str(corpus), "--vocab-file", str(prepared.vocab_file), "--max-seq-length", "64",
        "--max-predictions-per-seq", "10", "--num-shards", "2", "--seed", "3", "--dupe-factor", "1",
    ]  # fmt: skip
    assert main([*args, "--output-dir", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "part-00000-of-00002.hdf5" in printed and "part-00001-of-00002.hdf5" in printed
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kfac_bench.cli",
            "prepare-bert",
            *args,
            "--output-dir",
            str(tmp_path / "b"),
        ],
        check=True,
        capture_output=True,
    )
    main([*args[:-4], "--seed", "4", "--dupe-factor", "1", "--output-dir", str(tmp_path / "c")])
    shards = {d: sorted((tmp_path / d).glob("*.hdf5")) for d in "abc"}
    first, again, other = (read_all(shards[d]) for d in "abc")
    for key in EXPECTED_DTYPES:
        assert np.array_equal(first[key], again[key]), key
    assert not np.array_equal(first["masked_lm_positions"], other["masked_lm_positions"])


def test_wordpiece_trainer_vocabulary(tmp_path: Path) -> None:
    corpus = write_pydoc_corpus(tmp_path / "c.txt", max_documents=15)
    result = prepare_shards([corpus], tmp_path / "out", vocab_size=600, dupe_factor=1)
    tokens = result.vocab_file.read_text().split()
    assert tokens[:5] == list(SPECIAL_TOKENS) and 100 < len(tokens) <= 600
    assert any(t.startswith("##") for t in tokens)  # real subword pieces
    ids = read_all(result.shards)["input_ids"]
    assert ids.max() < len(tokens) and (ids == UNK).mean() < 0.001


def test_refuses_to_mix_with_old_shards_and_bad_input(prepared, tmp_path: Path) -> None:
    corpus = prepared.vocab_file.parent / "pydoc_corpus.txt"
    kwargs = {"vocab_file": prepared.vocab_file, "max_seq_length": 32, "dupe_factor": 1}
    prepare_shards([corpus], tmp_path, num_shards=3, **kwargs)
    with pytest.raises(ConfigError, match="--overwrite"):
        prepare_shards([corpus], tmp_path, **kwargs)
    prepare_shards([corpus], tmp_path, num_shards=1, overwrite=True, **kwargs)
    assert [p.name for p in tmp_path.glob("*.hdf5")] == ["part-00000-of-00001.hdf5"]
    one_doc = tmp_path / "one.txt"
    one_doc.write_text("A single document.\nWith two sentences.\n")
    with pytest.raises(DatasetError, match="two documents"):
        prepare_shards([one_doc], tmp_path / "x", **kwargs)
    with pytest.raises(DatasetError, match=r"missing\.txt"):
        prepare_shards([tmp_path / "missing.txt"], tmp_path, overwrite=True, **kwargs)
    assert [p.name for p in tmp_path.glob("*.hdf5")] == ["part-00000-of-00001.hdf5"]  # kept
    with pytest.raises(ConfigError, match="max_predictions_per_seq"):
        prepare_shards(
            [corpus], tmp_path / "z", max_predictions_per_seq=0, vocab_file=prepared.vocab_file
        )


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pydoc_corpus(tmp_path_factory.mktemp("corpus") / "c.txt", max_documents=6)


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``kfac-bench prepare-bert ARGS`` in this process: exit status 2 and one error line."""
    from kfac_bench.cli import main as cli

    assert cli(["prepare-bert", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kfac-bench: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda d, c: ["--input", str(d / "bin.dat")], "not UTF-8"),
        (lambda d, c: ["--input", str(c), "--vocab-file", str(d / "empty.txt")], "lacks [PAD]"),
        (lambda d, c: ["--input", str(c), "--vocab-file", str(d / "bin.dat")], "not UTF-8 text"),
        (lambda d, c: ["--input", str(c), "--output-dir", str(c)], "--output-dir"),
        (lambda d, c: ["--input", str(c), "--output-dir", "/proc/no/such"], "--output-dir"),
        (lambda d, c: ["--input", str(c), "--short-seq-prob", "-0.1"], "short_seq_prob"),
        (lambda d, c: ["--input", str(c), "--vocab-size", "-5"], "vocab_size must be"),
        (lambda d, c: ["--input", str(c), "--vocab-size", "40"], "raise --vocab-size"),
    ],
    ids=[
        "binary-input",
        "empty-vocab",
        "binary-vocab",
        "output-dir-is-a-file",
        "output-dir-cannot-be-made",
        "negative-short-seq-prob",
        "negative-vocab-size",
        "wordpiece-vocab-over-vocab-size",
    ],
)
def test_bad_inputs_give_one_line_and_status_2(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make, problem: str
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_bytes(b"")
    args = make(tmp_path, small_corpus)
    if "--output-dir" not in args:
        args += ["--output-dir", str(tmp_path / "out")]
    assert problem in _cli_error(args, capsys)
    assert not list(tmp_path.rglob("*.hdf5"))


def test_a_shard_that_cannot_be_written_is_one_line(
    prepared, small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "heldout").write_text("a file where the held-out shards go")
    args = ["--input", str(small_corpus), "--vocab-file", str(prepared.vocab_file)]
    args += ["--output-dir", str(tmp_path), "--heldout-fraction", "0.4", "--dupe-factor", "1"]
    # Not empty: the output-folder rule refuses it; with --overwrite (heldout/ is a name prepare-bert
    # writes) the file in the way is named.
    assert "--overwrite" in _cli_error(args, capsys)
    line = _cli_error([*args, "--overwrite"], capsys)
    assert f"{tmp_path / 'heldout'}: it is a regular file" in line and "remove it" in line
    assert (tmp_path / "heldout").read_text() == "a file where the held-out shards go"


def test_wordpiece_vocabulary_stays_within_vocab_size(small_corpus: Path, tmp_path: Path) -> None:
    result = prepare_shards([small_corpus], tmp_path, vocab_size=300, dupe_factor=1)
    assert result.vocab_size <= 300
    assert len(result.vocab_file.read_text().splitlines()) == result.vocab_size


def test_a_line_over_the_limit_is_refused_before_it_is_held(
    prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line longer than MAX_LINE_CHARS is refused naming its file and line; reading stops at the
    limit, so the line is never held whole (here a 64-character limit and a 10,000-character line)."""
    import kfac_bench.data.bert_corpus as corpus

    monkeypatch.setattr(corpus, "MAX_LINE_CHARS", 64)
    text = tmp_path / "long.txt"
    text.write_text("A short first sentence.\n\n" + "word " * 2000 + "\n\nLast one here.\n")
    seen: list[int] = []
    real_open = open

    class Spy:
        def __init__(self, f):  # type: ignore[no-untyped-def]
            self.f = f

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *a):  # type: ignore[no-untyped-def]
            self.f.close()

        def readline(self, limit: int = -1) -> str:
            line = self.f.readline(limit)
            seen.append(len(line))
            return line

    monkeypatch.setattr(corpus, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    with pytest.raises(DatasetError, match=r"long\.txt.*line 3 is longer than 64 characters"):
        prepare_shards([text], tmp_path / "out", vocab_file=prepared.vocab_file)
    assert max(seen) == 65


def test_streamed_tokenisation_matches_one_batch(prepared) -> None:
    """Documents tokenised a batch at a time across batch edges equal the whole corpus encoded at once."""
    import kfac_bench.data.bert_corpus as corpus

    path = prepared.vocab_file.parent / "pydoc_corpus.txt"
    tokenizer = corpus.load_tokenizer(prepared.vocab_file)
    docs = [[s for s in d.split("\n") if s] for d in path.read_text().split("\n\n")]
    docs = [d for d in docs if d]
    whole = [[e.ids for e in tokenizer.encode_batch(d, add_special_tokens=False)] for d in docs]
    expected = [[s for s in d if s] for d in whole if any(d)]
    saved = corpus._TOKENIZE_BATCH_CHARS
    try:
        corpus._TOKENIZE_BATCH_CHARS = 500  # many batch edges, inside documents too
        streamed = corpus.tokenize_files(tokenizer, [path])
    finally:
        corpus._TOKENIZE_BATCH_CHARS = saved
    assert [[list(s) for s in d] for d in streamed] == expected
