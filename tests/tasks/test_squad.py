"""SQuAD task: the loss against transformers' own, the reference post-processing on hand-made logits,
oracle logits reproducing every gold answer (one process and two gloo ranks), and a tiny BERT that
learns on the smoke set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from kfac_bench.data.loader import ShardSampler
from kfac_bench.data.squad import SquadFeatures, load_squad_tokenizer, read_squad, squad_collate
from kfac_bench.errors import UserError
from kfac_bench.models.bert_qa import build_bert_qa
from kfac_bench.tasks.base import Task
from kfac_bench.tasks.squad import (
    PREDICTIONS_FILE,
    SquadTask,
    best_span,
    build_squad_task,
    postprocess,
)
from kfac_bench.tasks.squad_eval import main as squad_eval_main
from kfac_bench.tasks.squad_eval import squad_v11_scores
from tests.data.squad_fixtures import (
    Smoke,
    make_smoke,
    one_article,
    squad_json,
    write_json,
    write_vocab,
)
from tests.distributed import run_distributed

REFERENCE = {"max_seq_length": 384, "doc_stride": 128, "max_query_length": 64}
MEDIUM = {"max_seq_length": 128, "doc_stride": 32, "max_query_length": 32}
SHORT = {"max_seq_length": 64, "doc_stride": 32, "max_query_length": 24}  # cheap on CPU


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on the shared 2-core machine two spinning threads run many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Smoke:
    return make_smoke(tmp_path_factory.mktemp("squad"))


def dev_features(smoke: Smoke, sizes: dict[str, int]) -> SquadFeatures:
    return SquadFeatures(read_squad(smoke.dev), load_squad_tokenizer(smoke.vocab), **sizes)


def oracle_logits(features: SquadFeatures, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits 10 at the first answer's first / last token where this window holds it, 0 elsewhere."""
    start = torch.zeros(features.max_seq_length)
    end = torch.zeros(features.max_seq_length)
    answer = features.examples[features.features[k].example_index].answers[0]
    begin, stop = answer.answer_start, answer.answer_start + len(answer.text)
    offsets = torch.from_numpy(features.context_offsets(k))
    first = features.context_position(k)
    hits = torch.nonzero((offsets[:, 1] > begin) & (offsets[:, 0] < stop)).flatten()
    if len(hits):
        if offsets[hits[0], 0] <= begin:
            start[first + hits[0]] = 10.0
        if offsets[hits[-1], 1] >= stop:
            end[first + hits[-1]] = 10.0
    return start, end


def gold(features: SquadFeatures) -> dict[str, str]:
    return {e.id: e.answers[0].text for e in features.examples}


def test_contract_and_loss_match_transformers() -> None:
    task = build_squad_task()
    assert isinstance(task, Task) and task.target_metric == "f1" and task.higher_is_better
    torch.manual_seed(0)
    model = build_bert_qa("tiny", vocab_size=50).eval()
    batch = {
        "input_ids": torch.randint(0, 50, (3, 12)),
        "token_type_ids": torch.zeros(3, 12, dtype=torch.long),
        "attention_mask": torch.ones(3, 12, dtype=torch.long),
        "start_positions": torch.tensor([0, 4, 7]),
        "end_positions": torch.tensor([0, 6, 7]),
    }
    expected = model(**batch).loss  # BertForQuestionAnswering's (start CE + end CE) / 2
    assert task.loss(model, batch).item() == pytest.approx(expected.item(), rel=1e-6)
    assert task.batch_size(batch) == 3


def test_best_span_follows_the_reference_rules(tmp_path: Path) -> None:
    vocab = write_vocab(tmp_path / "vocab.txt", ["what", "?", "alpha", "beta", "gamma", "delta"])
    qa = {"id": "q", "question": "what?", "answers": [{"text": "beta", "answer_start": 6}]}
    path = write_json(
        tmp_path / "d.json", squad_json([one_article("alpha beta gamma delta", [qa])])
    )
    features = SquadFeatures(
        read_squad(path), load_squad_tokenizer(vocab), max_seq_length=16, max_query_length=8
    )
    # Positions: 0 [CLS], 1 what, 2 ?, 3 [SEP], 4 alpha, 5 beta, 6 gamma, 7 delta, 8 [SEP], 9-15 padding.
    start = torch.zeros(16)
    end = torch.zeros(16)
    start[1], start[6], start[4] = 9.0, 5.0, 4.0  # the question's 'what' is the highest start
    end[8], end[5], end[7] = 9.0, 5.0, 3.0  # the final [SEP] is the highest end
    # Valid pairs: (6, 7) = 5 + 3 = 8 and (4, 5) = 4 + 5 = 9; (6, 5) ends before it starts.
    span = best_span(features, 0, start, end)
    assert span is not None and span.score == 9.0
    assert postprocess(features, [(0, start, end)]) == {"q": "alpha beta"}
    # At most one token: (6, 6) = 5 + 0 and (5, 5) = 0 + 5 tie; start 6 ranks before start 5 in the
    # n-best list, so the reference keeps 'gamma'.
    assert postprocess(features, [(0, start, end)], max_answer_length=1) == {"q": "gamma"}
    # Two best starts (1, 6) x two best ends (8, 5): every pair is invalid, so no answer.
    assert best_span(features, 0, start, end, n_best_size=2) is None
    assert postprocess(features, [(0, start, end)], n_best_size=2) == {"q": ""}


@pytest.mark.parametrize("sizes", [REFERENCE, MEDIUM], ids=["reference", "medium"])
def test_oracle_logits_give_every_gold_answer(smoke: Smoke, sizes: dict[str, int]) -> None:
    features = dev_features(smoke, sizes)
    assert len(features) > len(features.examples)  # some questions span several windows
    logits = [(k, *oracle_logits(features, k)) for k in range(len(features))]
    predictions = postprocess(features, logits)
    assert predictions == gold(features)
    truths = {e.id: [a.text for a in e.answers] for e in features.examples}
    assert squad_v11_scores(truths, predictions) == {"exact_match": 100.0, "f1": 100.0}


class OracleModel(nn.Module):
    """Returns :func:`oracle_logits` for each input row, found by its token ids."""

    def __init__(self, features: SquadFeatures) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the task a device to read
        self.table = {}
        for k in range(len(features)):
            key = features[k]["input_ids"].numpy().tobytes()
            assert key not in self.table, "two features with the same input"
            self.table[key] = oracle_logits(features, k)

    def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
        rows = [self.table[row.numpy().tobytes()] for row in input_ids]
        start = torch.stack([r[0] for r in rows]) + self.anchor
        return start, torch.stack([r[1] for r in rows])


def test_evaluate_with_oracle_model_scores_100(smoke: Smoke) -> None:
    features = dev_features(smoke, MEDIUM)
    task = SquadTask()
    loader = DataLoader(features, batch_size=7, collate_fn=squad_collate)
    assert task.evaluate(OracleModel(features), loader) == {"exact_match": 100.0, "f1": 100.0}
    assert task.last_predictions == gold(features)


def test_save_outputs_writes_the_last_predictions_for_squad_eval(
    smoke: Smoke, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = SquadTask()
    assert task.save_outputs(tmp_path) is None  # never evaluated: nothing to write
    features = dev_features(smoke, MEDIUM)
    loader = DataLoader(features, batch_size=7, collate_fn=squad_collate)
    metrics = task.evaluate(OracleModel(features), loader)
    path = task.save_outputs(tmp_path)
    assert path == tmp_path / PREDICTIONS_FILE
    assert json.loads(path.read_text()) == task.last_predictions == gold(features)
    # The official scoring of the written file is what evaluate reported.
    assert squad_eval_main([str(smoke.dev), str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == metrics


def _evaluate_shard(rank: int, world: int, features: SquadFeatures) -> dict[str, object]:
    sampler = ShardSampler(features, world, rank)
    loader = DataLoader(features, batch_size=5, sampler=sampler, collate_fn=squad_collate)
    task = SquadTask()
    return {"metrics": task.evaluate(OracleModel(features), loader), "pred": task.last_predictions}


@pytest.mark.distributed
def test_evaluate_gathers_features_across_ranks(smoke: Smoke) -> None:
    features = dev_features(smoke, MEDIUM)
    results = run_distributed(_evaluate_shard, 2, features)
    for result in results:
        assert result["metrics"] == {"exact_match": 100.0, "f1": 100.0}
        assert result["pred"] == gold(features)


def test_evaluate_needs_the_evaluation_features(smoke: Smoke) -> None:
    train = SquadFeatures(read_squad(smoke.train), load_squad_tokenizer(smoke.vocab), training=True)
    model = build_bert_qa("tiny", vocab_size=2000)
    with pytest.raises(UserError, match="evaluation SquadFeatures"):
        SquadTask().evaluate(model, DataLoader(train, batch_size=4, collate_fn=squad_collate))


def test_tiny_bert_learns_on_the_smoke_set(smoke: Smoke) -> None:
    torch.manual_seed(0)
    tokenizer = load_squad_tokenizer(smoke.vocab)
    train = SquadFeatures(read_squad(smoke.train), tokenizer, training=True, **SHORT)
    model = build_bert_qa("tiny", vocab_size=train.vocab_size)
    task = SquadTask()
    subset = squad_collate([train[k] for k in range(16)])

    def subset_loss() -> float:
        model.eval()
        with torch.no_grad():
            return task.loss(model, subset).item()

    before = subset_loss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(10):
        rows = slice(8 * (step % 2), 8 * (step % 2) + 8)
        optimizer.zero_grad()
        task.loss(model, {k: v[rows] for k, v in subset.items()}).backward()
        optimizer.step()
    after = subset_loss()
    assert after < 0.7 * before, (before, after)

    val = SquadFeatures(read_squad(smoke.dev), tokenizer, **SHORT)
    metrics = task.evaluate(model, DataLoader(val, batch_size=16, collate_fn=squad_collate))
    assert set(metrics) == {"exact_match", "f1"}
    assert 0.0 <= metrics["exact_match"] <= metrics["f1"] <= 100.0
    assert set(task.last_predictions) == {e.id for e in val.examples}
