"""SQuAD v1.1 reading and features: validation of the official format, the reference's sliding window
and max-context rule, and every gold answer of the smoke set recovered through the features."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from kfac_bench.data.base import DataSplits
from kfac_bench.data.bert_smoke import prepare_pydoc_shards
from kfac_bench.data.squad import (
    SquadFeatures,
    doc_windows,
    load_squad_splits,
    load_squad_tokenizer,
    max_context_mask,
    read_squad,
    squad_collate,
)
from kfac_bench.data.squad_smoke import MARKER, build_squad_pydoc, write_pydoc_squad
from kfac_bench.errors import ConfigError, DatasetError
from kfac_bench.tasks.squad_eval import normalize_answer
from tests.data.squad_fixtures import (
    Smoke,
    make_smoke,
    one_article,
    squad_json,
    write_json,
    write_vocab,
)
from tests.distributed import run_distributed

REFERENCE = {"max_seq_length": 384, "doc_stride": 128, "max_query_length": 64}  # run_squad.py
SMALL = {"max_seq_length": 64, "doc_stride": 16, "max_query_length": 24}  # many windows per context


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Smoke:
    return make_smoke(tmp_path_factory.mktemp("squad"))


# --- reading ----------------------------------------------------------------------------------------


def test_reads_the_official_shape(tmp_path: Path) -> None:
    qas = [
        {"id": "q1", "question": "Who?", "answers": [{"text": "Denver", "answer_start": 4}]},
        {
            "id": "q2",
            "question": "Where?",
            "answers": [
                {"text": "Broncos", "answer_start": 11},
                {"text": "the Broncos", "answer_start": 7},
            ],
        },
    ]
    path = write_json(
        tmp_path / "dev-v1.1.json", squad_json([one_article("Go, Denver Broncos", qas)])
    )
    examples = read_squad(path)
    assert [e.id for e in examples] == ["q1", "q2"]
    assert examples[1].context == "Go, Denver Broncos"
    assert [(a.text, a.answer_start) for a in examples[1].answers] == [
        ("Broncos", 11),
        ("the Broncos", 7),
    ]


def _one_line_error(path: Path, exc_type: type[Exception] = DatasetError) -> str:
    with pytest.raises(exc_type) as info:
        read_squad(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message
    return message


def test_rejects_squad2_by_version_and_by_fields(tmp_path: Path) -> None:
    qa = {
        "id": "q",
        "question": "Why?",
        "answers": [],
        "is_impossible": True,
        "plausible_answers": [{"text": "x", "answer_start": 0}],
    }
    v2 = write_json(tmp_path / "dev-v2.0.json", squad_json([one_article("x y", [qa])], "v2.0"))
    assert "v2.0" in _one_line_error(v2)
    disguised = write_json(tmp_path / "fake.json", squad_json([one_article("x y", [qa])]))
    assert "is_impossible" in _one_line_error(disguised)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("not json {", "not valid JSON"),
        (json.dumps([1, 2]), "'version' and 'data'"),
        (json.dumps(squad_json([{"title": "t"}])), "'paragraphs'"),
        (json.dumps(squad_json([one_article("abc", [{"id": "q", "question": "?"}])])), "'answers'"),
        (
            json.dumps(
                squad_json(
                    [
                        one_article(
                            "abc",
                            [
                                {
                                    "id": "q",
                                    "question": "?",
                                    "answers": [{"text": "b", "answer_start": "1"}],
                                }
                            ],
                        )
                    ]
                )
            ),
            "'answer_start' of type int",
        ),
        (
            json.dumps(
                squad_json(
                    [
                        one_article(
                            "abc",
                            [
                                {
                                    "id": "q",
                                    "question": "?",
                                    "answers": [{"text": "b", "answer_start": 9}],
                                }
                            ],
                        )
                    ]
                )
            ),
            "outside its context",
        ),
    ],
)
def test_bad_shapes_give_one_line(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "train-v1.1.json"
    path.write_text(content)
    assert problem in _one_line_error(path)


def test_missing_file_and_duplicate_ids(tmp_path: Path) -> None:
    _one_line_error(tmp_path / "nope.json")
    qa = {"id": "same", "question": "?", "answers": [{"text": "a", "answer_start": 0}]}
    path = write_json(tmp_path / "dup.json", squad_json([one_article("a b", [qa, qa])]))
    assert "more than once" in _one_line_error(path)


def test_duplicate_id_found_among_many_questions(tmp_path: Path) -> None:
    """A duplicate anywhere in a large file is named (here the last question, repeated); the
    check is one pass over a set (its speed is not timed here)."""
    qas = [
        {"id": f"q{i}", "question": "?", "answers": [{"text": "a", "answer_start": 0}]}
        for i in range(5_000)
    ]
    clean = write_json(tmp_path / "clean.json", squad_json([one_article("a b", qas)]))
    assert len(read_squad(clean)) == 5_000
    qas.append(dict(qas[-1]))  # the last question, again
    path = write_json(tmp_path / "dup.json", squad_json([one_article("a b", qas)]))
    assert "'q4999' occurs more than once" in _one_line_error(path)


# --- the reference's window and max-context rules --------------------------------------------------


def test_windows_follow_the_reference_loop() -> None:
    # 1000 tokens, 300 per window, stride 128: starts 0, 128, ..., 640 hold 300 tokens (640 + 300 = 940
    # < 1000); the next starts at 768 and holds the remaining 232 tokens, ending the loop.
    assert doc_windows(1000, 300, 128) == [
        (0, 300),
        (128, 300),
        (256, 300),
        (384, 300),
        (512, 300),
        (640, 300),
        (768, 232),
    ]
    assert doc_windows(300, 300, 128) == [(0, 300)]  # fits: one window
    assert doc_windows(301, 300, 128) == [(0, 300), (128, 173)]
    assert doc_windows(10, 4, 8) == [(0, 4), (4, 4), (8, 2)]  # stride capped at the window length
    assert doc_windows(0, 300, 128) == [(0, 0)]  # an empty context still gets one window


def test_max_context_matches_the_reference_docstring_example() -> None:
    # run_squad.py _check_is_max_context: "the man went to the store and bought a gallon of milk",
    # spans A = tokens 0-4, B = 3-7, C = 6-10. 'bought' (token 7) has min(4, 0) + 0.05 = 0.05 in B and
    # min(1, 3) + 0.05 = 1.05 in C, so C holds its maximum context.
    windows = [(0, 5), (3, 5), (6, 5)]
    assert not max_context_mask(windows, 1)[7 - 3]
    assert max_context_mask(windows, 2)[7 - 6]
    # Every token is claimed by exactly one window.
    owners = np.zeros(11, dtype=int)
    for k, (start, length) in enumerate(windows):
        owners[start : start + length] += max_context_mask(windows, k)
    assert (owners == 1).all()


# --- features -------------------------------------------------------------------------------------


def _round_trip(features: SquadFeatures, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Every training feature's label maps back to its gold answer; unlabelled windows lack it."""
    labelled = set()
    for k, f in enumerate(features.features):
        example = features.examples[f.example_index]
        gold = example.answers[0]
        first = features.context_position(k)
        offsets = features.context_offsets(k)
        item = features[k]
        if f.start_position == 0:
            assert f.end_position == 0
            inside = (offsets[:, 1] > gold.answer_start) & (
                offsets[:, 0] < gold.answer_start + len(gold.text)
            )
            tokens_in_window = inside.sum()
            whole = tokens_in_window == len(
                tokenizer.encode(gold.text, add_special_tokens=False).ids
            )
            assert not whole, f"feature {k} holds the answer but points at [CLS]"
            continue
        labelled.add(f.example_index)
        s, e = f.start_position - first, f.end_position - first
        assert 0 <= s <= e < f.doc_length
        text = example.context[offsets[s][0] : offsets[e][1]]
        assert normalize_answer(text) == normalize_answer(gold.text)
        assert text == gold.text  # smoke answers are whole words, so the span is exact
        # The labelled input positions hold exactly the answer's own WordPiece ids.
        ids = item["input_ids"][f.start_position : f.end_position + 1].tolist()
        assert ids == tokenizer.encode(gold.text, add_special_tokens=False).ids
        assert item["start_positions"].item() == f.start_position
    assert labelled == set(range(len(features.examples))), "an example lost its answer"


@pytest.mark.parametrize("sizes", [REFERENCE, SMALL], ids=["reference", "small"])
def test_every_gold_span_round_trips(smoke: Smoke, sizes: dict[str, int]) -> None:
    tokenizer = load_squad_tokenizer(smoke.vocab)
    for path in (smoke.train, smoke.dev):
        examples = read_squad(path)
        features = SquadFeatures(examples, tokenizer, training=True, **sizes)
        assert features.skipped_examples == 0 and len(features.examples) == len(examples)
        windows = np.bincount([f.example_index for f in features.features])
        assert windows.max() > 1, "no context was longer than one window"
        _round_trip(features, tokenizer)


def test_items_and_collate(smoke: Smoke) -> None:
    tokenizer = load_squad_tokenizer(smoke.vocab)
    splits = load_squad_splits(smoke.train, smoke.dev, smoke.vocab, **SMALL)
    assert isinstance(splits, DataSplits) and splits.collate_fn is squad_collate
    item = splits.train[3]
    f = splits.train.features[3]
    n = int(item["attention_mask"].sum())
    first = splits.train.context_position(3)
    assert item["input_ids"].shape == (64,) and n == first + f.doc_length + 1
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    assert (
        item["input_ids"][0] == cls
        and item["input_ids"][first - 1] == sep == item["input_ids"][n - 1]
    )
    assert (item["input_ids"][n:] == tokenizer.token_to_id("[PAD]")).all()
    # Segment A = [CLS] question [SEP], segment B = the window and its [SEP], 0 on padding.
    assert (
        item["token_type_ids"][:first].eq(0).all() and item["token_type_ids"][first:n].eq(1).all()
    )
    assert item["token_type_ids"][n:].eq(0).all()

    batch = next(iter(DataLoader(splits.train, batch_size=5, collate_fn=squad_collate)))
    assert set(batch) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "start_positions",
        "end_positions",
    }
    assert batch["input_ids"].shape == (5, 64) and batch["start_positions"].shape == (5,)
    assert all(t.dtype == torch.int64 for t in batch.values())

    val = next(iter(DataLoader(splits.val, batch_size=4, collate_fn=splits.collate_fn)))
    assert val["feature_index"].tolist() == [0, 1, 2, 3]
    mapping = splits.val.offset_mapping(2)
    first = splits.val.context_position(2)
    assert mapping[first - 1] is None and mapping[first] is not None
    assert splits.val.example_id(2) == splits.val.examples[splits.val.features[2].example_index].id


def test_training_skips_answers_not_at_answer_start(tmp_path: Path) -> None:
    vocab = write_vocab(tmp_path / "vocab.txt", ["alpha", "beta", "gamma", "?"])
    qas = [
        {"id": "ok", "question": "beta?", "answers": [{"text": "beta", "answer_start": 6}]},
        {"id": "off", "question": "gamma?", "answers": [{"text": "gamma", "answer_start": 2}]},
    ]
    path = write_json(tmp_path / "t.json", squad_json([one_article("alpha beta gamma", qas)]))
    tokenizer = load_squad_tokenizer(vocab)
    train = SquadFeatures(read_squad(path), tokenizer, training=True)
    assert train.skipped_examples == 1 and [e.id for e in train.examples] == ["ok"]
    # [CLS] beta ? [SEP] alpha beta gamma [SEP]: 'beta' of the context is position 5.
    assert (train.features[0].start_position, train.features[0].end_position) == (5, 5)
    evaluation = SquadFeatures(read_squad(path), tokenizer, training=False)
    assert [e.id for e in evaluation.examples] == ["ok", "off"]  # every question is predicted


def test_sizes_without_room_for_context_are_rejected(smoke: Smoke) -> None:
    tokenizer = load_squad_tokenizer(smoke.vocab)
    with pytest.raises(ConfigError, match="max_seq_length 66"):
        SquadFeatures(read_squad(smoke.dev), tokenizer, max_seq_length=66, max_query_length=64)
    with pytest.raises(DatasetError, match="vocab"):
        load_squad_tokenizer(smoke.vocab.parent / "missing-vocab.txt")


# --- the smoke set --------------------------------------------------------------------------------


def test_smoke_answers_are_real_spans_and_files_are_deterministic(
    smoke: Smoke, tmp_path: Path
) -> None:
    for path in (smoke.train, smoke.dev):
        raw = json.loads(path.read_text())
        assert raw["version"] == "1.1"
        for article in raw["data"]:
            for paragraph in article["paragraphs"]:
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    for answer in qa["answers"]:
                        start = answer["answer_start"]
                        assert context[start : start + len(answer["text"])] == answer["text"]
                        assert normalize_answer(answer["text"])
    dev = read_squad(smoke.dev)
    assert len(read_squad(smoke.train)) >= 150 and len(dev) >= 30
    assert any(len(e.answers) > 1 for e in dev)
    again = write_pydoc_squad(tmp_path)
    assert again.train.read_bytes() == smoke.train.read_bytes()
    assert again.dev.read_bytes() == smoke.dev.read_bytes()


def test_smoke_vocab_is_the_smoke_shards_vocab(smoke: Smoke, tmp_path: Path) -> None:
    shards = prepare_pydoc_shards(
        tmp_path, dupe_factor=1, num_shards=1, max_seq_length=32, max_predictions_per_seq=4
    )
    assert shards.vocab_file.read_text() == smoke.vocab.read_text()


# --- the smoke dataset builder ------------------------------------------------------------------------


def test_smoke_builder_writes_its_own_folder_once(smoke: Smoke, tmp_path: Path) -> None:
    root = tmp_path / "squad_pydoc"
    splits = build_squad_pydoc(str(root), **SMALL)
    assert isinstance(splits, DataSplits) and splits.collate_fn is squad_collate
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["train-v1.1.json", "dev-v1.1.json", "vocab.txt", "pydoc_corpus.txt", MARKER]
    )
    # The same files as the writer's and the smoke shards' vocabulary, read like the real files.
    for name, made in (("train-v1.1.json", smoke.train), ("dev-v1.1.json", smoke.dev)):
        assert (root / name).read_bytes() == made.read_bytes()
    assert (root / "vocab.txt").read_text() == smoke.vocab.read_text()
    reference = load_squad_splits(smoke.train, smoke.dev, smoke.vocab, **SMALL)
    assert len(splits.train) == len(reference.train) and len(splits.val) == len(reference.val)
    assert splits.train.training and not splits.val.training
    # A second use reads what is there; other arguments rewrite it.
    stamp = (root / "train-v1.1.json").stat().st_mtime_ns
    build_squad_pydoc(str(root), **SMALL)
    assert (root / "train-v1.1.json").stat().st_mtime_ns == stamp
    build_squad_pydoc(str(root), seed=7, **SMALL)
    assert json.loads((root / MARKER).read_text()) == {"vocab_size": 2000, "seed": 7}
    assert (root / "dev-v1.1.json").read_bytes() != smoke.dev.read_bytes()


@pytest.mark.parametrize("foreign", ["part-00000-of-00001.hdf5", "train-v1.1.json", "vocab.txt"])
def test_smoke_builder_never_writes_into_a_foreign_folder(tmp_path: Path, foreign: str) -> None:
    # E.g. the pretraining smoke shards' folder, or a folder holding the real SQuAD files.
    (tmp_path / foreign).write_text("not mine")
    with pytest.raises(ConfigError, match="did not make") as info:
        build_squad_pydoc(str(tmp_path), **SMALL)
    assert "\n" not in str(info.value)
    assert (tmp_path / foreign).read_text() == "not mine" and not (tmp_path / MARKER).exists()


def _build_on_rank(rank: int, world: int, root: str) -> tuple[int, int, float]:
    splits = build_squad_pydoc(root, **SMALL)
    return len(splits.train), len(splits.val), Path(root, MARKER).stat().st_mtime


@pytest.mark.distributed
def test_smoke_builder_rank0_writes_and_the_others_wait(tmp_path: Path) -> None:
    results = run_distributed(_build_on_rank, 2, str(tmp_path / "squad_pydoc"))
    assert results[0] == results[1] and results[0][0] > 0  # rank 1 read the files rank 0 wrote
