"""The tiny datasets' generators write through safe_files: a link planted at a name they write is refused,
never followed (the file it points to is untouched)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kfac_bench.data.cifar import CIFAR10_DIRNAME, write_tiny_cifar10
from kfac_bench.data.coco_fixtures import write_tiny_coco
from kfac_bench.data.imagenet import write_tiny_imagenet
from kfac_bench.safe_files import LinkRefused

CASES: dict[str, tuple[str, Callable[[Path], object]]] = {
    "cifar10 batch": (
        f"{CIFAR10_DIRNAME}/data_batch_1",
        lambda root: write_tiny_cifar10(root, 20, 10),
    ),
    "coco annotations": (
        "annotations/instances_val2017.json",
        lambda root: write_tiny_coco(root, "val2017", n_images=3),
    ),
    "coco image": ("val2017/000000000101.jpg", lambda root: write_tiny_coco(root, "val2017", 3)),
    "imagenet image": (
        "train/n00000000/n00000000_0.JPEG",
        lambda root: write_tiny_imagenet(root, classes=2, per_class=1),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_link_at_a_written_name_is_refused_not_followed(tmp_path: Path, case: str) -> None:
    name, write = CASES[case]
    root, outside = tmp_path / "data", tmp_path / "outside.txt"
    outside.write_text("keep me")
    link = root / name
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    with pytest.raises(LinkRefused, match="symbolic link"):
        write(root)
    assert outside.read_text() == "keep me"
