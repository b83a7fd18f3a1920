"""The CIFAR ResNet family (ResNet-20/32/44/56/110) of He et al. 2016, §4.2.

This is the network the paper's CIFAR-10 correctness runs use (ResNet-32, target 92.49 % top-1;
SC20 §VI-C1, TPDS §6.3.1). It follows the reference code of the K-FAC papers (kfac-pytorch's
``cifar_resnet.py``, itself Y. Idelbayev's ``pytorch_resnet_cifar10``):

- a 3x3 stem with 16 channels, then three stages of ``n`` basic blocks with 16, 32 and 64 channels
  (stages 2 and 3 halve the resolution with a stride-2 first convolution), global average pooling
  and one linear classifier; depth = 6n + 2;
- the **option-A shortcut**: where a block changes shape, the shortcut subsamples the input with
  stride 2 and pads the new channels with zeros, so it has no parameters (and K-FAC has no layer to
  precondition there);
- Kaiming-normal initialisation of every convolution and linear weight (biases keep PyTorch's
  default).

Parameter counts (published with the reference code): ResNet-20 0.27M (269,722), ResNet-32 0.46M
(464,154), ResNet-44 0.66M, ResNet-56 0.85M, ResNet-110 1.7M.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kfac_bench.errors import ConfigError

__all__ = ["PAPER_DEPTHS", "BasicBlock", "CifarResNet", "ShortcutA", "build_cifar_resnet"]

#: The depths named in He et al. 2016 Table 6 (any 6n + 2 with n >= 1 is accepted).
PAPER_DEPTHS = (20, 32, 44, 56, 110)

_STAGE_WIDTHS = (16, 32, 64)


class ShortcutA(nn.Module):
    """Parameter-free projection shortcut ("option A" of He et al. 2016).

    Maps ``(N, C, H, W)`` to ``(N, C + 2 * pad, ceil(H / 2), ceil(W / 2))``: every second pixel,
    with ``pad`` zero channels added on each side of the channel dimension.
    """

    def __init__(self, pad_channels: int) -> None:
        super().__init__()
        self.pad_channels = pad_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pad_channels
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, p, p), mode="constant", value=0.0)

    def extra_repr(self) -> str:
        return f"pad_channels={self.pad_channels}"


class BasicBlock(nn.Module):
    """Basic residual block: ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``.

    Args:
        in_planes: input channels.
        planes: output channels; when it differs from ``in_planes`` (or ``stride != 1``) the
            shortcut is :class:`ShortcutA`, which assumes ``planes == 2 * in_planes`` and
            ``stride == 2``, as everywhere in this family.
        stride: stride of the first convolution.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            # The reference pads planes // 4 on each side: 16 -> 32 and 32 -> 64 channels.
            self.shortcut = ShortcutA(planes // 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for 32x32 inputs: ``(N, 3, H, W)`` float images -> ``(N, num_classes)`` logits.

    Any spatial size works (global average pooling); the family is designed for 32x32.

    Args:
        blocks_per_stage: ``n``, the number of basic blocks in each of the three stages.
        num_classes: width of the classifier (module ``fc``).
    """

    def __init__(self, blocks_per_stage: int, num_classes: int = 10) -> None:
        super().__init__()
        self.depth = 6 * blocks_per_stage + 2
        self.conv1 = nn.Conv2d(3, _STAGE_WIDTHS[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(_STAGE_WIDTHS[0])
        in_planes = _STAGE_WIDTHS[0]
        stages = []
        for i, planes in enumerate(_STAGE_WIDTHS):
            first_stride = 1 if i == 0 else 2
            blocks = [BasicBlock(in_planes, planes, first_stride)]
            blocks += [BasicBlock(planes, planes, 1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_planes = planes
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(_STAGE_WIDTHS[-1], num_classes)
        self.apply(_kaiming_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(torch.flatten(self.pool(out), 1))


def _kaiming_init(module: nn.Module) -> None:
    # As the reference: kaiming_normal_ with its defaults (fan_in, gain sqrt(2)); biases keep
    # PyTorch's default.
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        nn.init.kaiming_normal_(module.weight)


def build_cifar_resnet(depth: int = 32, num_classes: int = 10) -> nn.Module:
    """Build a CIFAR ResNet of the given depth (Hydra ``_target_``).

    Args:
        depth: total weighted layers, ``6n + 2`` with ``n >= 1``; the paper uses 32 (the family in
            He et al. 2016 is 20, 32, 44, 56, 110).
        num_classes: classifier width (10 for CIFAR-10).

    Returns:
        A freshly initialised :class:`CifarResNet` on the CPU, in training mode.

    Raises:
        ConfigError: ``depth`` is not of the form 6n + 2, or ``num_classes < 1``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6 != 0:
        raise ConfigError(
            f"model.depth={depth!r} is not a CIFAR ResNet depth: it must be 6n + 2 with n >= 1 "
            f"(the paper's family is {', '.join(map(str, PAPER_DEPTHS))}; the paper runs 32)"
        )
    if num_classes < 1:
        raise ConfigError(f"model.num_classes={num_classes!r} must be >= 1")
    return CifarResNet((depth - 2) // 6, num_classes)
