"""A truncated JPEG in COCO or ImageNet (written by PIL, then cut short, in the real folder layouts) stops the
run with one line naming the file, exit status 2: read in the main process or in a DataLoader worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from kfac_bench.data.coco import coco_split, collate_detection
from kfac_bench.data.coco_fixtures import write_tiny_coco
from kfac_bench.data.imagenet import imagenet_split, write_tiny_imagenet
from kfac_bench.data.images import ImageReadError, load_rgb
from kfac_bench.errors import DatasetError, UserError
from tests.harness.fault_util import one_error_line
from tests.harness.util import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools.*")


def truncate(path: Path) -> None:
    """Cut a JPEG in the middle of its entropy-coded data, as an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _assert_names(err: BaseException, path: Path) -> None:
    text = str(err)
    assert isinstance(err, DatasetError) and isinstance(err, UserError)
    assert len(text.splitlines()) == 1 and f"image file {path}" in text, text
    assert "truncated" in text


def test_a_truncated_jpeg_is_an_error_naming_it(tmp_path: Path) -> None:
    root = write_tiny_imagenet(tmp_path / "imagenet", classes=2, per_class=4, size=40)
    bad = sorted((root / "val").rglob("*.JPEG"))[0]
    assert load_rgb(bad).size == (40, 40)  # a whole file reads
    truncate(bad)
    with pytest.raises(ImageReadError) as caught:
        load_rgb(bad)
    _assert_names(caught.value, bad)

    not_an_image = tmp_path / "notes.JPEG"
    not_an_image.write_text("hello")
    with pytest.raises(ImageReadError, match=r"notes\.JPEG"):
        load_rgb(not_an_image)


def test_imagenet_names_the_truncated_file(tmp_path: Path) -> None:
    root = write_tiny_imagenet(tmp_path / "imagenet", classes=2, per_class=4, size=40)
    val = imagenet_split(root, train=False, image_size=32, resize_size=36, num_classes=2)
    bad = Path(val.samples[1][0])
    truncate(bad)
    val[0]  # the others still read
    with pytest.raises(ImageReadError) as caught:
        val[1]
    _assert_names(caught.value, bad)


@pytest.mark.parametrize("workers", [0, 1])
def test_coco_names_the_truncated_file_through_a_loader(tmp_path: Path, workers: int) -> None:
    drawn = write_tiny_coco(tmp_path, "val2017", n_images=3)
    bad = tmp_path / "val2017" / drawn[1].file_name
    truncate(bad)
    ds = coco_split(str(tmp_path), "val2017", train=False)
    loader = DataLoader(ds, batch_size=1, num_workers=workers, collate_fn=collate_detection)
    with pytest.raises(ImageReadError) as caught:
        for _ in loader:
            pass
    _assert_names(caught.value, bad)  # one line, also when re-raised from a worker


@pytest.mark.slow
def test_a_run_with_a_truncated_image_ends_with_one_line_and_status_2(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    root = write_tiny_imagenet(tmp_path / "data", classes=4, per_class=8, size=72)
    for jpeg in (root / "train").rglob("*.JPEG"):
        truncate(jpeg)  # every training batch meets one
    result = run_cli(
        "train",
        "+recipe=resnet50_imagenet_smoke",
        "kfac=none",
        f"dataset.root={root}",
        "train.num_workers=1",
        "train.max_steps=1",
        "train.tensorboard=false",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert f"cannot decode image file {root / 'train'}" in line and "truncated" in line
