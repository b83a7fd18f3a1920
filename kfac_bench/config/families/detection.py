"""Schemas and the split builders of the Mask R-CNN benchmark (issue 6): ``model=maskrcnn``,
``dataset=coco`` / ``coco_tiny``, ``task=detection``.

Each dataclass is ``_target_`` plus the builder's keyword arguments, so a misspelt key fails when the config
is composed. The recipes ``recipes/maskrcnn_coco*.yaml`` select them.

The harness calls a dataset builder once for both splits (or twice with ``train=True/False`` when it takes
``train``); COCO's training and evaluation sets are different annotation files, so
:func:`build_coco_splits` builds both from one config and hands back the detection collate function.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCHEMAS", "build_coco_splits", "build_tiny_coco"]


def build_coco_splits(
    root: str,
    train_split: str = "train2017",
    val_split: str = "val2017",
    train_image_dir: str | None = None,
    val_image_dir: str | None = None,
    hflip_prob: float = 0.5,
    contiguous_labels: bool = False,
) -> tuple[Any, Any, Any]:
    """COCO training and evaluation sets under ``root`` (a ``dataset._target_``).

    Args:
        root: folder holding ``annotations/instances_<split>.json`` and the image folders.
        train_split / val_split: annotation split names (``train2017``/``val2017``; the MLPerf 2014 layout's
            evaluation split is ``minival2014`` with ``val_image_dir=val2014``).
        train_image_dir / val_image_dir: image folders when not named after the split.
        hflip_prob: horizontal-flip probability in training (0.5 as the references).
        contiguous_labels: labels 1..K instead of raw category ids (the model's ``num_classes`` must match).

    Returns:
        ``(train, val, collate_detection)``: two ``CocoInstances``; batches are ``(list of images,
        list of targets)``.

    Raises:
        DatasetError: a split's annotation file or image folder is missing (before any training work).
    """
    # Imported here: this module is read whenever any config composes (also for `kfac-bench --help`).
    from kfac_bench.data.coco import build_coco, collate_detection

    train = build_coco(root, train_split, True, hflip_prob, contiguous_labels, train_image_dir)
    val = build_coco(root, val_split, False, hflip_prob, contiguous_labels, val_image_dir)
    return train, val, collate_detection


def build_tiny_coco(
    root: str, n_train: int = 8, n_val: int = 4, seed: int = 0
) -> tuple[Any, Any, Any]:
    """The tiny real-format COCO set of :mod:`kfac_bench.data.coco_fixtures` (smoke runs), written to
    ``root`` (``train2017``/``val2017``) on first use and read back through the real COCO reader.

    Raw category ids 1, 3 and 7: the model needs ``num_classes >= 8``.
    """
    from kfac_bench.data.coco_fixtures import write_tiny_coco

    for split, n, offset in (("train2017", n_train, 1), ("val2017", n_val, 2)):
        if not (Path(root) / "annotations" / f"instances_{split}.json").is_file():
            write_tiny_coco(root, split, n_images=n, seed=seed * 10 + offset)
    return build_coco_splits(root)


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
    """:func:`build_coco_splits`: COCO instances JSON + image folders under ``root``."""

    _target_: str = "kfac_bench.config.families.detection.build_coco_splits"
    root: str = "data/coco"
    train_split: str = "train2017"
    val_split: str = "val2017"
    train_image_dir: str | None = None
    val_image_dir: str | None = None
    hflip_prob: float = 0.5
    contiguous_labels: bool = False


@dataclass
class CocoTinyConfig:
    """:func:`build_tiny_coco`: a tiny COCO-format set written to ``root`` on first use (smoke runs)."""

    _target_: str = "kfac_bench.config.families.detection.build_tiny_coco"
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
