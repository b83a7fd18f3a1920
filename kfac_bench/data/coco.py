"""COCO instances (2014 or 2017) for Mask R-CNN: images, boxes, labels and instance masks.

Layout read (the one the COCO download unpacks to)::

    <root>/annotations/instances_<split>.json
    <root>/<split>/*.jpg                 (or <root>/<image_dir>/ when ``image_dir`` is given)

e.g. ``split="train2017"`` / ``"val2017"``, or for the 2014 layout used by the MLPerf reference
``split="train2014"`` and ``split="valminusminival2014"`` / ``"minival2014"`` with ``image_dir="val2014"``.

Handling follows the torchvision detection reference and the MLPerf (maskrcnn-benchmark) reference:

* crowd annotations (``iscrowd=1``) are dropped from the targets, for training and evaluation alike;
  evaluation scores against the annotation file itself, where COCOeval treats crowds as ignore regions;
* with ``train=True`` images without a valid annotation are removed: no annotation at all, or only boxes with
  a width or height of at most 1 pixel. As in both references the check counts crowd annotations, so an image
  whose only annotations are crowds stays in training as an image without targets (Mask R-CNN takes those).
  With ``train=False`` every image is kept;
* boxes are converted from COCO's ``[x, y, w, h]`` to ``[x0, y0, x1, y1]``, clipped to the image, and boxes
  with no area are dropped together with their masks.

Labels: by default the raw COCO category ids (1..90 for COCO; 0 is background), which is what torchvision's
``maskrcnn_resnet50_fpn(num_classes=91)`` expects. ``contiguous_labels=True`` maps the sorted category ids to
1..K instead (the MLPerf reference's 81-class head). Either way ``dataset.label_to_category_id`` maps a model
label back to a category id and ``dataset.num_classes`` is the head size to build the model with.

Resizing to the min/max image size (800/1333 in the paper's runs) is the model's job
(``GeneralizedRCNNTransform``, configured in :func:`kfac_bench.models.maskrcnn.build_maskrcnn`); this dataset
returns images at their stored size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from torchvision.datasets import CocoDetection
from torchvision.transforms.functional import pil_to_tensor

from kfac_bench.data.base import DataSplits
from kfac_bench.data.coco_fixtures import write_tiny_coco
from kfac_bench.data.images import load_rgb
from kfac_bench.errors import DatasetError

__all__ = [
    "CocoInstances",
    "Target",
    "annotation_to_mask",
    "build_coco",
    "build_tiny_coco",
    "coco_split",
    "collate_detection",
    "hflip",
]

Target = dict[str, Any]
_HOW_TO_GET = (
    "Download COCO from https://cocodataset.org/#download (images and 'annotations_trainval') "
    "and unpack both into dataset.root"
)


def coco_paths(root: str | Path, split: str, image_dir: str | None = None) -> tuple[Path, Path]:
    """Check the on-disk layout and return ``(image_folder, annotation_file)``.

    Raises:
        DatasetError: the root, the annotation file or the image folder is missing.
    """
    root = Path(root)
    image_folder = root / (image_dir or split)
    ann_file = root / "annotations" / f"instances_{split}.json"
    layout = (
        f"'annotations/instances_{split}.json' and the image folder '{image_folder.name}/' under it"
    )
    if not root.is_dir():
        raise DatasetError(root, f"a COCO root folder holding {layout}", _HOW_TO_GET)
    if not ann_file.is_file():
        raise DatasetError(ann_file, f"the COCO instances annotation file ({layout})", _HOW_TO_GET)
    if not image_folder.is_dir():
        raise DatasetError(
            image_folder, f"a folder of '{split}' JPEG images ({layout})", _HOW_TO_GET
        )
    return image_folder, ann_file


def annotation_to_mask(segmentation: Any, height: int, width: int) -> np.ndarray:
    """Decode one COCO ``segmentation`` field to an ``(height, width)`` uint8 mask.

    Accepts a list of polygons (merged into one object), an uncompressed RLE (``counts`` a list) or a
    compressed RLE (``counts`` a string or bytes).
    """
    if isinstance(segmentation, list):
        # pycocotools reads a 4-number list as a box, and polygons need at least 3 points.
        polygons = [p for p in segmentation if len(p) >= 6]
        if not polygons:
            return np.zeros((height, width), dtype=np.uint8)
        rle = mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))
    elif isinstance(segmentation.get("counts"), list):
        rle = mask_utils.frPyObjects(segmentation, height, width)
    else:
        rle = segmentation
    return mask_utils.decode(rle)


def _has_valid_annotation(annotations: Sequence[dict[str, Any]]) -> bool:
    """The references' training filter: at least one annotation whose box is more than 1 px wide and high."""
    return any(all(side > 1 for side in ann["bbox"][2:]) for ann in annotations)


def collate_detection(
    batch: Sequence[tuple[torch.Tensor, Target]],
) -> tuple[list[torch.Tensor], list[Target]]:
    """Collate ``(image, target)`` pairs into ``(images, targets)`` lists; images keep their own sizes."""
    images, targets = zip(*batch, strict=True) if batch else ((), ())
    return list(images), list(targets)


class CocoInstances(CocoDetection):
    """COCO images with Mask R-CNN targets.

    ``dataset[i]`` is ``(image, target)``: ``image`` is a ``(3, H, W)`` float tensor in [0, 1] at the stored
    size, ``target`` a dict with ``boxes`` ``(N, 4)`` float32 xyxy in pixels, ``labels`` ``(N,)`` int64,
    ``masks`` ``(N, H, W)`` uint8 and ``image_id`` (int, the COCO image id). ``N`` counts the non-crowd
    objects with a non-empty box and may be 0.
    """

    collate_fn = staticmethod(collate_detection)

    def __init__(
        self,
        root: str | Path,
        split: str,
        train: bool,
        hflip_prob: float = 0.5,
        contiguous_labels: bool = False,
        image_dir: str | None = None,
    ) -> None:
        image_folder, ann_file = coco_paths(root, split, image_dir)
        try:
            super().__init__(str(image_folder), str(ann_file))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DatasetError(
                ann_file, f"a COCO instances JSON file ({type(err).__name__}: {err})"
            ) from err
        self.split = split
        self.train = train
        self.hflip_prob = hflip_prob if train else 0.0
        category_ids = sorted(self.coco.getCatIds())
        if contiguous_labels:
            self.category_id_to_label = {cat: i + 1 for i, cat in enumerate(category_ids)}
        else:
            self.category_id_to_label = {cat: cat for cat in category_ids}
        self.label_to_category_id = {v: k for k, v in self.category_id_to_label.items()}
        self.num_classes = max(self.category_id_to_label.values(), default=0) + 1
        self.ids: list[int]
        if train:
            self.ids = [
                i
                for i in self.ids
                if _has_valid_annotation(
                    self.coco.loadAnns(self.coco.getAnnIds(imgIds=i, iscrowd=None))
                )
            ]

    def _load_image(self, id: int) -> Image.Image:
        # A missing, truncated or corrupt file is one line naming it (kfac_bench.data.images).
        return load_rgb(os.path.join(self.root, self.coco.loadImgs(id)[0]["file_name"]))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Target]:
        image_id = self.ids[index]
        pil_image = self._load_image(image_id)
        image = pil_to_tensor(pil_image).float().div_(255.0)
        target = self._target(
            self._load_target(image_id), image_id, image.shape[-2], image.shape[-1]
        )
        # torch.rand draws from the per-worker generator that DataLoader seeds, so flips differ per worker.
        if self.hflip_prob > 0 and torch.rand(()).item() < self.hflip_prob:
            image, target = hflip(image, target)
        return image, target

    def _target(
        self, annotations: list[dict[str, Any]], image_id: int, height: int, width: int
    ) -> Target:
        annotations = [a for a in annotations if a.get("iscrowd", 0) == 0]
        for ann in annotations:
            if "segmentation" not in ann:
                raise DatasetError(
                    self.root, f"instance masks ('segmentation') for annotation {ann.get('id')}"
                )
        boxes = torch.tensor([a["bbox"] for a in annotations], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(0, width)
        boxes[:, 1::2].clamp_(0, height)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        kept = [a for a, k in zip(annotations, keep.tolist(), strict=True) if k]
        masks = np.zeros((len(kept), height, width), dtype=np.uint8)
        for i, ann in enumerate(kept):
            masks[i] = annotation_to_mask(ann["segmentation"], height, width)
        labels = [self.category_id_to_label[a["category_id"]] for a in kept]
        return {
            "boxes": boxes[keep],
            "labels": torch.tensor(labels, dtype=torch.int64),
            "masks": torch.from_numpy(masks),
            "image_id": int(image_id),
        }


def hflip(image: torch.Tensor, target: Target) -> tuple[torch.Tensor, Target]:
    """Mirror an image left-right together with its boxes and masks (a new target dict is returned)."""
    width = image.shape[-1]
    boxes = target["boxes"].clone()
    boxes[:, [0, 2]] = width - target["boxes"][:, [2, 0]]
    return image.flip(-1), {**target, "boxes": boxes, "masks": target["masks"].flip(-1)}


def coco_split(
    root: str | Path,
    split: str,
    train: bool,
    hflip_prob: float = 0.5,
    contiguous_labels: bool = False,
    image_dir: str | None = None,
) -> CocoInstances:
    """One COCO instances split.

    Args:
        root: folder holding ``annotations/`` and the image folders.
        split: annotation split name: ``instances_<split>.json`` is read.
        train: training set (random horizontal flip, images without valid annotations removed) or
            evaluation set (no flip, every image kept).
        hflip_prob: probability of a horizontal flip when ``train`` (the references use 0.5).
        contiguous_labels: map category ids to 1..K instead of keeping the raw ids.
        image_dir: image folder under ``root`` when it is not named after ``split`` (e.g. ``"val2014"`` for
            ``split="minival2014"``).

    Returns:
        The dataset; batch it with ``collate_fn=collate_detection`` (also ``dataset.collate_fn``).

    Raises:
        DatasetError: the layout above is not found.
    """
    return CocoInstances(root, split, train, hflip_prob, contiguous_labels, image_dir)


def build_coco(
    root: str = "data/coco",
    train_split: str = "train2017",
    val_split: str = "val2017",
    train_image_dir: str | None = None,
    val_image_dir: str | None = None,
    hflip_prob: float = 0.5,
    contiguous_labels: bool = False,
) -> DataSplits:
    """Dataset builder (``dataset=coco``): COCO training and evaluation sets under ``root``.

    COCO's training and evaluation sets are different annotation files, so both splits come from one
    config: ``train_split``/``val_split`` name them (``train2017``/``val2017``; the MLPerf 2014 layout's
    evaluation split is ``minival2014`` with ``val_image_dir=val2014``), ``*_image_dir`` name image folders
    not named after their split. Batches are ``(list of images, list of targets)``
    (:func:`collate_detection`).

    Raises:
        DatasetError: a split's annotation file or image folder is missing (before any training work).
    """
    train = coco_split(root, train_split, True, hflip_prob, contiguous_labels, train_image_dir)
    val = coco_split(root, val_split, False, hflip_prob, contiguous_labels, val_image_dir)
    return DataSplits(train, val, collate_detection)


def build_tiny_coco(
    root: str = "data/coco_tiny", n_train: int = 8, n_val: int = 4, seed: int = 0
) -> DataSplits:
    """Dataset builder (``dataset=coco_tiny``) of the smoke recipes: the tiny real-format COCO set of
    :func:`kfac_bench.data.coco_fixtures.write_tiny_coco`, written to ``root`` (``train2017``/``val2017``)
    on first use and read back like the real data. Raw category ids 1, 3 and 7: the model needs
    ``num_classes >= 8``."""
    for split, n, offset in (("train2017", n_train, 1), ("val2017", n_val, 2)):
        if not (Path(root) / "annotations" / f"instances_{split}.json").is_file():
            write_tiny_coco(root, split, n_images=n, seed=seed * 10 + offset)
    return build_coco(root)
