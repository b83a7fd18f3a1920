"""Mask R-CNN with a ResNet-50-FPN backbone (torchvision), and where K-FAC goes in it.

The paper's Mask R-CNN runs (TPDS §6.3.2) start from an ImageNet-pretrained ResNet-50 and keep
the backbone's batch norm frozen, as the MLPerf reference and torchvision's pretrained-backbone path
do. Nothing is downloaded: pass a local ResNet-50 state_dict as ``backbone_weights``. Without one
the run starts from scratch; the frozen batch norm is then the identity map, which is fine for
smoke runs but is not the paper's setup.

K-FAC placement: training converged only with K-FAC on the box head and the mask head (TPDS
§6.3.2). The authors' code (their K-FAC fork of NVIDIA DeepLearningExamples
PyTorch/Segmentation/MaskRCNN, ``tools/train_net.py``) names its skips by class: ``ResNet``, ``FPN``,
``RPNModule`` and ``FPN2MLPFeatureExtractor`` -- the last one is the box head's fc6/fc7 (torchvision's
``roi_heads.box_head``; fc6 is a 12544-input Linear whose A factor is 12545 x 12545).
:data:`MASKRCNN_SKIP_LAYERS`, the recipes' placement, follows that code and leaves to the preconditioner:

* ``roi_heads.box_predictor.cls_score``, ``roi_heads.box_predictor.bbox_pred``   (Linear)
* ``roi_heads.mask_head.{0,1,2,3}.0``                                       (Conv2d 3x3)
* ``roi_heads.mask_predictor.mask_fcn_logits``                              (Conv2d 1x1)

:data:`MASKRCNN_SKIP_LAYERS_WITH_BOX_HEAD` also preconditions ``roi_heads.box_head.fc6`` and ``fc7`` (a
reading of the paper's "box head"; an override, about 630 MB more factor memory).

The mask predictor's ``conv5_mask`` is a ``ConvTranspose2d``: it is not an ``nn.Conv2d``, the engine does not
register it, and it is trained by plain SGD (as in the reference code, whose K-FAC had no transposed
convolution either).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torchvision.models import resnet50
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torchvision.ops.misc import FrozenBatchNorm2d

from kfac_bench.errors import ConfigError

# The engine matches each pattern with re.search against a module's qualified name and against its class
# name, and skips the module on any match. Positive patterns on the name prefixes are used (rather than a
# negative lookahead such as ``^(?!roi_heads\.)``) because a lookahead would also match the class names
# "Linear"/"Conv2d" and so skip every layer. ``(?:^|\.)`` also accepts a wrapper prefix like ``module.``.
MASKRCNN_SKIP_LAYERS_WITH_BOX_HEAD: tuple[str, ...] = (r"(?:^|\.)backbone\.", r"(?:^|\.)rpn\.")
MASKRCNN_SKIP_LAYERS: tuple[str, ...] = (
    *MASKRCNN_SKIP_LAYERS_WITH_BOX_HEAD,
    r"(?:^|\.)box_head\.",
)


def _read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    """Read a state_dict, unwrapping ``{"state_dict": ...}`` / ``{"model": ...}`` and ``module.``."""
    from kfac_bench.checkpoint import torchfile

    try:
        # Tensors and containers only: a file that would run code is refused, never loaded.
        obj = torchfile.load(path, what="model.backbone_weights")
    except (OSError, torchfile.UnreadableFile) as err:
        raise ConfigError(
            f"model.backbone_weights='{path}' is not a readable torch state_dict ({err}); "
            "save one with torch.save(resnet50(...).state_dict(), PATH)"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise ConfigError(
            f"model.backbone_weights='{path}' holds a {type(obj).__name__}, not a state_dict"
        )
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_backbone_weights(body: torch.nn.Module, path: str | Path) -> None:
    """Load an ImageNet ResNet-50 state_dict (torchvision key names; ``fc.*`` ignored) into ``body``.

    Raises:
        ConfigError: the file is missing or unreadable, or its keys/shapes are not a ResNet-50's.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"model.backbone_weights='{path}' does not exist: give a local ImageNet ResNet-50 state_dict "
            "(torchvision key names), or leave it unset to start from scratch"
        )
    state = {k: v for k, v in _read_state_dict(path).items() if not k.startswith("fc.")}
    try:
        result = body.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ConfigError(
            f"model.backbone_weights='{path}' is not a ResNet-50 state_dict: {err}"
        ) from err
    # The classifier is not part of the detection backbone; FrozenBatchNorm2d drops num_batches_tracked
    # itself. Anything else missing or extra means the file is not a ResNet-50.
    missing = [k for k in result.missing_keys if not k.startswith("fc.")]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"model.backbone_weights='{path}' is not a torchvision ResNet-50 state_dict: "
            f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )


def build_maskrcnn(
    num_classes: int = 91,
    backbone_weights: str | None = None,
    min_size: int = 800,
    max_size: int = 1333,
    trainable_backbone_layers: int = 3,
    rpn_post_nms_top_n_train: int = 2000,
    rpn_pre_nms_top_n_test: int = 1000,
    rpn_post_nms_top_n_test: int = 1000,
    box_batch_size_per_image: int = 512,
    box_detections_per_img: int = 100,
) -> MaskRCNN:
    """Build torchvision's Mask R-CNN ResNet-50-FPN with frozen backbone batch norm (a Hydra ``_target_``).

    Args:
        num_classes: classes of the box and mask predictors, background included (91 for raw COCO category
            ids, 81 for contiguous labels; see ``CocoInstances.num_classes``).
        backbone_weights: path of a local ImageNet ResNet-50 state_dict loaded into the backbone body, or
            ``None`` to start from scratch. Never downloaded.
        min_size: shorter image side after the model's resize (800 in the paper's runs).
        max_size: cap of the longer side (1333).
        trainable_backbone_layers: ResNet stages left trainable, counted from ``layer4`` (0-5; 3 trains
            layer2-layer4 as the references do); the others are frozen.
        rpn_post_nms_top_n_train: proposals kept per image in training.
        rpn_pre_nms_top_n_test: proposals per FPN level before NMS in evaluation.
        rpn_post_nms_top_n_test: proposals kept per image in evaluation.
        box_batch_size_per_image: RoIs sampled per image for the box head's loss.
        box_detections_per_img: detections returned per image (COCO scores at most 100).

    Returns:
        The model, in training mode; ``model(images, targets)`` returns torchvision's loss dict.

    Note:
        The RPN/box sizes default to torchvision's values. CPU smoke runs shrink them: the box head's
        12544 x 1024 ``fc6`` over every RoI dominates the CPU time at small image sizes.

    Raises:
        ConfigError: ``trainable_backbone_layers`` out of range or unusable ``backbone_weights``.
    """
    if not 0 <= trainable_backbone_layers <= 5:
        raise ConfigError(
            f"model.trainable_backbone_layers={trainable_backbone_layers} is out of range: use 0 to 5"
        )
    # The same construction as torchvision's maskrcnn_resnet50_fpn with a pretrained backbone, minus the
    # download: weights=None there would switch to trainable BatchNorm2d and unfreeze every stage.
    body = resnet50(weights=None, norm_layer=FrozenBatchNorm2d)
    if backbone_weights is not None:
        load_backbone_weights(body, backbone_weights)
    backbone = _resnet_fpn_extractor(body, trainable_backbone_layers)
    return MaskRCNN(
        backbone,
        num_classes=num_classes,
        min_size=min_size,
        max_size=max_size,
        rpn_post_nms_top_n_train=rpn_post_nms_top_n_train,
        rpn_pre_nms_top_n_test=rpn_pre_nms_top_n_test,
        rpn_post_nms_top_n_test=rpn_post_nms_top_n_test,
        box_batch_size_per_image=box_batch_size_per_image,
        box_detections_per_img=box_detections_per_img,
    )
