"""BERT pretraining: masked-LM + next-sentence-prediction loss, masked-LM accuracy evaluation.

Batches are the dicts of :mod:`kfac_bench.data.bert` (int64 tensors): ``input_ids``, ``attention_mask``,
``token_type_ids`` of shape (B, L); ``labels`` (B, L) holding the original token id at masked positions
and ``-100`` elsewhere; ``next_sentence_label`` (B,) with 1 = segment B is a random sentence.

The run's target is masked-LM accuracy on held-out shards (default 0.720, the MLPerf BERT value). The
paper's own target, SQuAD v1.1 F1 after fine-tuning, needs SQuAD and a fine-tuning stage that kfac-bench
does not have.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kfac_bench.errors import UserError

__all__ = ["MaskedLMTask", "build_masked_lm"]

IGNORE_INDEX = -100


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLM logits (B, L, V), NSP logits (B, 2)) of ``BertForPreTraining`` (plain, DDP or compiled)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
    )
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.prediction_logits, out.seq_relationship_logits


class MaskedLMTask:
    """Loss and evaluation of BERT pretraining (NVIDIA's ``BertPretrainingCriterion``).

    ``loss`` = mean cross-entropy over this micro-batch's masked tokens + mean NSP cross-entropy over its
    sequences, both computed in float32. The MLM logits are gathered at masked positions before the
    float32 cast, so the (B, L, 30522) tensor is never copied in full.
    """

    target_metric = "mlm_accuracy"
    higher_is_better = True
    metric_names = ("mlm_accuracy", "mlm_loss", "nsp_accuracy", "nsp_loss")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        mlm_logits, nsp_logits = _logits(model, batch)
        labels = batch["labels"]
        masked = labels != IGNORE_INDEX
        mlm = F.cross_entropy(mlm_logits[masked].float(), labels[masked])
        nsp = F.cross_entropy(nsp_logits.float(), batch["next_sentence_label"].reshape(-1))
        return mlm + nsp

    def batch_size(self, batch: Any) -> int:
        return int(batch["input_ids"].shape[0])

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """Metrics over every rank's share of ``loader``, identical on all ranks.

        Returns:
            ``mlm_accuracy`` (argmax hits / masked tokens), ``mlm_loss`` (mean cross-entropy per masked
            token), ``nsp_accuracy`` and ``nsp_loss`` (per sequence). Sums and counts are all-reduced
            before dividing, so the result is exact however the examples are split across ranks.

        Raises:
            UserError: no masked token in the whole evaluation set.
        """
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        # [mlm hits, mlm tokens, mlm loss sum, nsp hits, nsp sequences, nsp loss sum] in one collective.
        sums = torch.zeros(6, dtype=torch.float64, device=device)
        for raw in loader:
            batch = self.to_device(raw, device)
            mlm_logits, nsp_logits = _logits(model, batch)
            masked = batch["labels"] != IGNORE_INDEX
            logits, labels = mlm_logits[masked].float(), batch["labels"][masked]
            nsp_logits, nsp_labels = nsp_logits.float(), batch["next_sentence_label"].reshape(-1)
            sums += torch.stack(
                [
                    (logits.argmax(-1) == labels).sum().double(),
                    torch.tensor(labels.numel(), dtype=torch.float64, device=device),
                    F.cross_entropy(logits, labels, reduction="sum").double(),
                    (nsp_logits.argmax(-1) == nsp_labels).sum().double(),
                    torch.tensor(nsp_labels.numel(), dtype=torch.float64, device=device),
                    F.cross_entropy(nsp_logits, nsp_labels, reduction="sum").double(),
                ]
            )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        model.train(was_training)
        mlm_hits, mlm_count, mlm_loss, nsp_hits, nsp_count, nsp_loss = sums.tolist()
        if mlm_count == 0:
            raise UserError("the evaluation data holds no masked tokens: check the held-out shards")
        return {
            "mlm_accuracy": mlm_hits / mlm_count,
            "mlm_loss": mlm_loss / mlm_count,
            "nsp_accuracy": nsp_hits / nsp_count,
            "nsp_loss": nsp_loss / nsp_count,
        }


def build_masked_lm() -> MaskedLMTask:
    """Task builder (``task._target_``)."""
    return MaskedLMTask()
