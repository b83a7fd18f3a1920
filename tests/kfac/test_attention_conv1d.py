"""``nn.MultiheadAttention`` and ``nn.Conv1d`` are preconditioned exactly as their equivalents: attention
written with ``nn.Linear`` q/k/v/out layers + SDPA (self- and cross-attention, packed and separate weights,
``batch_first`` either way), Conv1d as a Conv2d with a ``(1, k)`` kernel. Both arms run the engine; the
equivalents' layer types are the engine's long-tested Linear and Conv2d (tests/kfac/test_factors.py holds
those against dense definitions)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner, scan_model

D = torch.float64
E, HEADS, N, L, S = 6, 2, 3, 4, 5


class LinearAttention(nn.Module):
    """What ``nn.MultiheadAttention`` computes, written with four ``nn.Linear`` and SDPA."""

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        e = attn.embed_dim
        self.batch_first = attn.batch_first
        self.heads = attn.num_heads
        if attn._qkv_same_embed_dim:
            weights = attn.in_proj_weight.detach().split(e)
        else:
            weights = (attn.q_proj_weight, attn.k_proj_weight, attn.v_proj_weight)
        biases = attn.in_proj_bias.detach().split(e)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(w.shape[1], e, dtype=D) for w in weights)
        for lin, w, b in zip((self.q_proj, self.k_proj, self.v_proj), weights, biases):
            lin.weight.data.copy_(w.detach())
            lin.bias.data.copy_(b)
        self.out_proj = copy.deepcopy(attn.out_proj)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        n, t, e = q.shape[0], q.shape[1], self.q_proj.out_features
        split = lambda x: x.reshape(n, x.shape[1], self.heads, -1).transpose(1, 2)  # noqa: E731
        mask = (
            None
            if pad is None
            else torch.zeros(n, 1, 1, k.shape[1], dtype=D).masked_fill(
                pad.reshape(n, 1, 1, -1), float("-inf")
            )
        )
        out = F.scaled_dot_product_attention(
            split(self.q_proj(q)), split(self.k_proj(k)), split(self.v_proj(v)), attn_mask=mask
        )
        out = self.out_proj(out.transpose(1, 2).reshape(n, t, e))
        return out if self.batch_first else out.transpose(0, 1)


class Block(nn.Module):
    """Attention between a token Linear and a fixed readout; ``cross``: keys/values from a memory."""

    def __init__(self, attn: nn.Module, cross: bool, need_weights: bool, mha: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(E, E, dtype=D)
        self.attn = attn
        self.cross, self.need_weights, self.mha = cross, need_weights, mha

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, pad: torch.Tensor | None
    ) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        k = v = memory if self.cross else h
        if self.mha:
            out, _ = self.attn(h, k, v, key_padding_mask=pad, need_weights=self.need_weights)
        else:
            out = self.attn(h, k, v, pad)
        return out


CASES = {
    "self, packed, batch_first, need_weights": dict(cross=False, kdim=None, bf=True, nw=True),
    "self, packed, sequence first, padding mask": dict(cross=False, kdim=None, bf=False, nw=False),
    "cross, separate weights, batch_first": dict(cross=True, kdim=4, bf=True, nw=False),
    "cross, packed, sequence first, need_weights": dict(cross=True, kdim=None, bf=False, nw=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scaling", ["expand", "per_example"])
def test_multihead_attention_equals_linear_layers_and_sdpa(case: str, scaling: str) -> None:
    c = CASES[case]
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(
        E, HEADS, batch_first=c["bf"], kdim=c["kdim"], vdim=c["kdim"], dtype=D
    )
    mha = Block(attn, c["cross"], c["nw"], mha=True)
    twin = Block(LinearAttention(attn), c["cross"], c["nw"], mha=False)
    twin.embed.load_state_dict(mha.embed.state_dict())
    g = torch.Generator().manual_seed(1)
    shape = (N, L, E) if c["bf"] else (L, N, E)
    mshape = (N, S, c["kdim"] or E) if c["bf"] else (S, N, c["kdim"] or E)
    pad = torch.zeros(N, L if not c["cross"] else S, dtype=torch.bool)
    pad[0, -1] = True
    pad = pad if "padding" in case else None
    batches = [
        (torch.randn(shape, dtype=D, generator=g), torch.randn(mshape, dtype=D, generator=g))
        for _ in range(2)
    ]
    target = torch.randn(shape, dtype=D, generator=g)
    steps = []
    for model in (mha, twin):
        p = KFACPreconditioner(
            model, factor_scaling=scaling, damping=0.01, kl_clip=None, factor_decay=0.5
        )
        # Sequence-first attention: its projections see batch-first rows (the engine's forward).
        got = []
        for x, memory in batches:
            model.zero_grad()
            F.mse_loss(model(x, memory, pad), target).backward()
            p.step()
            got.append({n: q.grad.clone() for n, q in model.named_parameters()})
        steps.append((p, got))
    (p_mha, got_mha), (p_twin, got_twin) = steps
    assert sorted(p_mha.layers) == sorted(p_twin.layers)  # attn.{q,k,v}_proj, attn.out_proj, embed
    assert all(layer.ready for layer in p_mha.layers.values())
    for a, b in zip(got_mha, got_twin):
        packed = a.get("attn.in_proj_weight")
        for i, part in enumerate("qkv"):
            w = packed[i * E : (i + 1) * E] if packed is not None else a[f"attn.{part}_proj_weight"]
            torch.testing.assert_close(w, b[f"attn.{part}_proj.weight"], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(
                a["attn.in_proj_bias"][i * E : (i + 1) * E],
                b[f"attn.{part}_proj.bias"],
                rtol=1e-9,
                atol=1e-12,
            )
        for name in ("attn.out_proj.weight", "attn.out_proj.bias", "embed.weight"):
            torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-12)
    cov = p_mha.coverage()
    assert cov.left_out == {} and cov.eligible_share == 1.0
    p_mha.remove()
    assert "forward" not in attn.__dict__  # the module's own forward is back


def test_transformer_encoder_layer_is_fully_preconditioned_and_unchanged_in_eval() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, 8, dropout=0.0, dtype=D)
    x = torch.randn(L, N, E, dtype=D)
    with torch.no_grad():
        before = layer(x)
    scan = scan_model(layer)
    assert sorted(s.name for s in scan.layers) == [
        "linear1",
        "linear2",
        "self_attn.k_proj",
        "self_attn.out_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    # The Linear layers of a sequence-first block count examples along dim 1; attention's are fed batch first.
    dims = {s.name: s.batch_dim for s in scan.layers}
    assert dims["linear1"] == 1 and dims["self_attn.q_proj"] == dims["self_attn.out_proj"] == 0
    p = KFACPreconditioner(layer, kl_clip=None)
    out = layer(x)
    torch.testing.assert_close(out, before, rtol=1e-12, atol=1e-12)
    out.pow(2).mean().backward()
    p.step()
    assert all(s.ready for s in p.layers.values())
    assert p.coverage().eligible_share == 1.0


def test_a_copy_of_an_attached_attention_runs_its_own_weights_and_feeds_nothing() -> None:
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=D)
    p = KFACPreconditioner(attn, kl_clip=None)
    twin = copy.deepcopy(attn)  # e.g. an EMA copy of an attached model
    with torch.no_grad():
        twin.in_proj_weight.mul_(2)
    x = torch.randn(N, L, E, dtype=D)
    out, _ = twin(x, x, x)
    torch.testing.assert_close(out, nn.MultiheadAttention.forward(twin, x, x, x)[0])
    assert not torch.allclose(out, nn.MultiheadAttention.forward(attn, x, x, x)[0])
    out.sum().backward()
    assert all(not layer.calls and layer.a_batch.total is None for layer in p.layers.values())


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3),
        dict(kernel_size=3, stride=2, padding=2, dilation=2),
        dict(kernel_size=4, padding="same"),
        dict(kernel_size=3, padding=1, padding_mode="reflect", bias=False),
    ],
)
@pytest.mark.parametrize("scaling", ["expand", "per_example", "kaisa"])
def test_conv1d_equals_conv2d_with_a_1_by_k_kernel(conv: dict, scaling: str) -> None:
    torch.manual_seed(0)
    c1 = nn.Conv1d(3, 4, dtype=D, **conv)
    kw = dict(conv)
    k = kw.pop("kernel_size")
    pad = kw.pop("padding", 0)
    stride, dilation = kw.pop("stride", 1), kw.pop("dilation", 1)
    c2 = nn.Conv2d(
        3,
        4,
        (1, k),
        stride=(1, stride),
        padding=pad if isinstance(pad, str) else (0, pad),
        dilation=(1, dilation),
        dtype=D,
        **kw,
    )
    c2.weight.data.copy_(c1.weight.detach().unsqueeze(2))
    if c1.bias is not None:
        c2.bias.data.copy_(c1.bias.detach())
    x = torch.randn(5, 3, 11, dtype=D)
    grads = []
    for conv_layer, inp in ((c1, x), (c2, x.unsqueeze(2))):
        model = nn.Sequential(conv_layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2, dtype=D))
        model(inp)  # materialise the head
        model[3].weight.data.copy_(
            torch.linspace(-1, 1, model[3].weight.numel(), dtype=D).view(2, -1)
        )
        model[3].bias.data.zero_()
        p = KFACPreconditioner(model, factor_scaling=scaling, kl_clip=None, damping=0.01)
        model(inp).pow(2).mean().backward()
        p.step()
        assert p.layers["0"].ready
        grads.append((conv_layer.weight.grad.reshape(4, -1), p.layers["0"].a_factor))
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-13)


OPTIONS = {
    "bias_kv, zero attention, bool mask": (
        dict(add_bias_kv=True, add_zero_attn=True),
        lambda t, s: dict(attn_mask=torch.ones(t, s, dtype=torch.bool).triu(1)),
    ),
    "float 3-D mask, per-head weights": (
        {},
        lambda t, s: dict(
            attn_mask=torch.randn(N * HEADS, t, s, dtype=D), average_attn_weights=False
        ),
    ),
    "causal hint with its mask, no weights": (
        {},
        lambda t, s: dict(
            attn_mask=nn.Transformer.generate_square_subsequent_mask(t, dtype=D),
            is_causal=True,
            need_weights=False,
        ),
    ),
    "padding mask and weights": (
        dict(batch_first=True),
        lambda t, s: dict(key_padding_mask=torch.arange(s).expand(N, s) >= s - 1),
    ),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_the_engine_attention_forward_computes_what_the_module_computes(case: str) -> None:
    """Outputs, attention weights and input gradients of an attached module equal its own forward's."""
    build, call = OPTIONS[case]
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, HEADS, dtype=D, **build)
    x = torch.randn(L, N, E, dtype=D)
    if attn.batch_first:
        x = x.transpose(0, 1).contiguous()
    kwargs = call(L, L)
    results = []
    for attached in (False, True):
        p = KFACPreconditioner(attn, kl_clip=None) if attached else None
        xi = x.clone().requires_grad_()
        out, weights = attn(xi, xi, xi, **kwargs)
        out.square().sum().backward()
        results.append((out, weights, xi.grad))
        if p is not None:
            assert all(layer.a_batch.total is not None for layer in p.layers.values())
            p.remove()
    for got, want in zip(results[1], results[0]):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
