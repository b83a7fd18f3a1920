"""The CIFAR ResNet family: published parameter counts, option-A shortcut, shapes, init, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kfac_bench.errors import ConfigError, UserError
from kfac_bench.models.cifar_resnet import ShortcutA, build_cifar_resnet


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("depth", "expected"), [(20, 269_722), (32, 464_154)])
def test_parameter_count_matches_published_reference(depth: int, expected: int) -> None:
    # Counts published with the reference CIFAR ResNet code (0.27M and 0.46M in He et al.'s table).
    assert n_params(build_cifar_resnet(depth)) == expected


@pytest.mark.parametrize(("depth", "millions"), [(44, 0.66), (56, 0.85), (110, 1.7)])
def test_deeper_members_match_published_rounded_counts(depth: int, millions: float) -> None:
    assert round(n_params(build_cifar_resnet(depth)) / 1e6, 2 if depth < 100 else 1) == millions


@pytest.mark.parametrize("depth", [20, 32, 56])
def test_depth_counts_weighted_layers(depth: int) -> None:
    model = build_cifar_resnet(depth)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == depth
    assert len(linears) == 1
    assert all(m.kernel_size == (3, 3) for m in convs)  # option A: no 1x1 projection convs


def test_option_a_shortcut_has_no_parameters_and_pads_with_zeros() -> None:
    model = build_cifar_resnet(32)
    shortcuts = [m for m in model.modules() if isinstance(m, ShortcutA)]
    assert len(shortcuts) == 2  # entering stage 2 (16 -> 32) and stage 3 (32 -> 64)
    assert all(n_params(s) == 0 for s in shortcuts)

    x = torch.randn(2, 16, 8, 8)
    y = ShortcutA(8)(x)
    assert y.shape == (2, 32, 4, 4)
    assert torch.equal(y[:, 8:24], x[:, :, ::2, ::2])
    assert torch.count_nonzero(y[:, :8]) == 0 and torch.count_nonzero(y[:, 24:]) == 0


def test_forward_shape_and_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = build_cifar_resnet(20, num_classes=7)
    logits = model(torch.randn(4, 3, 32, 32))
    assert logits.shape == (4, 7)
    logits.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_kaiming_normal_initialisation() -> None:
    torch.manual_seed(0)
    model = build_cifar_resnet(20)
    conv = model.layer3[1].conv2  # 64 -> 64, 3x3: fan_in 576, 36,864 weights
    expected_std = math.sqrt(2.0 / 576)
    assert conv.weight.std().item() == pytest.approx(expected_std, rel=0.03)
    assert conv.weight.mean().abs().item() < 0.05 * expected_std


@pytest.mark.parametrize("depth", [0, 2, 21, 33, 100, True, "32"])
def test_invalid_depth_is_a_config_error(depth: object) -> None:
    with pytest.raises(ConfigError, match=r"6n \+ 2") as info:
        build_cifar_resnet(depth)  # type: ignore[arg-type]
    assert isinstance(info.value, UserError)
    assert repr(depth) in str(info.value)


def test_other_6n_plus_2_depths_are_accepted() -> None:
    assert build_cifar_resnet(8).depth == 8
