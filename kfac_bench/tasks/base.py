"""The contract between the training loop and a benchmark family.

The loop (``kfac_bench.train.loop``) owns the order of a step; a task only says what the loss of a batch
is and how a model is evaluated. Tasks never call ``backward()`` nor touch the optimizer or the
preconditioner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Task(Protocol):
    """One benchmark family (classification, detection, masked LM).

    Attributes:
        target_metric: key of the metric in ``evaluate``'s result that the run's target refers to
            (e.g. ``"top1"``, ``"bbox_map"``, ``"mlm_accuracy"``).
        higher_is_better: direction of ``target_metric``.

    Note:
        Two optional members, not part of the protocol (tasks without them need nothing):
        ``save_outputs(run_dir: Path) -> None``, which the run calls once on rank 0 after training, before
        ``summary.json``, to write what its last evaluation produced (SQuAD writes ``predictions.json``);
        and ``metric_names``, the keys ``evaluate`` returns, so that a target on any other metric is
        refused before the run starts (:func:`kfac_bench.launcher.preflight.check_targets`).
    """

    target_metric: str
    higher_is_better: bool

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean-reduced loss of one (micro-)batch already on the model's device."""
        ...

    def batch_size(self, batch: Any) -> int:
        """Number of examples in ``batch`` (for samples/s and sample counts)."""
        ...

    def to_device(self, batch: Any, device: torch.device) -> Any:
        """Move a batch from the loader to ``device``."""
        ...

    def evaluate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """Metrics over ``loader``. Under torch.distributed every rank calls it on its shard of the
        evaluation data and every rank returns the same, globally reduced, metrics."""
        ...
