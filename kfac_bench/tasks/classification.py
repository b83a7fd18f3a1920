"""Image classification: cross-entropy (optionally label-smoothed) loss, top-k accuracy evaluation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

__all__ = ["ClassificationTask", "build_classification"]


class ClassificationTask:
    """Batches are ``(images, labels)`` with labels of shape (N,) holding class indices.

    Args:
        label_smoothing: cross-entropy label smoothing (the paper's ImageNet runs use 0.1).
        topk: accuracies reported by ``evaluate`` as ``top1``, ``top5``... (k above the class count is
            skipped).
        target_metric: the metric the run's target refers to.
    """

    higher_is_better = True

    def __init__(
        self,
        label_smoothing: float = 0.0,
        topk: Sequence[int] = (1, 5),
        target_metric: str = "top1",
    ) -> None:
        self.label_smoothing = label_smoothing
        self.topk = tuple(int(k) for k in topk)
        self.target_metric = target_metric

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The keys :meth:`evaluate` returns (``topK`` only where K <= the number of classes)."""
        return ("loss", *(f"top{k}" for k in self.topk))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels, label_smoothing=self.label_smoothing)

    def batch_size(self, batch: Any) -> int:
        return int(batch[1].shape[0])

    def to_device(self, batch: Any, device: torch.device) -> Any:
        images, labels = batch
        return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """``loss`` (mean cross-entropy without smoothing) and ``topK`` accuracies over all ranks' shards."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        # sums: [loss, count, correct@k...] reduced in one collective.
        sums = torch.zeros(2 + len(self.topk), dtype=torch.float64, device=device)
        num_classes = 0
        for batch in loader:
            images, labels = self.to_device(batch, device)
            logits = model(images).float()
            num_classes = logits.shape[1]
            sums[0] += F.cross_entropy(logits, labels, reduction="sum").double()
            sums[1] += labels.numel()
            ranked = logits.topk(min(max(self.topk), num_classes), dim=1).indices
            hits = ranked.eq(labels.unsqueeze(1))
            for i, k in enumerate(self.topk):
                sums[2 + i] += hits[:, :k].any(dim=1).sum()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        model.train(was_training)
        count = max(sums[1].item(), 1.0)
        metrics = {"loss": sums[0].item() / count}
        for i, k in enumerate(self.topk):
            if num_classes == 0 or k <= num_classes:
                metrics[f"top{k}"] = sums[2 + i].item() / count
        return metrics


def build_classification(
    label_smoothing: float = 0.0, topk: Sequence[int] = (1, 5), target_metric: str = "top1"
) -> ClassificationTask:
    """Builder named by ``configs/task/classification.yaml``."""
    return ClassificationTask(
        label_smoothing=label_smoothing, topk=topk, target_metric=target_metric
    )
