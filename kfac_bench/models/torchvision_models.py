"""torchvision ResNets for the ImageNet benchmarks (SC20 §VI-C1/C3), always randomly initialised.

The papers train ResNet-50/101/152 from scratch (torchvision's definitions in the reference code);
ResNet-18/34 are accepted too because they make cheap smoke runs of the same pipeline.
Weights are never downloaded: ``weights=None`` is passed explicitly.
"""

from __future__ import annotations

from torch import nn
from torchvision import models

from kfac_bench.errors import ConfigError

__all__ = ["RESNET_ARCHS", "build_torchvision_resnet"]

#: Architectures :func:`build_torchvision_resnet` accepts. The paper's are resnet50/101/152.
RESNET_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


def build_torchvision_resnet(
    arch: str = "resnet50", num_classes: int = 1000, zero_init_residual: bool = False
) -> nn.Module:
    """Build an untrained torchvision ResNet (Hydra ``_target_``).

    Args:
        arch: one of :data:`RESNET_ARCHS` (case-insensitive).
        num_classes: width of the classifier ``fc`` (1000 for ImageNet-1k; the number of class
            folders for a smaller tree).
        zero_init_residual: zero the last BN of each residual block (torchvision option). Off by
            default, as in the papers' reference code.

    Returns:
        The model on the CPU with torchvision's default initialisation, in training mode.

    Raises:
        ConfigError: unknown ``arch`` (the message lists the valid names) or ``num_classes < 1``.
    """
    name = str(arch).lower()
    if name not in RESNET_ARCHS:
        raise ConfigError(
            f"model.arch={arch!r} is not a supported torchvision ResNet; "
            f"valid names: {', '.join(RESNET_ARCHS)}"
        )
    if num_classes < 1:
        raise ConfigError(f"model.num_classes={num_classes!r} must be >= 1")
    return models.get_model(
        name, weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
    )
