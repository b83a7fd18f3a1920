"""SQuAD v1.1 fine-tuning: span loss, the reference post-processing, official exact match / F1.

Batches are the dicts of :class:`kfac_bench.data.squad.SquadFeatures` (int64 tensors of shape (B, L)):
``input_ids``, ``token_type_ids``, ``attention_mask``; training batches add ``start_positions`` and
``end_positions`` (B,), evaluation batches ``feature_index`` (B,). The model is a
``BertForQuestionAnswering`` (:mod:`kfac_bench.models.bert_qa`) returning start and end logits (B, L).

Post-processing follows NVIDIA DeepLearningExamples ``PyTorch/LanguageModeling/BERT/run_squad.py``
(``get_answers``, ``get_valid_prelim_predictions``) and the authors' copy in gpauloski/BERT-PyTorch
``run_squad.py``: in every feature, pair each of the ``n_best_size`` highest start logits with each of the
``n_best_size`` highest end logits; drop pairs that leave the context, end before they start, are longer
than ``max_answer_length`` tokens or start where another window holds more context; the answer of a
question is the pair with the highest start + end logit over all its features, mapped back to the context
text through the tokenizer's character offsets (the reference re-aligns whitespace words instead).
A question without any valid pair gets the empty answer (the reference's placeholder is "empty").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Subset

from kfac_bench import safe_files
from kfac_bench.data.squad import SquadFeatures
from kfac_bench.errors import UserError
from kfac_bench.tasks.squad_eval import squad_v11_scores

__all__ = [
    "PREDICTIONS_FILE",
    "SpanCandidate",
    "SquadTask",
    "best_span",
    "build_squad_task",
    "combine_candidates",
    "postprocess",
    "span_loss",
]

N_BEST_SIZE = 20  # run_squad.py --n_best_size default
MAX_ANSWER_LENGTH = 30  # run_squad.py --max_answer_length default
#: The run directory's file of the last evaluation's answers (question id -> text), the format of the
#: reference's ``predictions.json`` and of ``kfac-bench squad-eval DATA_FILE PRED_FILE``.
PREDICTIONS_FILE = "predictions.json"


class SpanCandidate(NamedTuple):
    """The best answer span of one feature: its score and character span in the context."""

    feature_index: int
    score: float
    start_char: int
    end_char: int


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(start logits, end logits), each (B, L), of a question-answering model (plain, DDP or compiled)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
    )
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.start_logits, out.end_logits


def span_loss(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
) -> torch.Tensor:
    """Mean of the start and end cross-entropies in float32 (``BertForQuestionAnswering``'s loss and the
    reference's ``(start_loss + end_loss) / 2``)."""
    start = F.cross_entropy(start_logits.float(), start_positions)
    end = F.cross_entropy(end_logits.float(), end_positions)
    return (start + end) / 2


def best_span(
    features: SquadFeatures,
    index: int,
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    n_best_size: int = N_BEST_SIZE,
    max_answer_length: int = MAX_ANSWER_LENGTH,
) -> SpanCandidate | None:
    """The reference's best valid (start, end) pair of feature ``index``, or None if no pair is valid.

    Ties go to the pair the reference ranks first: its n-best lists are stable sorts by logit and its
    candidates are stably sorted by score, so the first (start rank, end rank) pair in row-major order
    wins. Scores are float64 sums, as the reference adds Python floats.
    """
    start, end = start_logits.detach().double().cpu(), end_logits.detach().double().cpu()
    starts = torch.sort(start, descending=True, stable=True).indices[:n_best_size]
    ends = torch.sort(end, descending=True, stable=True).indices[:n_best_size]
    first = features.context_position(index)
    offsets = torch.from_numpy(features.context_offsets(index))
    max_context = torch.from_numpy(features.token_is_max_context(index))
    n = len(offsets)
    s, e = starts[:, None], ends[None, :]
    in_context_s = (s >= first) & (s < first + n)
    valid = (
        in_context_s
        & (e >= first)
        & (e < first + n)
        & (e >= s)
        & (e - s + 1 <= max_answer_length)
        & max_context[(s - first).clamp(0, max(n - 1, 0))]
        if n
        else torch.zeros(len(starts), len(ends), dtype=torch.bool)
    )
    if not bool(valid.any()):
        return None
    scores = (start[s] + end[e]).masked_fill(~valid, float("-inf"))
    flat = int(torch.argmax(scores.flatten()))  # the first maximum
    i, j = divmod(flat, len(ends))
    s_tok, e_tok = int(starts[i]) - first, int(ends[j]) - first
    return SpanCandidate(index, float(scores[i, j]), int(offsets[s_tok, 0]), int(offsets[e_tok, 1]))


def combine_candidates(
    features: SquadFeatures, candidates: Iterable[tuple[int, SpanCandidate | None]]
) -> dict[str, str]:
    """Answer text per question id from ``(feature_index, best span or None)`` of its features.

    The highest score wins; ties go to the earlier feature, as in the reference's stable sort. Every
    question with at least one feature in ``candidates`` gets an answer ("" if none was valid).
    """
    best: dict[int, SpanCandidate | None] = {}
    for index, candidate in sorted(candidates, key=lambda item: item[0]):
        e = features.features[index].example_index
        current = best.get(e)
        if e not in best or (
            candidate is not None and (current is None or candidate.score > current.score)
        ):
            best[e] = candidate
    predictions = {}
    for e, candidate in best.items():
        example = features.examples[e]
        text = (
            "" if candidate is None else example.context[candidate.start_char : candidate.end_char]
        )
        predictions[example.id] = text
    return predictions


def postprocess(
    features: SquadFeatures,
    logits: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    n_best_size: int = N_BEST_SIZE,
    max_answer_length: int = MAX_ANSWER_LENGTH,
) -> dict[str, str]:
    """Predictions ``{question id: answer text}`` from ``(feature_index, start_logits, end_logits)``."""
    return combine_candidates(
        features,
        ((k, best_span(features, k, s, e, n_best_size, max_answer_length)) for k, s, e in logits),
    )


def _eval_features(loader: Any) -> SquadFeatures:
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if not isinstance(dataset, SquadFeatures) or dataset.training:
        raise UserError(
            "SQuAD evaluation needs the evaluation SquadFeatures (kfac_bench.data.squad) as the loader's "
            f"dataset, got {type(dataset).__name__}: use the squad dataset with the squad task"
        )
    return dataset


class SquadTask:
    """Loss and evaluation of SQuAD v1.1 fine-tuning (the task contract of :mod:`kfac_bench.tasks.base`).

    ``evaluate`` returns ``exact_match`` and ``f1`` in percent, as the official script prints them, over
    the questions whose features the loader yielded (all of them unless the loop limits evaluation
    batches); the predictions are kept in :attr:`last_predictions` (question id -> answer text) and
    :meth:`save_outputs` writes them to the run directory as ``predictions.json``.
    """

    target_metric = "f1"
    higher_is_better = True
    metric_names = ("exact_match", "f1")

    def __init__(
        self, n_best_size: int = N_BEST_SIZE, max_answer_length: int = MAX_ANSWER_LENGTH
    ) -> None:
        self.n_best_size = n_best_size
        self.max_answer_length = max_answer_length
        self.last_predictions: dict[str, str] = {}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        start, end = _logits(model, batch)
        return span_loss(start, end, batch["start_positions"], batch["end_positions"])

    def batch_size(self, batch: Any) -> int:
        return int(batch["input_ids"].shape[0])

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    @torch.no_grad()
    def predict(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, str]:
        """Answers of the questions in ``loader`` (every rank's share), identical on all ranks."""
        features = _eval_features(loader)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        local: list[tuple[int, SpanCandidate | None]] = []
        for raw in loader:
            batch = self.to_device(raw, device)
            start, end = (t.float().cpu() for t in _logits(model, batch))
            for row, k in enumerate(raw["feature_index"].tolist()):
                span = best_span(
                    features, k, start[row], end[row], self.n_best_size, self.max_answer_length
                )
                local.append((k, span))
        model.train(was_training)
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            local = [item for part in gathered for item in part]
        return combine_candidates(features, local)

    def evaluate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        features = _eval_features(loader)
        predictions = self.predict(model, loader)
        self.last_predictions = predictions
        truths = {
            e.id: [a.text for a in e.answers] for e in features.examples if e.id in predictions
        }
        return squad_v11_scores(truths, predictions)

    def save_outputs(self, run_dir: str | os.PathLike[str]) -> Path | None:
        """Write :attr:`last_predictions` to ``run_dir/predictions.json`` (atomically); None if the run
        never evaluated."""
        if not self.last_predictions:
            return None
        text = json.dumps(self.last_predictions, indent=1, ensure_ascii=False) + "\n"
        return safe_files.write_atomic(Path(run_dir) / PREDICTIONS_FILE, text)


def build_squad_task(
    n_best_size: int = N_BEST_SIZE, max_answer_length: int = MAX_ANSWER_LENGTH
) -> SquadTask:
    """Task builder (``task._target_``)."""
    return SquadTask(n_best_size=n_best_size, max_answer_length=max_answer_length)
