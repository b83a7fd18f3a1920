"""Masked-LM task: the loss against transformers' own, metrics on a constructed case, exact
cross-rank reduction under gloo."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

from kfac_bench.data.bert import IGNORE_INDEX, BertPretrainingDataset
from kfac_bench.data.loader import ShardSampler
from kfac_bench.errors import UserError
from kfac_bench.tasks.base import Task
from kfac_bench.tasks.masked_lm import MaskedLMTask, build_masked_lm
from tests.data.test_bert_reader import write_nvidia_shard


class EchoModel(nn.Module):
    """Predicts each token's own id mod ``vocab`` (logit ln 4 there, 0 elsewhere: with 5 classes p = 1/2),
    and NSP class ``input_ids[:, 0] % 2`` with p = 3/4 (logits ln 3 vs 0)."""

    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the task a device to read

    def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
        mlm = torch.nn.functional.one_hot(input_ids % self.vocab, self.vocab).float() * math.log(
            4.0
        )
        nsp = torch.nn.functional.one_hot(input_ids[:, 0] % 2, 2).float() * math.log(3.0)
        return mlm + self.anchor, nsp


def make_batch(input_ids: list[list[int]], labels: list[list[int]], nsp: list[int]) -> dict:
    ids = torch.tensor(input_ids)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.tensor(labels),
        "next_sentence_label": torch.tensor(nsp),
    }


def test_is_a_task_with_the_mlm_target() -> None:
    task = build_masked_lm()
    assert isinstance(task, Task)
    assert task.target_metric == "mlm_accuracy" and task.higher_is_better


def test_evaluate_constructed_case() -> None:
    x = IGNORE_INDEX
    # Masked tokens: (id 7 -> predicts 2, label 2 hit), (3 -> 3, label 1 miss), (9 -> 4, label 4 hit),
    # (0 -> 0, label 0 hit); the unmasked positions would all be misses if they were counted.
    batches = [
        make_batch([[7, 3, 1], [2, 1, 1]], [[2, 1, x], [x, x, x]], [1, 0]),
        make_batch([[9, 0, 6]], [[4, 0, x]], [0]),
    ]
    model = EchoModel(5).train()
    metrics = MaskedLMTask().evaluate(model, batches)
    assert model.training  # restored
    assert metrics["mlm_accuracy"] == pytest.approx(3 / 4)
    # CE is ln 2 for a hit (p = 4/8) and ln 8 for a miss (p = 1/8).
    assert metrics["mlm_loss"] == pytest.approx((3 * math.log(2) + math.log(8)) / 4)
    # NSP predictions 7%2=1, 2%2=0, 9%2=1 against labels 1, 0, 0: two hits of three.
    assert metrics["nsp_accuracy"] == pytest.approx(2 / 3)
    assert metrics["nsp_loss"] == pytest.approx((2 * math.log(4 / 3) + math.log(4)) / 3)
    with pytest.raises(UserError, match="no masked tokens"):
        MaskedLMTask().evaluate(model, [make_batch([[1, 2]], [[x, x]], [0])])


def test_loss_matches_transformers_pretraining_loss() -> None:
    from kfac_bench.models.bert import build_bert

    torch.manual_seed(0)
    model = build_bert("tiny", vocab_size=50).eval()  # eval: no dropout, so both forwards agree
    ids = torch.randint(5, 50, (3, 10))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 2], labels[1, 5], labels[1, 6], labels[2, 1] = 11, 12, 13, 14
    batch = make_batch(ids.tolist(), labels.tolist(), [0, 1, 1])
    task = MaskedLMTask()
    batch = task.to_device(batch, torch.device("cpu"))
    assert task.batch_size(batch) == 3
    ours = task.loss(model, batch)
    reference = model(**batch).loss  # transformers: mean MLM CE (ignore -100) + mean NSP CE
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)
    ours.backward()
    assert model.bert.encoder.layer[1].output.dense.weight.grad is not None


def _worker(rank: int, world_size: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/init", rank=rank, world_size=world_size
    )
    try:
        task, model = MaskedLMTask(), EchoModel(SHARD_VOCAB)
        own = BertPretrainingDataset(root, drop_remainder=False)  # shards itself by rank
        train = BertPretrainingDataset(root)  # equal lengths for training
        full = BertPretrainingDataset(root, shard_by_rank=False)
        sampled = DataLoader(full, batch_size=2, sampler=ShardSampler(full, world_size, rank))
        result = {
            "own_first": own[0]["input_ids"][0].item(),
            "lengths": (len(own), len(train)),
            "own": task.evaluate(model, DataLoader(own, batch_size=2)),
            "sampled": task.evaluate(model, sampled),
        }
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


SHARD_VOCAB = 128


def write_half_right_shard(path: Path, first_id: int, n: int) -> None:
    """A reader-test shard whose labels equal the input id on even rows (EchoModel hits) and input id
    + 1 on odd rows (misses)."""
    write_nvidia_shard(path, first_id, n)
    with h5py.File(path, "r+") as f:
        ids = f["masked_lm_ids"][:]
        odd = (np.arange(n) % 2)[:, None]
        f["masked_lm_ids"][...] = np.where(ids > 0, ids - 1000 + odd, 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_evaluation_is_exact_across_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    write_half_right_shard(root / "a.hdf5", first_id=0, n=4)
    write_half_right_shard(root / "b.hdf5", first_id=100, n=3)  # 7 examples: uneven over 2 ranks
    full = BertPretrainingDataset(root, shard_by_rank=False)
    single = MaskedLMTask().evaluate(EchoModel(SHARD_VOCAB), DataLoader(full, batch_size=3))
    # even rows (0, 2 of a; 100, 102 of b) mask 2 tokens, odd rows 3: 8 hits of 8 + 9 tokens
    assert single["mlm_accuracy"] == pytest.approx(8 / 17)
    mp.start_processes(_worker, args=(2, str(root), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["lengths"] for r in results] == [(3, 3), (4, 3)]
    assert [r["own_first"] for r in results] == [0, 3]  # contiguous blocks: a's rows 0-2, then 3 on
    for r in results:
        for key in ("own", "sampled"):
            assert r[key] == pytest.approx(single), key
