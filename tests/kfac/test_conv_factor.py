"""The Conv2d input factor: fast shift-correlation path vs im2col reference vs first principles (float64)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from kfac_bench.kfac.layers.conv_cost import choose_method
from kfac_bench.kfac.layers.conv_shift import conv2d_a_factor_shift
from kfac_bench.kfac.layers.conv_unfold import (
    conv2d_a_factor,
    conv2d_a_factor_unfold,
    fast_method,
    unfold_chunked,
)

DT = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    # Hundreds of tiny products: a second intra-op thread only adds wake-up latency on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loop_factor(x, kernel_size, stride, padding, dilation, bias):
    """Independent definition: zero-pad by hand, walk every output position, build its patch, sum p pᵀ."""
    n, c, h, w = x.shape
    kh, kw = kernel_size
    top, bottom, left, right = padding
    padded = torch.zeros(n, c, h + top + bottom, w + left + right, dtype=x.dtype)
    padded[:, :, top : top + h, left : left + w] = x
    span_h = dilation[0] * (kh - 1) + 1
    span_w = dilation[1] * (kw - 1) + 1
    d = c * kh * kw + int(bias)
    total = torch.zeros(d, d, dtype=x.dtype)
    for b in range(n):
        for oy in range(0, padded.shape[2] - span_h + 1, stride[0]):
            for ox in range(0, padded.shape[3] - span_w + 1, stride[1]):
                patch = [
                    padded[b, ch, oy + i * dilation[0], ox + j * dilation[1]]
                    for ch in range(c)
                    for i in range(kh)
                    for j in range(kw)
                ]
                if bias:
                    patch.append(torch.ones((), dtype=x.dtype))
                p = torch.stack(patch)
                total += torch.outer(p, p)
    return total


def _assert_close(actual, expected):
    scale = expected.abs().max()
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert ((actual - expected).abs().max() / scale).item() < 1e-5


TINY = [
    # (N, C, H, W), kernel, stride, padding (top, bottom, left, right), dilation
    ((2, 2, 5, 4), (3, 2), (2, 1), (1, 0, 0, 1), (1, 2)),
    ((1, 3, 6, 7), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((2, 1, 7, 6), (2, 3), (2, 2), (0, 1, 2, 0), (2, 1)),
    ((1, 2, 5, 5), (1, 1), (2, 2), (1, 0, 1, 0), (1, 1)),
]


@pytest.mark.parametrize(("shape", "kernel", "stride", "padding", "dilation"), TINY)
@pytest.mark.parametrize("bias", [False, True])
def test_both_paths_match_loop_over_positions(shape, kernel, stride, padding, dilation, bias):
    x = torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(0))
    expected = _loop_factor(x, kernel, stride, padding, dilation, bias)
    args = (x, kernel, stride, padding, dilation, bias)
    _assert_close(conv2d_a_factor_unfold(*args), expected)
    _assert_close(conv2d_a_factor_shift(*args), expected)
    _assert_close(conv2d_a_factor(*args), expected)


def _cases():
    kernels = [(1, 1), (3, 3), (5, 5), (7, 7), (3, 5), (2, 2)]
    strides = [(1, 1), (2, 2), (2, 1)]
    paddings = [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 2, 1)]
    dilations = [(1, 1), (2, 2)]
    for kernel, stride, padding, dilation in itertools.product(
        kernels, strides, paddings, dilations
    ):
        if kernel == (1, 1) and dilation != (1, 1):
            continue  # dilation does not change a 1×1 kernel
        yield pytest.param(
            kernel, stride, padding, dilation, id=f"k{kernel}-s{stride}-p{padding}-d{dilation}"
        )


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"), list(_cases()))
def test_shift_path_matches_unfold(kernel, stride, padding, dilation):
    # Odd, non-square spatial size, large enough for a dilated 7×7 kernel without padding.
    x = torch.randn(2, 3, 15, 13, dtype=DT, generator=torch.Generator().manual_seed(1))
    for bias in (False, True):
        args = (x, kernel, stride, padding, dilation, bias)
        expected = conv2d_a_factor_unfold(*args)
        _assert_close(conv2d_a_factor_shift(*args), expected)
        _assert_close(conv2d_a_factor(*args), expected)


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding"),
    [
        ((4, 16, 8, 8), (3, 3), (1, 1), (1, 1, 1, 1)),  # ResNet-like, small image
        ((3, 4, 32, 32), (3, 3), (2, 2), (1, 1, 1, 1)),  # stride-2 transition
        ((2, 3, 20, 20), (7, 7), (2, 2), (3, 3, 3, 3)),  # ResNet stem
        ((2, 8, 9, 9), (1, 1), (2, 2), (0, 0, 0, 0)),  # strided 1×1 shortcut
        ((2, 5, 4, 3), (3, 3), (1, 1), (2, 2, 2, 2)),  # padding larger than half the kernel
    ],
)
def test_dispatcher_matches_unfold_on_network_shapes(shape, kernel, stride, padding):
    x = torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(2))
    args = (x, kernel, stride, padding, (1, 1), True)
    _assert_close(conv2d_a_factor(*args), conv2d_a_factor_unfold(*args))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("same_kernel", [(2, 2), (4, 3), (3, 3)])
def test_factor_orders_patches_like_the_conv_weight(same_kernel):
    """W S Wᵀ must equal Σ_{n,t} y yᵀ for y = conv2d(x, W) + b: ties ordering and bias slot to nn.Conv2d."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(3, 4, same_kernel, padding="same", dilation=(1, 2), dtype=DT)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, dtype=DT, generator=gen))
        conv.bias.copy_(torch.randn(4, dtype=DT, generator=gen))
    x = torch.randn(2, 3, 9, 8, dtype=DT, generator=gen)
    y = conv(x).permute(1, 0, 2, 3).reshape(4, -1)
    left, right, top, bottom = conv._reversed_padding_repeated_twice
    s = conv2d_a_factor(
        x, conv.kernel_size, conv.stride, (top, bottom, left, right), conv.dilation, True
    )
    wb = torch.cat([conv.weight.reshape(4, -1), conv.bias[:, None]], dim=1)
    _assert_close(wb @ s @ wb.t(), y @ y.t())


def test_result_is_symmetric_with_bias_entries_and_input_dtype():
    x = torch.randn(3, 2, 10, 9, generator=torch.Generator().manual_seed(4))
    s = conv2d_a_factor(x, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True)
    assert s.dtype == torch.float32
    assert s.shape == (2 * 9 + 1, 2 * 9 + 1)
    assert torch.equal(s, s.t())
    assert s[-1, -1].item() == 3 * 5 * 5  # N·T with a 5×5 output
    patches = F.unfold(F.pad(x, (1, 1, 1, 1)), (3, 3), stride=2)
    torch.testing.assert_close(s[:-1, -1], patches.sum(dim=(0, 2)), rtol=1e-5, atol=1e-4)


def test_no_output_positions_is_an_error():
    x = torch.randn(1, 2, 3, 3, dtype=DT)
    with pytest.raises(ValueError, match="no output positions"):
        conv2d_a_factor_shift(x, (5, 5), (1, 1), (0, 0, 0, 0), (1, 1), False)


def test_dispatch_shift_for_cifar_layers_and_1x1_unfold_for_many_channels_on_tiny_maps():
    # Both methods are exact (tests above); this pins the choices the CIFAR ResNets' speed relies on.
    resnet_3x3 = torch.zeros(128, 16, 32, 32)
    tiny_map = torch.zeros(8, 512, 2, 2)
    args = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    assert fast_method(resnet_3x3, *args) == "shift"
    assert fast_method(tiny_map, *args) == "unfold"
    assert fast_method(torch.zeros(8, 256, 16, 16), (1, 1), (2, 2), (0, 0, 0, 0), (1, 1)) == "shift"


def test_dispatch_is_keyed_on_the_device_type():
    # The fitted constants describe a CPU; a device without a fitted model takes the documented rule
    # (kfac_bench/kfac/layers/conv_cost.py): shift for 1×1 kernels, unfold otherwise, whatever the shape.
    args = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    shape = (128, 16, 32, 32)
    assert choose_method("cpu", shape, *args) == "shift"  # the CIFAR layer above
    for device in ("cuda", "meta", "xpu"):
        assert choose_method(device, shape, *args) == "unfold"
        assert choose_method(device, shape, (1, 1), (2, 2), (0, 0, 0, 0), (1, 1)) == "shift"
    assert fast_method(torch.zeros(shape, device="meta"), *args) == "unfold"


def test_chunked_unfold_matches_reference():
    # 7×7 kernel on 3 channels: the patches are ~49× the input; without the size floor the batch of 5 is
    # split into chunks of 2 (budget D² = 147², 72·147 patch elements per example).
    x = torch.randn(5, 3, 9, 8, dtype=DT, generator=torch.Generator().manual_seed(5))
    args = (x, (7, 7), (1, 1), (3, 3, 3, 3), (1, 1), True)
    _assert_close(unfold_chunked(*args, floor=0), conv2d_a_factor_unfold(*args))


def test_strided_and_channels_last_inputs_and_stride_three():
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3, 4, 11, 10, dtype=DT, generator=gen)
    args = ((3, 2), (3, 2), (1, 2, 0, 1), (1, 1), True)
    expected = conv2d_a_factor_unfold(base, *args)
    _assert_close(
        conv2d_a_factor_shift(base.to(memory_format=torch.channels_last), *args), expected
    )
    wide = torch.randn(3, 4, 11, 20, dtype=DT, generator=gen)
    wide[..., ::2] = base  # a non-contiguous view holding the same values
    _assert_close(conv2d_a_factor_shift(wide[..., ::2], *args), expected)


def test_float32_stays_accurate_on_relu_activations():
    # Non-negative inputs (post-ReLU) make the boundary corrections largest relative to the blocks.
    x = torch.randn(16, 8, 16, 16, generator=torch.Generator().manual_seed(7)).relu()
    args = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), True)
    expected = conv2d_a_factor_unfold(x.double(), *args)
    actual = conv2d_a_factor_shift(x, *args).double()
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_shift_path_matches_unfold_on_random_configurations():
    # Strides up to 4, dilations up to 3, paddings up to 4 (often wider than the kernel), maps down to 1×1.
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(8)
    checked = 0
    while checked < 40:
        kernel = (rng.randint(1, 7), rng.randint(1, 7))
        stride = (rng.randint(1, 4), rng.randint(1, 4))
        dilation = (rng.randint(1, 3), rng.randint(1, 3))
        padding = tuple(rng.randint(0, 4) for _ in range(4))
        h, w = rng.randint(1, 14), rng.randint(1, 14)
        if h + padding[0] + padding[1] <= dilation[0] * (kernel[0] - 1):
            continue
        if w + padding[2] + padding[3] <= dilation[1] * (kernel[1] - 1):
            continue
        x = torch.randn(rng.randint(1, 3), rng.randint(1, 4), h, w, dtype=DT, generator=gen)
        args = (x, kernel, stride, padding, dilation, rng.random() < 0.5)
        _assert_close(conv2d_a_factor_shift(*args), conv2d_a_factor_unfold(*args))
        checked += 1


def test_input_that_requires_grad_is_read_detached():
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    for kernel, padding in (((1, 1), (0, 0, 0, 0)), ((3, 3), (1, 1, 1, 1))):
        s = conv2d_a_factor(x, kernel, (1, 1), padding, (1, 1), False)
        assert not s.requires_grad
        torch.testing.assert_close(
            s, conv2d_a_factor_unfold(x.detach(), kernel, (1, 1), padding, (1, 1), False)
        )


_BATCHED_CASES = [
    # kernel, stride, padding (top, bottom, left, right), dilation, bias
    ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), False),
    ((3, 3), (1, 1), (0, 0, 0, 0), (1, 1), True),
    ((2, 3), (1, 1), (0, 1, 1, 1), (1, 1), True),  # 'same' with an even kernel: asymmetric
    ((1, 1), (1, 1), (0, 0, 0, 0), (1, 1), True),
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True),
    ((3, 2), (2, 1), (1, 0, 0, 2), (1, 1), False),
    ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2), True),
]


@pytest.mark.parametrize("case", _BATCHED_CASES)
@pytest.mark.parametrize("kernel", ["pixel", "unfold", "per_call"])
def test_batched_factors_equal_each_calls_factor(case, kernel, monkeypatch):
    """The grams of several same-shaped calls computed together (pixel kernel, batched unfold, and the
    per-call fallback when one call's transient tensors would be too large) equal each call's own."""
    from kfac_bench.kfac.layers import conv_batched

    kernel_size, stride, padding, dilation, bias = case
    if kernel == "pixel" and dilation != (1, 1):
        pytest.skip("the pixel kernel needs dilation 1")
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 3, 7, 6, dtype=DT, generator=gen) for _ in range(3)]
    want = torch.stack([_loop_factor(x, kernel_size, stride, padding, dilation, bias) for x in xs])
    if kernel == "pixel":
        got = conv_batched._pixel(xs, kernel_size, stride, padding, bias, DT)
    elif kernel == "unfold":
        got = conv_batched._unfold(xs, kernel_size, stride, padding, dilation, bias, DT)
    else:
        monkeypatch.setattr(conv_batched, "MAX_TRANSIENT_BYTES", 1)
        got = conv_batched.conv2d_a_factors(xs, kernel_size, stride, padding, dilation, bias, DT)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
