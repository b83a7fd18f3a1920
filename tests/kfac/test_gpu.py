"""Accelerator-only checks of the engine (``pytest -m gpu``); skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

from .reference import eigen_dense
from .test_amp import LOW, check_conv, check_linear_with_sequence_dims, shift_model, unfold_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10)
    )


def test_eigen_path_on_cuda_matches_cpu() -> None:
    torch.manual_seed(0)
    cpu = _model().double()
    gpu = _model().double().cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, y = torch.randn(32, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (32,))
    outs = []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        p = KFACPreconditioner(m, factor_decay=0.0, damping=0.01, kl_clip=None)
        F.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
        p.step()
        outs.append([q.grad.cpu() for q in m.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_activations_accumulate_into_float32_factors(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _model().cuda()
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    p = KFACPreconditioner(model, grad_scaler=scaler, factor_decay=0.0, damping=0.01, kl_clip=None)
    x, y = torch.randn(32, 3, 8, 8, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.autocast("cuda", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    layer = model[3]
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
    p.step()
    state = p.layers["3"]
    assert state.a_factor.dtype == torch.float32 and state.g_factor.dtype == torch.float32
    assert torch.isfinite(state.a_factor).all() and torch.isfinite(state.g_factor).all()
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
    ref = eigen_dense(
        state.a_factor.double().cpu(), state.g_factor.double().cpu(), grad.cpu(), 0.01
    )
    assert ((got.cpu() - ref).norm() / ref.norm()).item() < 1e-3


# GPU twins of tests/kfac/test_amp.py: the same dense float64 comparisons under CUDA autocast.
@pytest.mark.parametrize("scaling", ["per_example", "kaisa"])
@pytest.mark.parametrize("dtype", LOW)
def test_cuda_autocast_linear_factors_equal_dense_float64(dtype: torch.dtype, scaling: str) -> None:
    check_linear_with_sequence_dims(dtype, scaling, "cuda")


@pytest.mark.parametrize("dtype", LOW)
def test_cuda_autocast_conv_factors_equal_dense_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    check_conv(shift_model(), torch.randn(16, 3, 32, 32, generator=gen), "shift", dtype, "cuda")
    check_conv(unfold_model(), torch.randn(8, 3, 4, 4, generator=gen), "unfold", dtype, "cuda")


@pytest.mark.parametrize("dtype", LOW)
def test_cuda_shift_kernel_under_autocast_matches_unfold(dtype: torch.dtype) -> None:
    """The dispatch takes unfold for k×k kernels on CUDA (kfac_bench/kfac/layers/conv_cost.py); the shift
    kernel itself must still be exact there, whatever autocast state it is called in."""
    from kfac_bench.kfac.layers.conv_shift import conv2d_a_factor_shift
    from kfac_bench.kfac.layers.conv_unfold import conv2d_a_factor_unfold

    x = torch.randn(16, 4, 32, 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    args = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), True)
    with torch.autocast("cuda", dtype=dtype), torch.autocast("cuda", enabled=False):
        got = conv2d_a_factor_shift(x.cuda().float(), *args)
    ref = conv2d_a_factor_unfold(x.double(), *args)
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < 1e-5


def _train_on(
    model: nn.Module, p: KFACPreconditioner, world: int, rank: int, steps: range, dev: torch.device
) -> None:
    """SGD + K-FAC on this rank's slice of each global batch, gradients averaged as DDP would."""
    import torch.distributed as dist

    from .test_distributed import LOCAL_BATCH, global_batch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in steps:
        x, y = global_batch(s, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x[sl].to(dev)), y[sl].to(dev)).backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        p.step()
        opt.step()


def _nccl_worker(rank: int, world: int, fraction: str, reduction: str) -> torch.Tensor:
    """Train on CUDA under NCCL, checkpoint (a collective gather of every factor and decomposition),
    resume in a fresh preconditioner; the largest difference to the uninterrupted run."""
    from .test_distributed import kfac_kwargs, make_model

    dev = torch.device("cuda", rank)
    kwargs = kfac_kwargs(
        inv_update_steps=3, grad_worker_fraction=fraction, factor_reduction=reduction
    )
    model = make_model().to(dev)
    p = KFACPreconditioner(model, **kwargs)
    _train_on(model, p, world, rank, range(3), dev)
    state = p.state_dict(include_decompositions=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    p.remove()
    resumed = make_model().to(dev)
    resumed.load_state_dict(weights)
    p2 = KFACPreconditioner(resumed, **kwargs)
    p2.load_state_dict(state)
    _train_on(resumed, p2, world, rank, range(3, 6), dev)
    full = make_model().to(dev)
    _train_on(full, KFACPreconditioner(full, **kwargs), world, rank, range(6), dev)
    return torch.stack(
        [(a - b).abs().max() for a, b in zip(resumed.parameters(), full.parameters())]
    ).cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize(
    ("fraction", "reduction"), [("mem_opt", "reduce"), ("comm_opt", "allreduce")]
)
def test_nccl_ranks_agree_on_readiness_and_checkpoint_round_trips(
    fraction: str, reduction: str
) -> None:
    """NCCL communicates CUDA tensors only: the engine's control tensors (readiness flags, checkpoint
    gathers) must live on the device, and a resumed run must continue exactly."""
    from ..distributed import run_distributed

    for diff in run_distributed(_nccl_worker, 2, fraction, reduction, backend="nccl"):
        assert diff.max().item() == 0.0
