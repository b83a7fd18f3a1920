"""Detection task: COCOeval path (ground-truth model scores 1.0), distributed merge, and a real Mask R-CNN."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from kfac_bench.data.coco import CocoInstances, coco_split, collate_detection
from kfac_bench.data.coco_fixtures import write_tiny_coco
from kfac_bench.data.loader import ShardSampler
from kfac_bench.errors import ConfigError
from kfac_bench.metrics.timekeeping import TargetTracker
from kfac_bench.models.maskrcnn import build_maskrcnn
from kfac_bench.tasks.base import Task
from kfac_bench.tasks.detection import MLPERF_TARGETS, PAPER_TARGETS, DetectionTask

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools.*")
SPLIT = "val2017"


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    write_tiny_coco(root, SPLIT, n_images=6, seed=1)
    write_tiny_coco(root, "train2017", n_images=5, seed=2)
    return root


def _key(image: torch.Tensor) -> str:
    return hashlib.sha1(image.cpu().numpy().tobytes()).hexdigest()


class GroundTruthModel(nn.Module):
    """Returns each image's ground truth (score 1) as Mask R-CNN's eval output; finds the image by its
    pixels, since a detector sees only images. ``shift`` moves boxes and masks right by that many px, on
    the images in ``shifted_ids`` (all images when ``None``)."""

    def __init__(
        self, dataset: CocoInstances, shift: int = 0, shifted_ids: set[int] | None = None
    ) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # gives evaluate a device to move batches to
        self.truth = {
            _key(image): target for image, target in (dataset[i] for i in range(len(dataset)))
        }
        self.shift = shift
        self.shifted_ids = shifted_ids

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        assert not self.training, "evaluate must put the model in eval mode"
        outputs = []
        for image in images:
            target = self.truth[_key(image)]
            shift = (
                self.shift
                if self.shifted_ids is None or target["image_id"] in self.shifted_ids
                else 0
            )
            boxes = target["boxes"].clone()
            boxes[:, 0::2] += shift
            masks = target["masks"].roll(shift, dims=-1).float()[:, None]
            scores = torch.ones(len(boxes))
            outputs.append(
                {"boxes": boxes, "labels": target["labels"], "scores": scores, "masks": masks}
            )
        return outputs


def _loader(dataset: CocoInstances, **kwargs: object) -> DataLoader:
    return DataLoader(dataset, batch_size=2, collate_fn=collate_detection, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("contiguous", [False, True])
def test_ground_truth_model_scores_one(coco_root: Path, contiguous: bool) -> None:
    dataset = coco_split(str(coco_root), SPLIT, train=False, contiguous_labels=contiguous)
    task = DetectionTask()
    assert isinstance(task, Task)
    model = GroundTruthModel(dataset)
    model.train()
    metrics = task.evaluate(model, _loader(dataset))
    assert metrics == {"bbox_map": 1.0, "segm_map": 1.0}
    assert model.training  # mode restored


def test_shifted_detections_score_below_one(coco_root: Path) -> None:
    dataset = coco_split(str(coco_root), SPLIT, train=False)
    metrics = DetectionTask().evaluate(GroundTruthModel(dataset, shift=4), _loader(dataset))
    assert 0.0 < metrics["bbox_map"] < 0.9 and 0.0 < metrics["segm_map"] < 0.9


def test_subset_is_scored_on_its_own_images(coco_root: Path) -> None:
    dataset = coco_split(str(coco_root), SPLIT, train=False)
    subset = torch.utils.data.Subset(dataset, [0, 2])
    loader = DataLoader(subset, batch_size=1, collate_fn=collate_detection)
    assert DetectionTask().evaluate(GroundTruthModel(dataset), loader) == {
        "bbox_map": 1.0,
        "segm_map": 1.0,
    }


def _five_images(root: str) -> tuple[CocoInstances, GroundTruthModel]:
    """5 images (uneven over 2 ranks) and a model that is exact on three of them and off on two."""
    dataset = coco_split(root, SPLIT, train=False)
    dataset.ids = dataset.ids[:5]
    return dataset, GroundTruthModel(dataset, shift=3, shifted_ids={dataset.ids[0], dataset.ids[3]})


def _distributed_worker(rank: int, world_size: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/init", rank=rank, world_size=world_size
    )
    try:
        dataset, model = _five_images(root)
        task = DetectionTask()
        results = {}
        for name, sampler in (
            ("strided", ShardSampler(dataset, world_size, rank)),  # the harness's eval sampler
            ("padded", DistributedSampler(dataset, shuffle=False)),  # repeats an image to even out
        ):
            seen = [dataset.ids[i] for i in sampler]
            metrics = task.evaluate(model, _loader(dataset, sampler=sampler))
            results[name] = {"metrics": metrics, "seen": seen}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_distributed_evaluation_merges_shards(coco_root: Path, tmp_path: Path) -> None:
    world_size = 2
    mp.start_processes(
        _distributed_worker,
        args=(world_size, str(coco_root), str(tmp_path)),
        nprocs=world_size,
        # Forked children skip re-importing torch (seconds per child on a busy CPU); each sets one
        # intra-op thread before any tensor work, as DataLoader workers do.
        start_method="fork",
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    strided = [set(r["strided"]["seen"]) for r in results]
    padded = [r["padded"]["seen"] for r in results]
    assert [len(s) for s in strided] == [3, 2] and len(strided[0] | strided[1]) == 5
    assert [len(p) for p in padded] == [3, 3] and len(set(padded[0]) | set(padded[1])) == 5

    # Single-process references: the whole split, and each shard alone.
    dataset, model = _five_images(str(coco_root))
    task = DetectionTask()
    whole = task.evaluate(model, _loader(dataset))
    shard_only = [
        task.evaluate(model, _loader(dataset, sampler=ShardSampler(dataset, world_size, r)))
        for r in range(world_size)
    ]
    assert all(0.0 < v < 1.0 for v in whole.values())
    assert all(s != whole for s in shard_only)  # so a rank scoring only its shard would be caught
    for result in results:
        assert result["strided"]["metrics"] == whole
        assert result["padded"]["metrics"] == whole


def test_real_maskrcnn_trains_and_evaluates(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set = coco_split(str(coco_root), "train2017", train=True)
    eval_set = coco_split(str(coco_root), SPLIT, train=False)
    model = build_maskrcnn(
        num_classes=train_set.num_classes,
        min_size=64,
        max_size=96,
        rpn_post_nms_top_n_train=200,
        rpn_pre_nms_top_n_test=100,
        rpn_post_nms_top_n_test=50,
        box_batch_size_per_image=32,
        box_detections_per_img=10,
    )
    task = DetectionTask()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    before = model.roi_heads.mask_head[0][0].weight.detach().clone()
    model.train()
    for step, batch in enumerate(_loader(train_set, shuffle=True)):
        batch = task.to_device(batch, torch.device("cpu"))
        assert task.batch_size(batch) == 2
        loss = task.loss(model, batch)
        assert loss.ndim == 0 and math.isfinite(loss.item())
        assert set(task.last_loss_parts) == {
            "loss_classifier",
            "loss_box_reg",
            "loss_mask",
            "loss_objectness",
            "loss_rpn_box_reg",
        }
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1:
            break
    assert not torch.equal(model.roi_heads.mask_head[0][0].weight, before)
    # An untrained detector's scores sit below the default 0.05 cut; keep its detections so COCOeval
    # actually scores boxes and masks (it logs a summary only when there are detections).
    model.roi_heads.score_thresh = 0.0
    subset = torch.utils.data.Subset(eval_set, [0, 1, 2])
    with caplog.at_level(logging.INFO, logger="kfac_bench.tasks.detection"):
        metrics = task.evaluate(model, _loader(subset))  # type: ignore[arg-type]
    assert "COCOeval bbox over 3 images" in caplog.text
    assert "COCOeval segm over 3 images" in caplog.text
    assert set(metrics) == {"bbox_map", "segm_map"}
    assert all(0.0 <= v < 1.0 for v in metrics.values())
    assert model.training


def test_the_runs_tracker_needs_every_detection_target() -> None:
    assert PAPER_TARGETS == {"bbox_map": 0.377, "segm_map": 0.342}
    assert MLPERF_TARGETS == {"bbox_map": 0.377, "segm_map": 0.339}
    task = DetectionTask()
    paper = TargetTracker(PAPER_TARGETS, task.target_metric, task.higher_is_better)
    mlperf = TargetTracker(MLPERF_TARGETS, task.target_metric, task.higher_is_better)
    assert paper.met({"bbox_map": 0.38, "segm_map": 0.35})
    assert not paper.met({"bbox_map": 0.38, "segm_map": 0.340})
    assert mlperf.met({"bbox_map": 0.38, "segm_map": 0.340})
    assert not paper.met({"bbox_map": 0.376, "segm_map": 0.35})
    assert not paper.met({"bbox_map": 0.9})
    assert mlperf.met({"bbox_map": 0.377, "segm_map": 0.339})  # a target is met at equality


def test_a_target_on_a_metric_detection_does_not_report_fails_at_once() -> None:
    assert DetectionTask(targets=MLPERF_TARGETS).targets == MLPERF_TARGETS
    with pytest.raises(ConfigError, match=r"bbox_mAP.*use bbox_map and/or segm_map"):
        DetectionTask(targets={"bbox_mAP": 0.377})
