"""A tiny COCO instances dataset in the real on-disk format, for smoke runs and tests.

``write_tiny_coco`` draws a handful of small images (64-96 px) with non-overlapping filled shapes
whose pixel masks are defined exactly by integer geometry, and writes them as COCO does: JPEG files
under ``<root>/<split>/`` and ``<root>/annotations/instances_<split>.json``. Every annotation
encoding the reader must handle appears:

* ``box`` (category 1): an axis-aligned rectangle written as a polygon. A polygon whose corners lie on integer
  pixel edges rasterises in pycocotools to exactly the pixels ``[x0, x1) x [y0, y1)``.
* ``triangle`` (category 3): a right triangle written as a compressed RLE (``counts`` is a string).
* ``twin`` (category 7): one object made of two rectangles, written as a list of two polygons.
* a crowd region (``iscrowd=1``, category 1) written as an uncompressed RLE (``counts`` is a
  list), as COCO stores crowds, on the second image;
* the last image has no annotations at all.

Category ids are deliberately non-contiguous (1, 3, 7) and image ids start at 101, so a reader that confuses
indices with ids, or labels with category ids, fails visibly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pycocotools import mask as mask_utils

from kfac_bench import safe_files
from kfac_bench.data.images import write_jpeg

TINY_CATEGORIES: tuple[dict[str, object], ...] = (
    {"id": 1, "name": "box", "supercategory": "shape"},
    {"id": 3, "name": "triangle", "supercategory": "shape"},
    {"id": 7, "name": "twin", "supercategory": "shape"},
)
# Saturated, well separated colours survive JPEG compression (written with 4:4:4 chroma) well enough that a
# test can check the decoded pixels inside each mask.
CATEGORY_COLOURS: dict[int, tuple[int, int, int]] = {
    1: (220, 30, 30),
    3: (30, 200, 30),
    7: (30, 60, 220),
}
CROWD_COLOUR = (230, 210, 20)
BACKGROUND = 128
FIRST_IMAGE_ID = 101


@dataclass(frozen=True)
class TinyObject:
    """One drawn object and what its annotation must decode to.

    Attributes:
        category_id: COCO category id (1, 3 or 7).
        mask: ``(H, W)`` uint8, 1 on the object's pixels.
        box_xyxy: tight box of ``mask`` in pixel-edge coordinates ``(x0, y0, x1, y1)``, x1/y1 exclusive.
        iscrowd: 0 or 1.
        encoding: ``"polygon"``, ``"rle"`` (compressed) or ``"rle_uncompressed"``.
    """

    category_id: int
    mask: np.ndarray
    box_xyxy: tuple[float, float, float, float]
    iscrowd: int
    encoding: str


@dataclass(frozen=True)
class TinyImage:
    """One written image and its objects (crowd included)."""

    image_id: int
    file_name: str
    height: int
    width: int
    objects: tuple[TinyObject, ...]


def _tight_box(mask: np.ndarray) -> tuple[float, float, float, float]:
    ys, xs = np.nonzero(mask)
    return float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)


def _rect_mask(h: int, w: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    mask = np.zeros((h, w), dtype=np.uint8)
    mask[y0:y1, x0:x1] = 1
    return mask


def _triangle_mask(h: int, w: int, x0: int, y0: int, a: int, b: int) -> np.ndarray:
    """Right triangle with legs ``a`` (along x) and ``b`` (along y) from corner ``(x0, y0)``; a pixel belongs
    to it when its centre does."""
    px = np.arange(w)[None, :] + 0.5 - x0
    py = np.arange(h)[:, None] + 0.5 - y0
    inside = (px >= 0) & (py >= 0) & (px / a + py / b <= 1.0)
    return inside.astype(np.uint8)


def _uncompressed_rle(mask: np.ndarray) -> dict[str, object]:
    """COCO's uncompressed RLE: run lengths over the column-major pixel order, starting with a 0-run."""
    flat = mask.flatten(order="F")
    counts: list[int] = []
    current, run = 0, 0
    for value in flat:
        if value != current:
            counts.append(run)
            current, run = int(value), 0
        run += 1
    counts.append(run)
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": counts}


def _compressed_rle(mask: np.ndarray) -> dict[str, object]:
    rle = mask_utils.encode(np.asfortranarray(mask))
    return {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")}


def _polygon(x0: int, y0: int, x1: int, y1: int) -> list[float]:
    return [float(v) for v in (x0, y0, x1, y0, x1, y1, x0, y1)]


def _draw_objects(
    rng: np.random.Generator, h: int, w: int, with_crowd: bool
) -> list[tuple[TinyObject, object]]:
    """Objects of one image with their COCO ``segmentation`` field, one per quadrant so none overlap."""
    cw, ch = w // 2, h // 2
    out: list[tuple[TinyObject, object]] = []

    # Quadrant (0, 0): rectangle as polygon.
    x0, y0 = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    x1, y1 = x0 + int(rng.integers(10, cw - x0)), y0 + int(rng.integers(10, ch - y0))
    mask = _rect_mask(h, w, x0, y0, x1, y1)
    out.append((TinyObject(1, mask, _tight_box(mask), 0, "polygon"), [_polygon(x0, y0, x1, y1)]))

    # Quadrant (1, 0): right triangle as compressed RLE.
    x0, y0 = cw + int(rng.integers(1, 5)), int(rng.integers(1, 5))
    a, b = int(rng.integers(14, w - x0)), int(rng.integers(14, ch - y0))
    mask = _triangle_mask(h, w, x0, y0, a, b)
    out.append((TinyObject(3, mask, _tight_box(mask), 0, "rle"), _compressed_rle(mask)))

    # Quadrant (0, 1): one object made of two rectangles, as two polygons.
    x0, y0 = int(rng.integers(1, 4)), ch + int(rng.integers(1, 4))
    wa, gap = int(rng.integers(6, 12)), int(rng.integers(3, 6))
    y1 = y0 + int(rng.integers(10, h - y0))
    rects = [(x0, y0, x0 + wa, y1), (x0 + wa + gap, y0 + 2, min(x0 + 2 * wa + gap, cw), y1)]
    mask = np.maximum(*(_rect_mask(h, w, *r) for r in rects))
    segm = [_polygon(*r) for r in rects]
    out.append((TinyObject(7, mask, _tight_box(mask), 0, "polygon"), segm))

    if with_crowd:
        # Quadrant (1, 1): a crowd region as uncompressed RLE, the way COCO stores crowds.
        x0, y0 = cw + 2, ch + 2
        mask = _rect_mask(h, w, x0, y0, x0 + int(rng.integers(8, cw - 3)), h - 2)
        out.append(
            (TinyObject(1, mask, _tight_box(mask), 1, "rle_uncompressed"), _uncompressed_rle(mask))
        )
    return out


def write_tiny_coco(
    root: str | Path, split: str = "val2017", n_images: int = 6, seed: int = 0
) -> list[TinyImage]:
    """Write a tiny COCO instances dataset under ``root`` and return what was drawn.

    Args:
        root: dataset root; ``<root>/<split>/*.jpg`` and ``<root>/annotations/instances_<split>.json`` are
            written (other splits already there are left alone).
        split: split name, e.g. ``"train2017"`` or ``"val2017"``.
        n_images: number of images (at least 3): image 2 (index 1) carries a crowd region, the last image has
            no annotations, the others three objects each.
        seed: drives image sizes, shape placement and background noise.

    Returns:
        One :class:`TinyImage` per written image, in image-id order, with the exact masks and boxes.
    """
    if n_images < 3:
        raise ValueError(
            f"n_images must be at least 3 (crowd image, empty image, plain), got {n_images}"
        )
    root = Path(root)
    image_dir = root / split
    image_dir.mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    images: list[dict[str, object]] = []
    annotations: list[dict[str, object]] = []
    written: list[TinyImage] = []
    for index in range(n_images):
        image_id = FIRST_IMAGE_ID + index
        # Non-square sizes that differ between images catch height/width swaps and padding mistakes.
        h, w = (64, 72)[(index + seed) % 2], (96, 80)[((index + seed) // 2) % 2]
        pixels = np.full((h, w, 3), BACKGROUND, dtype=np.int16)
        pixels += rng.integers(-6, 7, size=(h, w, 1), dtype=np.int16)
        drawn = [] if index == n_images - 1 else _draw_objects(rng, h, w, with_crowd=index == 1)
        for obj, segmentation in drawn:
            colour = CROWD_COLOUR if obj.iscrowd else CATEGORY_COLOURS[obj.category_id]
            pixels[obj.mask.astype(bool)] = colour
            x0, y0, x1, y1 = obj.box_xyxy
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": obj.category_id,
                    "segmentation": segmentation,
                    "area": float(obj.mask.sum()),
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "iscrowd": obj.iscrowd,
                }
            )
        file_name = f"{image_id:012d}.jpg"
        write_jpeg(
            image_dir / file_name, pixels.clip(0, 255).astype(np.uint8), quality=95, subsampling=0
        )
        images.append({"id": image_id, "file_name": file_name, "height": h, "width": w})
        written.append(TinyImage(image_id, file_name, h, w, tuple(obj for obj, _ in drawn)))

    instances = {
        "info": {"description": "kfac-bench tiny COCO-format shapes", "version": "1.0"},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": list(TINY_CATEGORIES),
    }
    safe_files.write_atomic(root / "annotations" / f"instances_{split}.json", json.dumps(instances))
    return written
