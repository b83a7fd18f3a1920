"""COCO instances reader against a tiny COCO dataset written in the real format (JPEG + instances JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader

from kfac_bench.data.coco import annotation_to_mask, coco_split, collate_detection
from kfac_bench.data.coco_fixtures import (
    BACKGROUND,
    CATEGORY_COLOURS,
    CROWD_COLOUR,
    TinyImage,
    write_tiny_coco,
)
from kfac_bench.errors import DatasetError

SPLIT = "val2017"
# pycocotools' Cython decoder trips NumPy 2's copy-keyword deprecation on every call.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools.*")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TinyImage]]:
    root = tmp_path_factory.mktemp("coco")
    return root, write_tiny_coco(root, SPLIT, n_images=6, seed=0)


def _box_of(mask: torch.Tensor) -> list[float]:
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def test_fixture_exercises_every_annotation_form(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, _ = tiny
    data = json.loads((root / "annotations" / f"instances_{SPLIT}.json").read_text())
    segms = [a["segmentation"] for a in data["annotations"]]
    assert any(isinstance(s, list) and len(s) == 1 for s in segms)  # one polygon
    assert any(isinstance(s, list) and len(s) == 2 for s in segms)  # two polygons, one object
    assert any(isinstance(s, dict) and isinstance(s["counts"], str) for s in segms)
    assert any(isinstance(s, dict) and isinstance(s["counts"], list) for s in segms)
    assert any(a["iscrowd"] == 1 for a in data["annotations"])
    annotated = {a["image_id"] for a in data["annotations"]}
    assert any(img["id"] not in annotated for img in data["images"])


def test_eval_set_reads_drawn_shapes(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, drawn = tiny
    ds = coco_split(str(root), SPLIT, train=False)
    assert len(ds) == len(drawn)  # evaluation keeps the image without annotations
    for index, ref in enumerate(drawn):
        image, target = ds[index]
        assert image.shape == (3, ref.height, ref.width) and image.dtype == torch.float32
        assert image.min() >= 0.0 and image.max() <= 1.0
        objects = [o for o in ref.objects if not o.iscrowd]  # crowd regions are not targets
        assert target["image_id"] == ref.image_id
        assert target["boxes"].dtype == torch.float32 and target["boxes"].shape == (len(objects), 4)
        assert target["masks"].dtype == torch.uint8
        assert target["masks"].shape == (len(objects), ref.height, ref.width)
        assert target["labels"].tolist() == [o.category_id for o in objects]
        for k, obj in enumerate(objects):
            assert target["boxes"][k].tolist() == list(obj.box_xyxy)
            assert np.array_equal(target["masks"][k].numpy(), obj.mask)


def test_masks_line_up_with_image_pixels(tiny: tuple[Path, list[TinyImage]]) -> None:
    """Independent of the JSON: the decoded JPEG shows each object's colour under its mask."""
    root, drawn = tiny
    ds = coco_split(str(root), SPLIT, train=False)
    for index, ref in enumerate(drawn):
        image, target = ds[index]
        pixels = (image * 255).permute(1, 2, 0)
        covered = torch.zeros(ref.height, ref.width, dtype=torch.bool)
        for mask, label in zip(target["masks"].bool(), target["labels"].tolist(), strict=True):
            # Erode by one pixel: JPEG smears colour across edges.
            inner = mask.clone()
            inner[1:-1, 1:-1] &= mask[:-2, 1:-1] & mask[2:, 1:-1] & mask[1:-1, :-2] & mask[1:-1, 2:]
            inner[[0, -1], :] = False
            inner[:, [0, -1]] = False
            colour = torch.tensor(CATEGORY_COLOURS[label], dtype=torch.float32)
            assert (pixels[inner] - colour).abs().mean() < 12
            covered |= mask
        crowd = [o for o in ref.objects if o.iscrowd]
        for obj in crowd:
            covered |= torch.from_numpy(obj.mask).bool()
            colour = torch.tensor(CROWD_COLOUR, dtype=torch.float32)
            assert (pixels[torch.from_numpy(obj.mask).bool()] - colour).abs().mean() < 20
        assert (pixels[~covered] - BACKGROUND).abs().mean() < 20


def test_train_set_drops_unannotated_images_and_crowds(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, drawn = tiny
    ds = coco_split(str(root), SPLIT, train=True, hflip_prob=0.0)
    expected_ids = [ref.image_id for ref in drawn if ref.objects]
    assert ds.ids == expected_ids and len(expected_ids) == len(drawn) - 1
    crowd_image = next(ref for ref in drawn if any(o.iscrowd for o in ref.objects))
    _, target = ds[ds.ids.index(crowd_image.image_id)]
    assert len(target["boxes"]) == len(crowd_image.objects) - 1


def test_horizontal_flip_moves_image_boxes_and_masks_together(
    tiny: tuple[Path, list[TinyImage]],
) -> None:
    root, _ = tiny
    plain = coco_split(str(root), SPLIT, train=True, hflip_prob=0.0)
    flipped = coco_split(str(root), SPLIT, train=True, hflip_prob=1.0)
    for index in range(len(plain)):
        image, target = plain[index]
        f_image, f_target = flipped[index]
        width = image.shape[-1]
        assert torch.equal(f_image, image.flip(-1))
        assert torch.equal(f_target["masks"], target["masks"].flip(-1))
        assert torch.equal(f_target["labels"], target["labels"])
        for box, f_box, f_mask in zip(
            target["boxes"], f_target["boxes"], f_target["masks"], strict=True
        ):
            x0, y0, x1, y1 = box.tolist()
            assert f_box.tolist() == [width - x1, y0, width - x0, y1]
            assert f_box.tolist() == _box_of(f_mask)


def test_flip_probability_half_flips_some(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, _ = tiny
    plain = coco_split(str(root), SPLIT, train=True, hflip_prob=0.0)
    random = coco_split(str(root), SPLIT, train=True)
    torch.manual_seed(0)
    flips = [not torch.equal(random[0][0], plain[0][0]) for _ in range(40)]
    assert 5 < sum(flips) < 35


def test_contiguous_labels_map_back_to_category_ids(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, drawn = tiny
    raw = coco_split(str(root), SPLIT, train=False)
    contiguous = coco_split(str(root), SPLIT, train=False, contiguous_labels=True)
    assert raw.num_classes == 8 and contiguous.num_classes == 4  # categories 1, 3, 7
    assert contiguous.label_to_category_id == {1: 1, 2: 3, 3: 7}
    labels = contiguous[0][1]["labels"].tolist()
    assert labels == [1, 2, 3]
    assert [contiguous.label_to_category_id[x] for x in labels] == [
        o.category_id for o in drawn[0].objects
    ]


def test_collate_keeps_per_image_sizes(tiny: tuple[Path, list[TinyImage]]) -> None:
    root, drawn = tiny
    ds = coco_split(str(root), SPLIT, train=False)
    assert ds.collate_fn is collate_detection
    images, targets = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate_detection)))
    assert [im.shape[-2:] for im in images] == [(r.height, r.width) for r in drawn[:4]]
    assert [t["image_id"] for t in targets] == [r.image_id for r in drawn[:4]]


def test_annotation_to_mask_decodes_all_encodings() -> None:
    expected = np.zeros((5, 4), dtype=np.uint8)
    expected[1:4, 2:4] = 1  # rows 1-3, columns 2-3
    polygon = [[2.0, 1.0, 4.0, 1.0, 4.0, 4.0, 2.0, 4.0]]
    # Column-major runs: columns 0-1 empty (10 px) + row 0 of column 2, then 3 on, 2 off, 3 on, 1 off.
    uncompressed = {"size": [5, 4], "counts": [11, 3, 2, 3, 1]}
    assert np.array_equal(annotation_to_mask(polygon, 5, 4), expected)
    assert np.array_equal(annotation_to_mask(uncompressed, 5, 4), expected)
    compressed = mask_utils.frPyObjects(uncompressed, 5, 4)
    compressed["counts"] = compressed["counts"].decode("ascii")
    assert np.array_equal(annotation_to_mask(compressed, 5, 4), expected)


def test_missing_layout_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"annotations/instances_val2017\.json"):
        coco_split(str(tmp_path / "nowhere"), "val2017", train=False)
    (tmp_path / "val2017").mkdir()
    with pytest.raises(DatasetError, match=r"instances_val2017\.json"):
        coco_split(str(tmp_path), "val2017", train=False)
    write_tiny_coco(tmp_path / "other", "val2017", n_images=3)
    (tmp_path / "annotations").mkdir()
    (tmp_path / "other" / "annotations" / "instances_val2017.json").rename(
        tmp_path / "annotations" / "instances_val2017.json"
    )
    (tmp_path / "val2017").rmdir()
    with pytest.raises(DatasetError, match=r"val2017/"):
        coco_split(str(tmp_path), "val2017", train=False)


def test_missing_image_file_is_a_dataset_error(tmp_path: Path) -> None:
    drawn = write_tiny_coco(tmp_path, "val2017", n_images=3)
    (tmp_path / "val2017" / drawn[0].file_name).unlink()
    ds = coco_split(str(tmp_path), "val2017", train=False)
    with pytest.raises(DatasetError, match=drawn[0].file_name):
        ds[0]
