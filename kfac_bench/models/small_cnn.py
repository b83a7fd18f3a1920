"""A small convolutional network for 8x8 single-channel images (scikit-learn's digits).

It is the model of kfac-bench's bundled default job: two 3x3 convolutions and two linear layers, so K-FAC
preconditions both layer types the engine supports (Conv2d and Linear) while a CPU epoch takes well under a
second.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallCNN", "build_small_cnn"]


class SmallCNN(nn.Module):
    """conv3x3(1->c) -> ReLU -> conv3x3(c->c) -> ReLU -> maxpool2 -> linear(c*16->hidden) -> ReLU -> linear.

    Args:
        channels: channels of both convolutions.
        hidden: width of the hidden linear layer.
        num_classes: number of logits.
        image_size: side of the square input; must be even (one 2x2 max-pool).
    """

    def __init__(
        self, channels: int = 32, hidden: int = 64, num_classes: int = 10, image_size: int = 8
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        flat = channels * (image_size // 2) ** 2
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes) for images of shape (N, 1, image_size, image_size)."""
        return self.classifier(self.features(x))


def build_small_cnn(
    channels: int = 32, hidden: int = 64, num_classes: int = 10, image_size: int = 8
) -> SmallCNN:
    """Builder named by ``configs/model/small_cnn.yaml`` (``_target_``)."""
    return SmallCNN(
        channels=channels, hidden=hidden, num_classes=num_classes, image_size=image_size
    )
