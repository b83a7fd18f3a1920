"""The HDF5 shard reader: exact labels on hand-written shards, round trip of prepared shards, rank
blocks, DataLoader batches and the errors for bad directories."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from kfac_bench.data.bert import (
    IGNORE_INDEX,
    SHARD_FIELDS,
    BertPretrainingDataset,
    build_bert_pretraining,
    rank_range,
)
from kfac_bench.data.bert_smoke import build_bert_pydoc, prepare_pydoc_shards
from kfac_bench.errors import ConfigError, DatasetError

SEQ, PREDS = 12, 4


def write_nvidia_shard(path: Path, first_id: int, n: int) -> None:
    """A shard written the way NVIDIA's script writes it; row r has input ids first_id + r + [0..SEQ)
    and masks positions 1, 3 (and 5 on odd rows), padding the rest with 0."""
    ids = (first_id + np.arange(n)[:, None] + np.arange(SEQ)[None, :]).astype(np.int32)
    positions = np.zeros((n, PREDS), dtype=np.int32)
    masked_ids = np.zeros((n, PREDS), dtype=np.int32)
    for r in range(n):
        pos = [1, 3, 5] if r % 2 else [1, 3]
        positions[r, : len(pos)] = pos
        masked_ids[r, : len(pos)] = [1000 + first_id + r + p for p in pos]
    with h5py.File(path, "w") as f:
        f.create_dataset("input_ids", data=ids, dtype="i4", compression="gzip")
        f.create_dataset("input_mask", data=np.ones((n, SEQ)), dtype="i1", compression="gzip")
        f.create_dataset("segment_ids", data=np.zeros((n, SEQ)), dtype="i1", compression="gzip")
        f.create_dataset("masked_lm_positions", data=positions, dtype="i4", compression="gzip")
        f.create_dataset("masked_lm_ids", data=masked_ids, dtype="i4", compression="gzip")
        f.create_dataset(
            "next_sentence_labels", data=np.arange(n) % 2, dtype="i1", compression="gzip"
        )


@pytest.fixture()
def hand_shards(tmp_path: Path) -> Path:
    write_nvidia_shard(tmp_path / "b_part.hdf5", first_id=100, n=5)  # sorted second
    write_nvidia_shard(tmp_path / "a_part.hdf5", first_id=0, n=4)
    (tmp_path / "notes.txt").write_text("not a shard")
    return tmp_path


def test_items_and_labels_exact(hand_shards: Path) -> None:
    ds = BertPretrainingDataset(hand_shards)
    assert len(ds) == 9 and (ds.max_seq_length, ds.max_predictions_per_seq) == (SEQ, PREDS)
    item = ds[5]  # second file (sorted by name), row 1
    assert ds.locate(5) == (hand_shards / "b_part.hdf5", 1)
    assert set(item) == {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "labels",
        "next_sentence_label",
    }
    assert all(t.dtype == torch.int64 for t in item.values())
    assert item["input_ids"].tolist() == list(range(101, 101 + SEQ))
    expected = [IGNORE_INDEX] * SEQ
    for p in (1, 3, 5):
        expected[p] = 1000 + 101 + p
    assert item["labels"].tolist() == expected
    assert item["next_sentence_label"].shape == () and item["next_sentence_label"].item() == 1
    assert (ds[0]["labels"] != IGNORE_INDEX).sum() == 2  # even row: 2 masked, padding ignored


def test_rank_blocks() -> None:
    for total, world in [(9, 2), (10, 3), (3, 4)]:
        full = [list(rank_range(total, r, world, drop_remainder=False)) for r in range(world)]
        assert sorted(i for block in full for i in block) == list(range(total))
        dropped = [rank_range(total, r, world, drop_remainder=True) for r in range(world)]
        assert {len(b) for b in dropped} == {total // world}
        assert len({i for b in dropped for i in b}) == world * (total // world)


def test_rank_override_reads_its_block(hand_shards: Path) -> None:
    rank1 = BertPretrainingDataset(hand_shards, rank=1, world_size=2)
    whole = BertPretrainingDataset(hand_shards, shard_by_rank=False)
    assert len(rank1) == 4
    for i in range(4):
        assert torch.equal(rank1[i]["input_ids"], whole[4 + i]["input_ids"])


def test_loader_batches_and_worker_processes(hand_shards: Path) -> None:
    ds = BertPretrainingDataset(hand_shards)
    ds[0]  # opens a handle in this process; workers must reopen their own
    batches = list(DataLoader(ds, batch_size=4, num_workers=1))
    assert [b["input_ids"].shape for b in batches] == [(4, SEQ), (4, SEQ), (1, SEQ)]
    assert batches[0]["next_sentence_label"].shape == (4,)
    firsts = torch.cat([b["input_ids"][:, 0] for b in batches]).tolist()
    assert firsts == [0, 1, 2, 3, 100, 101, 102, 103, 104]


def test_prepared_shards_round_trip(tmp_path: Path) -> None:
    result = prepare_pydoc_shards(
        tmp_path, max_documents=12, vocab_size=700, max_seq_length=64, max_predictions_per_seq=10,
        num_shards=2, heldout_fraction=0.2,
    )  # fmt: skip
    splits = build_bert_pretraining(str(tmp_path))
    assert (
        len(splits.train) == result.num_examples and len(splits.val) == result.num_heldout_examples
    )
    rows = {}
    for path in result.shards:
        with h5py.File(path, "r") as f:
            rows[path] = {k: f[k][:] for k in SHARD_FIELDS}
    for i in range(0, len(splits.train), 7):
        item = splits.train[i]
        path, row = splits.train.locate(i)
        raw = rows[path]
        assert item["input_ids"].tolist() == raw["input_ids"][row].tolist()
        assert item["attention_mask"].tolist() == raw["input_mask"][row].tolist()
        assert item["token_type_ids"].tolist() == raw["segment_ids"][row].tolist()
        k = int((raw["masked_lm_positions"][row] != 0).sum())
        labelled = torch.nonzero(item["labels"] != IGNORE_INDEX).flatten().tolist()
        assert labelled == raw["masked_lm_positions"][row][:k].tolist()
        assert item["labels"][labelled].tolist() == raw["masked_lm_ids"][row][:k].tolist()
        assert item["next_sentence_label"].item() == raw["next_sentence_labels"][row]


def test_pydoc_builder_prepares_once(tmp_path: Path, hand_shards: Path) -> None:
    kwargs = {
        "max_seq_length": 32,
        "max_predictions_per_seq": 5,
        "vocab_size": 600,
        "max_documents": 10,
    }
    root = tmp_path / "smoke"
    splits = build_bert_pydoc(str(root), **kwargs)
    assert len(splits.train) > 50 and len(splits.val) > 0
    assert splits.train.max_seq_length == 32 and splits.val.max_predictions_per_seq == 5
    shard = root / "part-00000-of-00002.hdf5"
    stamp = shard.stat().st_mtime_ns
    build_bert_pydoc(str(root), **kwargs)  # reused as they are
    assert shard.stat().st_mtime_ns == stamp
    assert (
        build_bert_pydoc(str(root), **{**kwargs, "max_seq_length": 48}).train.max_seq_length == 48
    )
    with pytest.raises(ConfigError, match="did not make"):
        build_bert_pydoc(str(hand_shards))  # never overwrites someone else's shards


def test_clear_errors(tmp_path: Path, hand_shards: Path) -> None:
    with pytest.raises(DatasetError, match="directory of BERT pretraining"):
        BertPretrainingDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"at least one \.hdf5"):
        BertPretrainingDataset(tmp_path / "empty")
    with pytest.raises(DatasetError, match="heldout"):
        build_bert_pretraining(str(hand_shards))  # no held-out directory
    bad = tmp_path / "bad"
    bad.mkdir()
    with h5py.File(bad / "x.hdf5", "w") as f:
        f.create_dataset("input_ids", data=np.zeros((2, SEQ), dtype=np.int32))
    with pytest.raises(DatasetError, match="missing: input_mask, segment_ids"):
        BertPretrainingDataset(bad)
    (bad / "x.hdf5").write_bytes(b"not hdf5")
    with pytest.raises(DatasetError, match="readable HDF5"):
        BertPretrainingDataset(bad)


def _first_ids(dataset: BertPretrainingDataset) -> list[int]:
    return [int(dataset[i]["input_ids"][0]) for i in range(len(dataset))]


def test_nvidia_folder_as_its_scripts_leave_it(tmp_path: Path) -> None:
    # NVIDIA's bertPrep.py --action create_hdf5_files writes <dataset>_training_N.hdf5 and
    # <dataset>_test_N.hdf5 into one folder; run_pretraining.py trains on the "training" files only.
    nvidia = tmp_path / "hdf5_lower_case_1_seq_len_128_max_pred_20" / "wikicorpus_en"
    nvidia.mkdir(parents=True)
    write_nvidia_shard(nvidia / "wikicorpus_en_training_0.hdf5", first_id=0, n=3)
    write_nvidia_shard(nvidia / "wikicorpus_en_training_1.hdf5", first_id=100, n=4)
    write_nvidia_shard(nvidia / "wikicorpus_en_test_0.hdf5", first_id=5000, n=2)
    write_nvidia_shard(nvidia / "wikicorpus_en_test_1.hdf5", first_id=6000, n=1)
    splits = build_bert_pretraining(str(nvidia))
    # No test row leaks into training.
    assert _first_ids(splits.train) == [0, 1, 2, 100, 101, 102, 103]
    assert _first_ids(splits.val) == [5000, 5001, 6000]
    assert {p.name for p in splits.val.files} == {
        "wikicorpus_en_test_0.hdf5",
        "wikicorpus_en_test_1.hdf5",
    }
    # heldout_root stays an override: the folder's "training" files still train, the given one is held out.
    other = tmp_path / "other"
    other.mkdir()
    write_nvidia_shard(other / "eval.hdf5", first_id=9000, n=2)
    splits = build_bert_pretraining(str(nvidia), heldout_root=str(other))
    assert _first_ids(splits.train) == [0, 1, 2, 100, 101, 102, 103]
    assert _first_ids(splits.val) == [9000, 9001]


def test_nvidia_folder_errors(tmp_path: Path) -> None:
    write_nvidia_shard(tmp_path / "wiki_training_0.hdf5", first_id=0, n=2)
    with pytest.raises(
        DatasetError, match=r"_test_N\.hdf5 next to the training shards.*heldout_root"
    ):
        build_bert_pretraining(str(tmp_path))
    write_nvidia_shard(tmp_path / "wiki_test_0.hdf5", first_id=50, n=2)
    write_nvidia_shard(tmp_path / "stray.hdf5", first_id=90, n=2)
    with pytest.raises(DatasetError, match=r"stray\.hdf5.*named like NVIDIA's"):
        build_bert_pretraining(str(tmp_path))
    (tmp_path / "stray.hdf5").unlink()
    assert len(build_bert_pretraining(str(tmp_path)).val) == 2
