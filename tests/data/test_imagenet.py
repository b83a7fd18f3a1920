"""ImageNet folder reader on a generated tree of real JPEGs: content, transforms, layout errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kfac_bench.data.imagenet import imagenet_split, write_tiny_imagenet
from kfac_bench.data.synthetic import class_colour
from kfac_bench.data.transforms import imagenet_transform
from kfac_bench.errors import DatasetError

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder tree: 3 classes, 6 train and 2 val JPEGs each, shorter side 48 px."""
    return write_tiny_imagenet(
        tmp_path_factory.mktemp("imagenet"), classes=3, per_class=6, size=48, val_per_class=2
    )


def test_splits_sizes_shapes_and_class_order(imagenet_root: Path) -> None:
    train = imagenet_split(imagenet_root, train=True, image_size=40, num_classes=3)
    val = imagenet_split(str(imagenet_root), train=False, image_size=40, num_classes=3)
    assert len(train) == 18 and len(val) == 6
    assert train.classes == val.classes == ["n00000000", "n00000001", "n00000002"]  # type: ignore[attr-defined]
    image, _ = train[0]
    assert image.dtype == torch.float32 and image.shape == (3, 40, 40)
    # ImageFolder labels follow the sorted folder names; the files of folder k carry label k.
    for path, target in val.samples:  # type: ignore[attr-defined]
        assert Path(path).parent.name == val.classes[target]  # type: ignore[attr-defined]


def test_val_pixels_are_the_normalised_class_colour(imagenet_root: Path) -> None:
    val = imagenet_split(imagenet_root, train=False, image_size=32, num_classes=3)
    for i in range(len(val)):
        image, label = val[i]
        expected = (torch.tensor(class_colour(label, 3), dtype=torch.float32) / 255 - MEAN) / STD
        # Per-pixel noise averages out over the crop; JPEG keeps the mean colour.
        torch.testing.assert_close(image.mean(dim=(1, 2)), expected, atol=0.15, rtol=0)


def test_val_is_deterministic_and_train_is_augmented(imagenet_root: Path) -> None:
    val = imagenet_split(imagenet_root, train=False, image_size=32, num_classes=3)
    assert torch.equal(val[0][0], val[0][0])
    torch.manual_seed(0)
    train = imagenet_split(imagenet_root, train=True, image_size=32, num_classes=3)
    draws = [train[0][0] for _ in range(4)]
    assert all(d.shape == (3, 32, 32) for d in draws)
    assert any(not torch.equal(draws[0], d) for d in draws[1:])
    plain = imagenet_split(imagenet_root, train=True, augment=False, image_size=32, num_classes=3)
    assert torch.equal(plain[0][0], plain[0][0])


def test_default_eval_resize_keeps_the_papers_ratio() -> None:
    # Resize(256) + CenterCrop(224) at full size, scaled for small images.
    for size, resize in ((224, 256), (64, 73)):
        steps = imagenet_transform(train=False, image_size=size).transforms  # type: ignore[attr-defined]
        assert steps[0].size == resize and steps[1].size == (size, size)


def test_missing_root_and_split(tmp_path: Path, imagenet_root: Path) -> None:
    with pytest.raises(DatasetError) as info:
        imagenet_split(tmp_path / "nope", train=True)
    assert str(tmp_path / "nope") in str(info.value)
    assert "<root>/train/<wnid>/*.JPEG" in str(info.value)
    assert "synthetic" in str(info.value)

    train_only = tmp_path / "train_only"
    shutil.copytree(imagenet_root / "train", train_only / "train")
    assert len(imagenet_split(train_only, train=True, image_size=32, num_classes=3)) == 18
    with pytest.raises(DatasetError) as info:
        imagenet_split(train_only, train=False, num_classes=3)
    assert str(train_only / "val") in str(info.value)


def test_flat_val_release_is_explained(tmp_path: Path, imagenet_root: Path) -> None:
    root = tmp_path / "flat"
    shutil.copytree(imagenet_root / "train", root / "train")
    (root / "val").mkdir()
    for jpeg in (imagenet_root / "val").rglob("*.JPEG"):
        shutil.copy(jpeg, root / "val" / jpeg.name)
    with pytest.raises(DatasetError) as info:
        imagenet_split(root, train=False, num_classes=None)
    message = str(info.value)
    assert str(root / "val") in message
    assert "6 image files directly in it and no class folders" in message


def test_train_and_val_must_have_the_same_classes(tmp_path: Path, imagenet_root: Path) -> None:
    root = tmp_path / "mismatch"
    shutil.copytree(imagenet_root, root)
    shutil.rmtree(root / "val" / "n00000001")
    for train in (True, False):
        with pytest.raises(DatasetError, match="n00000001"):
            imagenet_split(root, train=train, num_classes=None)


def test_empty_class_folder(tmp_path: Path, imagenet_root: Path) -> None:
    root = tmp_path / "empty"
    shutil.copytree(imagenet_root, root)
    for split in ("train", "val"):
        (root / split / "n00000009").mkdir()
    with pytest.raises(DatasetError, match="n00000009"):
        imagenet_split(root, train=True, num_classes=4)


def test_class_count_must_match_num_classes(imagenet_root: Path) -> None:
    # The default is ImageNet-1k's 1000 classes; a 3-folder tree is refused before training starts.
    with pytest.raises(DatasetError, match="num_classes=1000 but found 3 class folders"):
        imagenet_split(imagenet_root, train=True)
    assert len(imagenet_split(imagenet_root, train=True, num_classes=None)) == 18
