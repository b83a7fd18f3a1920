"""Mask R-CNN recipes: the composed configs carry the paper's numbers, K-FAC lands on
exactly the box and mask heads, and the smoke twins train on a tiny real-format COCO set through the
real ``kfac-bench`` CLI and score it with COCOeval.

The expected values below are typed from TPDS §6.3.2 and KAISA §5.3 / Table 2, never read
from the YAML.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kfac_bench.config import recipes_dir
from kfac_bench.config.compose import compose_run
from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.config.store import recipe_names
from kfac_bench.data.batching import accumulation_steps
from kfac_bench.data.coco_fixtures import write_tiny_coco
from kfac_bench.errors import ConfigError
from kfac_bench.metrics.timekeeping import TargetTracker
from kfac_bench.models.maskrcnn import build_maskrcnn
from kfac_bench.train.build import build_data, instantiate
from kfac_bench.train.optim import build_lr_scheduler, lr_factor
from tests.harness.util import run_cli
from tests.metrics.mlperf_checker import check as mlperf_check
from tests.metrics.mlperf_checker import events

# KAISA Table 2 (the KAISA runs, 32 V100): global batch, LR, warm-up iterations, K_freq, F_freq.
BATCH, LR, WARMUP, K_FREQ, F_FREQ = 64, 0.08, 800, 500, 50
PAPER_GPUS = 32
# NVIDIA DeepLearningExamples PyTorch/Segmentation/MaskRCNN configs/e2e_mask_rcnn_R_50_FPN_1x_bs64.yaml:
# WARMUP_METHOD mlperf_linear, WARMUP_FACTOR, STEPS, MAX_ITER (GAMMA 0.1 from config/defaults.py).
WARMUP_FACTOR, STEPS, MAX_ITER, GAMMA = 1e-4, (18000, 24000), 27500, 0.1
# The 64-GPU config of the authors' K-FAC fork of NVIDIA DeepLearningExamples
# PyTorch/Segmentation/MaskRCNN: batch, LR, warm-up iterations and (linear) factor, decay steps, iterations.
BATCH_64, LR_64, WARMUP_64, FACTOR_64 = 128, 0.16, 800, 0.01
STEPS_64, MAX_ITER_64 = (7000, 11000), 12000
TARGETS = {"bbox_map": 0.377, "segm_map": 0.342}
MLPERF_SEGM = 0.339
BOX_PREDICTOR = {"roi_heads.box_predictor.cls_score", "roi_heads.box_predictor.bbox_pred"}
BOX_HEAD_FCS = {"roi_heads.box_head.fc6", "roi_heads.box_head.fc7"}
MASK_HEAD = {f"roi_heads.mask_head.{i}.0" for i in range(4)} | {
    "roi_heads.mask_predictor.mask_fcn_logits"
}
ARMS = ("maskrcnn_coco", "maskrcnn_coco_sgd")


def test_all_detection_recipes_exist() -> None:
    assert {*ARMS, *(f"{a}_smoke" for a in ARMS)} <= set(recipe_names())


def test_paper_values_of_both_arms() -> None:
    kfac, sgd = (compose_run([f"+recipe={name}"]) for name in ARMS)
    for cfg in (kfac, sgd):
        assert cfg.model._target_.endswith("build_maskrcnn") and cfg.model.num_classes == 91
        assert cfg.model.backbone_weights is None  # a local path is given on the command line
        assert (cfg.model.min_size, cfg.model.max_size) == (800, 1333)
        assert cfg.dataset._target_.endswith("data.coco.build_coco")
        assert cfg.task._target_.endswith("DetectionTask")
        t = cfg.train
        assert t.global_batch_size == BATCH
        # On the paper's 32 GPUs the local batch accumulates to exactly the global batch.
        accum = accumulation_steps(t.batch_size, PAPER_GPUS, BATCH, default=1)
        assert t.batch_size * PAPER_GPUS * accum == BATCH
        assert dict(t.targets) == TARGETS and dict(cfg.task.targets) == TARGETS
        assert t.stop_at_target and t.eval_every_epochs == 1 and t.eval_every_steps is None
        assert str(t.precision.value) == "fp32"
        o = cfg.optimizer
        assert str(o.name.value) == "sgd" and o.lr == pytest.approx(LR)
        assert o.momentum == 0.9 and o.weight_decay == pytest.approx(1e-4) and not o.nesterov
        assert not o.scale_lr_with_world_size
        s = cfg.lr_schedule
        assert str(s.name.value) == "warmup_multistep" and str(s.unit.value) == "steps"
        assert s.warmup == WARMUP and s.gamma == pytest.approx(GAMMA)
        assert str(s.warmup_method.value) == "mlperf_linear" and s.warmup_factor == WARMUP_FACTOR
        assert tuple(s.milestones) == STEPS and t.max_steps == MAX_ITER
        # The step budget ends the run (COCO 2017: 1848 iterations per epoch).
        assert t.epochs * 1848 > MAX_ITER
    k = kfac.kfac
    assert k.enabled and not sgd.kfac.enabled
    assert str(k.compute_method.value) == "eigen" and str(k.factor_scaling.value) == "kaisa"
    assert (k.damping, k.factor_decay, k.kl_clip) == (0.003, 0.95, 0.001)
    assert (k.factor_update_steps, k.inv_update_steps) == (F_FREQ, K_FREQ)
    assert k.grad_worker_fraction == "comm_opt"
    # The two arms differ only in the K-FAC switch, their names and the arm their tuning record is for
    # (same loop, data, schedule, metrics).
    assert (kfac.tuning.arm, sgd.tuning.arm) == ("kfac", "sgd")
    a, b = (OmegaConf.to_container(c, resolve=True) for c in (kfac, sgd))
    for c in (a, b):
        c.pop("kfac"), c.pop("name"), c.pop("tuning")  # type: ignore[union-attr]
    assert a == b


def _warmup_multistep_lr(t: int, base: float, method: str, factor: float, warmup: int,
                        steps: tuple[int, ...]) -> float:  # fmt: skip
    """maskrcnn_benchmark/solver/lr_scheduler.py WarmupMultiStepLR.get_lr() at last_epoch = t, restated."""
    decay = GAMMA ** bisect.bisect_right(list(steps), t)
    if t < warmup and method == "mlperf_linear":
        return (base - (warmup - t) * factor) * decay
    if t < warmup and method == "linear":
        alpha = t / warmup
        return base * (factor * (1 - alpha) + alpha) * decay
    return base * decay


@pytest.mark.parametrize("name", ARMS)
def test_lr_curve_is_nvidias_warmup_multistep_at_every_boundary(name: str) -> None:
    cfg = compose_run([f"+recipe={name}"])
    lr = cfg.optimizer.lr
    f = lr_factor(cfg.lr_schedule, steps_per_epoch=1848, total_steps=MAX_ITER, base_lr=lr)
    # The authors' fork steps the scheduler after optimizer.step(): iteration t (from 0) uses last_epoch = t.
    for t in (0, 1, 2, 399, 400, 798, 799, 800, 801, 17999, 18000, 18001, 23999, 24000, 27499):
        expected = _warmup_multistep_lr(t, LR, "mlperf_linear", WARMUP_FACTOR, WARMUP, STEPS)
        assert lr * f(t) == pytest.approx(expected, rel=1e-12, abs=1e-15), t
    # 0.08 - 800 x 1e-4: the first iteration runs at LR 0.
    assert lr * f(0) == pytest.approx(0.0, abs=1e-15)
    assert lr * f(400) == pytest.approx(0.04) and lr * f(799) == pytest.approx(0.0799)
    # The run's own scheduler (a LambdaLR over this factor, stepped after each optimizer step) agrees.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_lr_scheduler(opt, f)
    seen = []
    for _ in range(802):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr * f(t) for t in range(802)], abs=1e-15)


def test_mlperf_linear_warmup_must_not_start_below_zero() -> None:
    cfg = compose_run(["+recipe=maskrcnn_coco", "optimizer.lr=0.04"])
    with pytest.raises(ConfigError, match="warmup_factor"):
        lr_factor(cfg.lr_schedule, steps_per_epoch=1848, total_steps=MAX_ITER, base_lr=0.04)


def test_documented_64_gpu_scaling_gives_the_authors_schedule() -> None:
    text = (recipes_dir() / "maskrcnn_coco.yaml").read_text()
    override = (
        "train.global_batch_size=128 optimizer.lr=0.16 'lr_schedule.milestones=[7000,11000]'"
        " train.max_steps=12000 lr_schedule.warmup_method=linear lr_schedule.warmup_start_factor=0.01"
    )
    assert " ".join(text.replace("\\\n#  ", " ").split()).count(" ".join(override.split())) == 1
    cfg = compose_run(["+recipe=maskrcnn_coco", *override.replace("'", "").split()])
    assert cfg.train.global_batch_size == BATCH_64 and cfg.train.max_steps == MAX_ITER_64
    lr = cfg.optimizer.lr
    factor = lr_factor(cfg.lr_schedule, steps_per_epoch=1000, total_steps=MAX_ITER_64, base_lr=lr)
    for t in (0, 1, WARMUP_64 // 2, WARMUP_64 - 1, WARMUP_64, 6999, 7000, 10999, 11000, 11999):
        expected = _warmup_multistep_lr(t, LR_64, "linear", FACTOR_64, WARMUP_64, STEPS_64)
        assert lr * factor(t) == pytest.approx(expected), t


def test_mlperf_segm_target_is_a_config_value() -> None:
    text = (recipes_dir() / "maskrcnn_coco.yaml").read_text()
    assert "0.339" in text and "train.targets.segm_map=0.339" in text
    cfg = compose_run(["+recipe=maskrcnn_coco", f"train.targets.segm_map={MLPERF_SEGM}"])
    task = instantiate(cfg.task)
    assert task.targets == {"bbox_map": 0.377, "segm_map": MLPERF_SEGM}


def test_stop_at_target_needs_both_targets() -> None:
    cfg = compose_run(["+recipe=maskrcnn_coco"])
    task = instantiate(cfg.task)
    tracker = TargetTracker(dict(cfg.train.targets), task.target_metric, task.higher_is_better)
    assert not tracker.met({"bbox_map": 0.40, "segm_map": 0.341})
    assert not tracker.met({"bbox_map": 0.376, "segm_map": 0.40})
    assert not tracker.met({"bbox_map": 0.40})
    assert tracker.met({"bbox_map": 0.377, "segm_map": 0.342})


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        # The authors' placement: box predictor + mask head, fc6/fc7 skipped (their fork's
        # tools/train_net.py skips FPN2MLPFeatureExtractor; fc6's A factor is 12545 x 12545).
        ("maskrcnn_coco", [], BOX_PREDICTOR | MASK_HEAD),
        ("maskrcnn_coco_smoke", [], BOX_PREDICTOR | MASK_HEAD),
        # The documented override that preconditions fc6/fc7 as well.
        (
            "maskrcnn_coco",
            [r"kfac.skip_layers=['(?:^|\.)backbone\.','(?:^|\.)rpn\.']"],
            BOX_PREDICTOR | MASK_HEAD | BOX_HEAD_FCS,
        ),
    ],
)
def test_kfac_preconditions_exactly_the_heads_without_a_coverage_warning(
    recipe: str, overrides: list[str], expected: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    # The form the recipe's comment gives (in double quotes for the shell).
    for override in overrides:
        assert f'"{override}"' in (recipes_dir() / f"{recipe}.yaml").read_text()
    cfg = compose_run([f"+recipe={recipe}", *overrides])
    # Layer shapes do not depend on the image size; a small one keeps the build cheap.
    model = build_maskrcnn(num_classes=cfg.model.num_classes, min_size=64, max_size=96)
    with caplog.at_level(logging.INFO):
        precond = build_preconditioner(
            model, cfg.kfac, steps_per_epoch=10, world_size=1, accumulation_steps=1, lr=0.08
        )
    assert set(precond.layers) == expected
    # The transposed convolution is not supported: plain gradient, its reason given once in the log.
    assert caplog.text.count("left out (plain gradient) roi_heads.mask_predictor.conv5_mask") == 1
    assert caplog.text.count("a transposed convolution's patches") == 1
    # Heads-only is the intended placement (TPDS §6.3.2): below the engine's default threshold, yet no
    # warning, because the recipe sets its threshold under it; the default one would warn.
    coverage = precond.coverage()
    assert coverage.eligible_share < 0.5 and not coverage.below_threshold
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    if not overrides:
        assert coverage.eligible_share < 0.1  # fc6/fc7 hold most of the heads' parameters


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_kfac_smoke_twin_trains_and_runs_cocoeval(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    root = tmp_path / "coco"
    write_tiny_coco(root, "train2017", n_images=8, seed=1)
    write_tiny_coco(root, "val2017", n_images=4, seed=2)
    splits = build_data(
        compose_run(["+recipe=maskrcnn_coco_smoke", f"dataset.root={root}"]).dataset
    )
    assert splits.collate_fn is not None and len(splits.val) == 4
    run_dir = tmp_path / "run"
    done = run_cli(
        "train",
        "+recipe=maskrcnn_coco_smoke",
        f"dataset.root={root}",
        f"hydra.run.dir={run_dir}",
        "train.progress=lines",
        "train.tensorboard=false",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "COCOeval bbox over 4 images" in log and "COCOeval segm over 4 images" in log
    assert "K-FAC preconditions 7 layers" in log
    summary = _summary(run_dir)
    # The paper's targets are far out of reach of 3 steps from scratch: not reached, but evaluated.
    assert summary["status"] == "target_not_reached" and summary["steps"] == 3
    assert summary["targets"] == TARGETS
    assert set(summary["final_metrics"]) == {"bbox_map", "segm_map"}
    assert all(0.0 <= v < 1.0 for v in summary["final_metrics"].values())
    stages = summary["kfac_stage_times_s"]
    assert stages["factor"] > 0 and stages["decomposition"] > 0 and stages["precondition"] > 0
    lines = (run_dir / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["epoch"] == 1.0
    # mlperf.log: both target metrics under MLPerf's names, aborted (targets not met), checker passes.
    log = events(run_dir / "mlperf.log")
    (accuracy,) = [e for e in log if e["key"] == "eval_accuracy"]
    final = summary["final_metrics"]
    assert accuracy["value"] == {"BBOX": final["bbox_map"], "SEGM": final["segm_map"]}
    assert [e["metadata"]["status"] for e in log if e["key"] == "run_stop"] == ["aborted"]
    passed, report = mlperf_check(run_dir / "mlperf.log")
    assert passed, report


@pytest.mark.slow
def test_sgd_smoke_twin_stops_at_the_first_evaluation_meeting_both_targets(tmp_path: Path) -> None:
    # The smoke set is written on first use by the coco_tiny builder; zero targets are met by any model
    # (8 classes: an untrained head's scores pass the 0.05 detection cut), so stop_at_target ends the
    # 3-epoch run after the first epoch's evaluation.
    run_dir = tmp_path / "run"
    done = run_cli(
        "train",
        "+recipe=maskrcnn_coco_sgd_smoke",
        f"dataset.root={tmp_path / 'coco'}",
        f"hydra.run.dir={run_dir}",
        "train.epochs=3",
        "train.max_steps=null",
        "train.targets.bbox_map=0.0",
        "train.targets.segm_map=0.0",
        "train.limit_eval_batches=1",
        "train.progress=lines",
        "train.tensorboard=false",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "coco" / "annotations" / "instances_val2017.json").is_file()
    # A cut evaluation is scored on the images it saw (one batch of 2), against the annotation file.
    assert "COCOeval segm over 2 images" in done.stdout + done.stderr
    summary = _summary(run_dir)
    assert summary["status"] == "success" and summary["kfac_enabled"] is False
    assert summary["steps_to_target"] == 3 and summary["steps"] == 3
    assert summary["epochs_to_target"] == 1.0
