"""Instance detection and segmentation (Mask R-CNN on COCO): the training loss and COCO mAP evaluation.

Targets (TPDS §6.3.2, KAISA Table 1): the paper's runs stop at the first per-epoch evaluation reaching
**bbox mAP 0.377 and segm mAP 0.342** (:data:`PAPER_TARGETS`, MLPerf v0.6/v0.7's values). MLPerf's
current Mask R-CNN rules use segm 0.339 (:data:`MLPERF_TARGETS`). The targets are a config value
(``train.targets``); the run's one stop test, :class:`kfac_bench.metrics.timekeeping.TargetTracker`,
needs every one of them met.

Batches are ``(images, targets)`` as built by :func:`kfac_bench.data.coco.collate_detection`.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch import nn
from torch.utils.data import Subset

from kfac_bench.data.coco import Target
from kfac_bench.errors import ConfigError
from kfac_bench.rank_zero import from_main

log = logging.getLogger(__name__)

#: What :meth:`DetectionTask.evaluate` reports: COCOeval mAP@[.5:.95] of boxes and of masks.
METRICS = ("bbox_map", "segm_map")
PAPER_TARGETS: dict[str, float] = {"bbox_map": 0.377, "segm_map": 0.342}
MLPERF_TARGETS: dict[str, float] = {"bbox_map": 0.377, "segm_map": 0.339}

# COCO-format results of one image: (bbox results, segm results).
ImageResults = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def _unwrap(model: nn.Module) -> nn.Module:
    # Evaluate the bare module: DDP's forward may broadcast buffers, a collective that would hang when ranks
    # hold different numbers of evaluation batches.
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _coco_source(loader: Iterable[Any]) -> Any:
    """The dataset behind ``loader`` that carries ``coco`` (ground truth) and ``label_to_category_id``."""
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if not (hasattr(dataset, "coco") and hasattr(dataset, "label_to_category_id")):
        raise TypeError(
            "DetectionTask.evaluate needs a DataLoader over kfac_bench.data.coco.CocoInstances "
            f"(possibly inside a Subset), got dataset {type(dataset).__name__}"
        )
    return dataset


def to_coco_results(
    output: Mapping[str, torch.Tensor],
    image_id: int,
    label_to_category_id: Mapping[int, int],
    mask_threshold: float = 0.5,
) -> ImageResults:
    """Convert one image's Mask R-CNN output into COCO result dicts.

    Args:
        output: ``boxes`` ``(N, 4)`` xyxy in original-image pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)``,
            ``masks`` ``(N, 1, H, W)`` probabilities, as torchvision's ``MaskRCNN`` returns in eval mode.
        image_id: COCO image id.
        label_to_category_id: model label -> COCO category id; detections of other labels are dropped.
        mask_threshold: probability above which a pixel is in the mask (0.5 as in the references).

    Returns:
        ``(bbox_results, segm_results)``: one dict per detection with ``image_id``, ``category_id``, ``score``
        and ``bbox`` ``[x, y, w, h]`` or ``segmentation`` (compressed RLE, ``counts`` a str).
    """
    # A head sized for raw category ids has outputs for ids that are no category (COCO skips 12, 26, ...);
    # such detections can never match and COCOeval would ignore them, so they are dropped here.
    labels = output["labels"].tolist()
    keep = torch.tensor([label in label_to_category_id for label in labels], dtype=torch.bool)
    categories = [label_to_category_id[label] for label in labels if label in label_to_category_id]
    boxes = output["boxes"].detach().float().cpu()[keep]
    boxes[:, 2:] -= boxes[:, :2]
    scores = output["scores"].detach().float().cpu()[keep].tolist()
    masks = (output["masks"].detach()[:, 0] > mask_threshold).cpu()[keep].to(torch.uint8).numpy()
    rles = mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0))) if len(masks) else []
    bbox_results, segm_results = [], []
    for box, score, category, rle in zip(boxes.tolist(), scores, categories, rles, strict=True):
        common = {"image_id": image_id, "category_id": category, "score": score}
        bbox_results.append({**common, "bbox": box})
        rle = {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")}
        segm_results.append({**common, "segmentation": rle})
    return bbox_results, segm_results


def _gather_to_rank0(local: dict[int, ImageResults]) -> dict[int, ImageResults] | None:
    """Merge every rank's per-image results on rank 0 (``None`` elsewhere).

    An image evaluated on several ranks (DistributedSampler pads shards by repeating images) is kept once.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[int, ImageResults] = {}
    for part in gathered:
        for image_id, results in part.items():
            merged.setdefault(image_id, results)
    return merged


def coco_map(coco_gt: COCO, per_image: Mapping[int, ImageResults]) -> dict[str, float]:
    """COCOeval mAP@[.5:.95] (area all, 100 detections) for bbox and segm over the images in ``per_image``.

    Only the evaluated images count (``params.imgIds``), so an evaluation over a subset is scored on that
    subset. No detection at all scores 0.0.
    """
    image_ids = sorted(per_image)
    metrics: dict[str, float] = {}
    for kind, index in (("bbox", 0), ("segm", 1)):
        results = [r for image_id in image_ids for r in per_image[image_id][index]]
        if not results:
            metrics[f"{kind}_map"] = 0.0
            continue
        summary = io.StringIO()
        # pycocotools prints its progress and the 12-line summary; keep it for the log instead of stdout.
        with contextlib.redirect_stdout(summary):
            coco_eval = COCOeval(coco_gt, coco_gt.loadRes(results), iouType=kind)
            coco_eval.params.imgIds = image_ids
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()
        log.info("COCOeval %s over %d images:\n%s", kind, len(image_ids), summary.getvalue())
        metrics[f"{kind}_map"] = float(coco_eval.stats[0])
    return metrics


class DetectionTask:
    """Mask R-CNN training loss and COCO bbox/segm mAP evaluation (implements ``tasks.base.Task``).

    Args:
        targets: the run's targets (``train.targets``; default :data:`PAPER_TARGETS`): each must name a
            metric :meth:`evaluate` reports, so a misspelt target fails at start-up instead of never being
            met. The stop test itself is the run's ``TargetTracker``.
        mask_threshold: mask probability threshold for segm results.

    Attributes:
        target_metric: ``"bbox_map"``, the primary metric; the segm target is in ``targets``.
        last_loss_parts: detached components of the last :meth:`loss` (torchvision's loss dict).

    Raises:
        ConfigError: a target names a metric this task does not report.
    """

    target_metric = "bbox_map"
    higher_is_better = True
    metric_names = tuple(METRICS)

    def __init__(
        self, targets: Mapping[str, float] | None = None, mask_threshold: float = 0.5
    ) -> None:
        self.targets = dict(PAPER_TARGETS if targets is None else targets)
        unknown = sorted(set(self.targets) - set(METRICS))
        if unknown:
            raise ConfigError(
                f"train.targets names {', '.join(unknown)}, which detection does not report: "
                f"use {' and/or '.join(METRICS)}"
            )
        self.mask_threshold = mask_threshold
        self.last_loss_parts: dict[str, torch.Tensor] = {}

    def loss(
        self, model: nn.Module, batch: tuple[list[torch.Tensor], list[Target]]
    ) -> torch.Tensor:
        """Sum of torchvision's Mask R-CNN losses (classifier, box, mask, objectness, RPN box); each is
        already a mean over its sampled proposals/anchors. ``model`` must be in training mode."""
        images, targets = batch
        loss_dict = model(images, targets)
        self.last_loss_parts = {name: value.detach() for name, value in loss_dict.items()}
        return torch.stack(list(loss_dict.values())).sum()

    def batch_size(self, batch: tuple[list[torch.Tensor], list[Target]]) -> int:
        return len(batch[0])

    def to_device(
        self, batch: tuple[list[torch.Tensor], list[Target]], device: torch.device
    ) -> tuple[list[torch.Tensor], list[Target]]:
        images, targets = batch
        moved = [
            {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
            for t in targets
        ]
        return [image.to(device, non_blocking=True) for image in images], moved

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """COCO mAP of ``model`` over this rank's shard ``loader``, merged over ranks.

        Every rank runs the model on its shard; results are gathered to rank 0, which runs COCOeval on the
        union of evaluated images against the annotation file (crowds are ignore regions there); the metrics
        are broadcast so every rank returns the same ``{"bbox_map": ..., "segm_map": ...}``. The model's
        train/eval mode is restored afterwards.
        """
        source = _coco_source(loader)
        module = _unwrap(model)
        was_training = module.training
        module.eval()
        device = next(module.parameters()).device
        local: dict[int, ImageResults] = {}
        try:
            for batch in loader:
                images, targets = self.to_device(batch, device)
                for output, target in zip(module(images), targets, strict=True):
                    image_id = int(target["image_id"])
                    local[image_id] = to_coco_results(
                        output, image_id, source.label_to_category_id, self.mask_threshold
                    )
        finally:
            module.train(was_training)
        merged = _gather_to_rank0(local)
        metrics = coco_map(source.coco, merged) if merged is not None else None
        return from_main(metrics)
