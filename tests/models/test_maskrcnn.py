"""Mask R-CNN builder: frozen backbone batch norm, local backbone weights, and the K-FAC layer selection."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.models import resnet18, resnet50
from torchvision.models.detection import MaskRCNN
from torchvision.ops.misc import FrozenBatchNorm2d

from kfac_bench.errors import ConfigError
from kfac_bench.models.maskrcnn import (
    MASKRCNN_SKIP_LAYERS,
    MASKRCNN_SKIP_LAYERS_WITH_BOX_HEAD,
    build_maskrcnn,
)

BOX_HEAD_FCS = {"roi_heads.box_head.fc6", "roi_heads.box_head.fc7"}
# The authors' placement (their fork's tools/train_net.py skips FPN2MLPFeatureExtractor = fc6/fc7).
HEAD_LAYERS = {
    "roi_heads.box_predictor.cls_score",
    "roi_heads.box_predictor.bbox_pred",
    "roi_heads.mask_head.0.0",
    "roi_heads.mask_head.1.0",
    "roi_heads.mask_head.2.0",
    "roi_heads.mask_head.3.0",
    "roi_heads.mask_predictor.mask_fcn_logits",
}


def engine_selection(model: nn.Module, skip_layers: tuple[str, ...]) -> set[str]:
    """The engine's documented registration rule: nn.Linear / nn.Conv2d modules whose qualified name and
    class name match none of the ``skip_layers`` patterns (re.search)."""
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d))
        and not any(re.search(p, name) or re.search(p, type(module).__name__) for p in skip_layers)
    }


@pytest.fixture(scope="module")
def model() -> MaskRCNN:
    torch.manual_seed(0)
    return build_maskrcnn(num_classes=5, min_size=64, max_size=96)


def test_skip_layers_keep_exactly_the_box_predictor_and_mask_head(model: MaskRCNN) -> None:
    assert engine_selection(model, MASKRCNN_SKIP_LAYERS) == HEAD_LAYERS
    # The transposed convolution of the mask predictor is not a Conv2d, so SGD alone trains it.
    assert isinstance(model.roi_heads.mask_predictor.conv5_mask, nn.ConvTranspose2d)
    assert not isinstance(model.roi_heads.mask_predictor.conv5_mask, nn.Conv2d)
    # The selection still holds when the model sits under a wrapper attribute such as DDP's "module".
    wrapped = nn.Module()
    wrapped.module = model
    assert engine_selection(wrapped, MASKRCNN_SKIP_LAYERS) == {f"module.{n}" for n in HEAD_LAYERS}


def test_box_head_override_adds_fc6_and_fc7(model: MaskRCNN) -> None:
    kept = engine_selection(model, MASKRCNN_SKIP_LAYERS_WITH_BOX_HEAD)
    assert kept == HEAD_LAYERS | BOX_HEAD_FCS


def test_backbone_batch_norm_is_frozen_and_early_stages_fixed(model: MaskRCNN) -> None:
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in model.backbone.body.modules()) == 53
    trainable = {
        n.split(".")[0] for n, p in model.backbone.body.named_parameters() if p.requires_grad
    }
    assert trainable == {"layer2", "layer3", "layer4"}
    assert model.transform.min_size == (64,) and model.transform.max_size == 96
    assert model.roi_heads.box_predictor.cls_score.out_features == 5


def test_backbone_weights_load_from_a_local_resnet50(tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = resnet50()
    with torch.no_grad():  # make the BN statistics distinguishable from a fresh FrozenBatchNorm2d
        reference.layer3[2].bn2.running_mean.normal_()
        reference.bn1.weight.uniform_(0.5, 1.5)
    path = tmp_path / "resnet50.pt"
    torch.save({"state_dict": reference.state_dict()}, path)
    built = build_maskrcnn(backbone_weights=str(path), min_size=64, max_size=96)
    body = built.backbone.body
    assert torch.equal(body.layer3[2].bn2.running_mean, reference.layer3[2].bn2.running_mean)
    assert torch.equal(body.bn1.weight, reference.bn1.weight)
    assert torch.equal(body.layer4[0].conv1.weight, reference.layer4[0].conv1.weight)
    assert not body.conv1.weight.requires_grad and body.layer4[0].conv1.weight.requires_grad


def test_backbone_weights_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.backbone_weights=.*does not exist"):
        build_maskrcnn(backbone_weights=str(tmp_path / "missing.pt"))
    wrong = tmp_path / "resnet18.pt"
    torch.save(resnet18().state_dict(), wrong)
    with pytest.raises(ConfigError, match=r"not a .*ResNet-50"):
        build_maskrcnn(backbone_weights=str(wrong))
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable torch state_dict"):
        build_maskrcnn(backbone_weights=str(junk))


def test_trainable_backbone_layers_range_is_checked() -> None:
    with pytest.raises(ConfigError, match="trainable_backbone_layers=6"):
        build_maskrcnn(trainable_backbone_layers=6)


def test_backbone_weights_that_would_run_code_are_refused_never_loaded(tmp_path: Path) -> None:
    # The file goes through the checkpoint reader (weights only), like every torch file a run reads.
    from collections import OrderedDict

    from kfac_bench.checkpoint.torchfile import RefusedFile

    planted = tmp_path / "planted.pt"
    torch.save({"state_dict": OrderedDict(), "hook": Path("/etc/passwd")}, planted)
    with pytest.raises(RefusedFile, match="backbone_weights"):
        build_maskrcnn(backbone_weights=str(planted))
