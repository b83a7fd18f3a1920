"""Schemas of the Mask R-CNN benchmark's builders: ``model=maskrcnn``, ``dataset=coco`` / ``coco_tiny``,
``task=detection``.

Each dataclass is ``_target_`` plus the builder's keyword arguments (same names and defaults; a test keeps
them in step), so a misspelt key fails when the config is composed. The recipes
``recipes/maskrcnn_coco*.yaml`` select them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEMAS"]


@dataclass
class MaskRCNNModelConfig:
    """:func:`kfac_bench.models.maskrcnn.build_maskrcnn`: torchvision Mask R-CNN ResNet-50-FPN, frozen
    backbone batch norm. ``backbone_weights``: a local ImageNet ResNet-50 state_dict (None: from scratch)."""

    _target_: str = "kfac_bench.models.maskrcnn.build_maskrcnn"
    num_classes: int = 91
    backbone_weights: str | None = None
    min_size: int = 800
    max_size: int = 1333
    trainable_backbone_layers: int = 3
    rpn_post_nms_top_n_train: int = 2000
    rpn_pre_nms_top_n_test: int = 1000
    rpn_post_nms_top_n_test: int = 1000
    box_batch_size_per_image: int = 512
    box_detections_per_img: int = 100


@dataclass
class CocoConfig:
    """:func:`kfac_bench.data.coco.build_coco`: COCO instances JSON + image folders under ``root``."""

    _target_: str = "kfac_bench.data.coco.build_coco"
    root: str = "data/coco"
    train_split: str = "train2017"
    val_split: str = "val2017"
    train_image_dir: str | None = None
    val_image_dir: str | None = None
    hflip_prob: float = 0.5
    contiguous_labels: bool = False


@dataclass
class CocoTinyConfig:
    """:func:`kfac_bench.data.coco.build_tiny_coco`: a tiny COCO-format set written to ``root`` on first
    use (smoke runs)."""

    _target_: str = "kfac_bench.data.coco.build_tiny_coco"
    root: str = "data/coco_tiny"
    n_train: int = 8
    n_val: int = 4
    seed: int = 0


@dataclass
class DetectionTaskConfig:
    """:class:`kfac_bench.tasks.detection.DetectionTask`: Mask R-CNN loss, COCOeval bbox/segm mAP.
    ``targets`` (every one must be met) follows ``train.targets``, which the harness's stop test reads."""

    _target_: str = "kfac_bench.tasks.detection.DetectionTask"
    targets: Any = None
    mask_threshold: float = 0.5


SCHEMAS: list[tuple[str, str, type]] = [
    ("model", "maskrcnn", MaskRCNNModelConfig),
    ("dataset", "coco", CocoConfig),
    ("dataset", "coco_tiny", CocoTinyConfig),
    ("task", "detection", DetectionTaskConfig),
]
