"""The coverage script behind the README table reports what the models hold (counted independently here)."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.coverage import MODELS, coverage, recipe_skip_layers


def test_resnet32_coverage_counts_every_conv_and_the_classifier() -> None:
    recipe, build = MODELS["ResNet-32 (CIFAR-10)"]
    cov = coverage(recipe, build)
    with torch.device("meta"):
        model = build()
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert cov.layers == len(layers) == 32  # 31 convolutions (option-A shortcuts) + fc
    assert cov.preconditioned_params == sum(p.numel() for m in layers for p in m.parameters())
    assert cov.trainable_params == sum(p.numel() for p in model.parameters())
    assert cov.left_out == {}


def test_recipe_skip_layers_are_read_from_the_recipe_files() -> None:
    assert recipe_skip_layers("resnet50_imagenet") == []
    assert "(?:^|\\.)backbone\\." in recipe_skip_layers("maskrcnn_coco")
    cov = coverage(*MODELS["Mask R-CNN R50-FPN, heads only"])
    assert not any(n.startswith("backbone.") for n in cov.left_out.get("unsupported_type", ()))
    skipped = cov.left_out["skipped_by_rule"]
    assert all(n.startswith(("backbone.", "rpn.", "roi_heads.box_head.")) for n in skipped)
    # The authors' placement: the box head's fc6/fc7 are skipped too (their FPN2MLPFeatureExtractor).
    assert {"roi_heads.box_head.fc6", "roi_heads.box_head.fc7"} <= set(skipped)
