"""torchvision ResNet builder: architectures, classifier width, no downloads, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_bench.errors import ConfigError
from kfac_bench.models.torchvision_models import build_torchvision_resnet


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the builder tried to download weights")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("arch", "expected"),
    # torchvision's documented parameter counts of the ImageNet models.
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("resnet101", 44_549_160)],
)
def test_builds_untrained_model_with_documented_size(arch: str, expected: int) -> None:
    assert n_params(build_torchvision_resnet(arch)) == expected


def test_resnet152_is_selectable() -> None:
    model = build_torchvision_resnet("ResNet152", num_classes=10)
    assert n_params(model) == 60_192_808 - (2048 * 990 + 990)  # fc shrunk from 1000 to 10 classes


def test_num_classes_sets_the_classifier_and_forward_shape() -> None:
    torch.manual_seed(0)
    model = build_torchvision_resnet("resnet50", num_classes=4).eval()
    assert model.fc.out_features == 4
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 4)


def test_weights_are_random_not_pretrained() -> None:
    torch.manual_seed(0)
    a = build_torchvision_resnet("resnet18")
    torch.manual_seed(1)
    b = build_torchvision_resnet("resnet18")
    assert not torch.equal(a.conv1.weight, b.conv1.weight)


def test_unknown_arch_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        build_torchvision_resnet("resnet49")
    message = str(info.value)
    assert "resnet49" in message
    for name in ("resnet50", "resnet101", "resnet152"):
        assert name in message
