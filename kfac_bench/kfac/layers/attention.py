"""nn.MultiheadAttention: its q, k and v input projections as three Linear-type layers, its ``out_proj`` as
the Linear it is.

``F.multi_head_attention_forward`` reads ``in_proj_weight`` (or ``q/k/v_proj_weight``) and
``out_proj.weight`` functionally, so no module hook sees a projection's input or output gradient. While a
preconditioner is attached, each registered ``nn.MultiheadAttention`` therefore runs :func:`attention_forward`
in training mode with gradients: the same computation written as the equivalent module would be, the three
projections as calls of :class:`AttentionProjection` (engine-owned modules outside the model tree, whose
forward is ``F.linear`` on the slice of the packed weight or on the separate weight), then
``F.scaled_dot_product_attention`` (or, with ``need_weights``, the explicit softmax that returns the
weights) and a call of ``out_proj``. Its K-FAC blocks are those of ``nn.Linear`` q/k/v/out layers + SDPA
(self- and cross-attention, packed or separate weights, ``batch_first`` either way); eval-mode and no-grad
forwards, and forwards traced by ``torch.compile``, run the module's own forward (under ``torch.compile``
its four layers are then reported as not run, keeping plain gradients). Removing the preconditioner
restores the module's forward.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear import LinearHandler

PARTS = ("q", "k", "v")
_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


class AttentionProjection(nn.Module):
    """The q, k or v input projection (``part`` 0, 1, 2) of ``attn`` as a module: ``F.linear`` on its
    weight (a row slice of ``in_proj_weight``, or ``q/k/v_proj_weight``) and its slice of
    ``in_proj_bias``. Held by the engine, not by the model (no state of its own)."""

    def __init__(self, attn: nn.MultiheadAttention, part: int) -> None:
        super().__init__()
        self.__dict__["attn"] = attn  # not a submodule: the model's state_dict stays as it is
        self.part = part

    def extra_repr(self) -> str:
        return f"part={PARTS[self.part]}"

    @property
    def owner(self) -> nn.MultiheadAttention:
        attn = self.__dict__["attn"]
        assert isinstance(attn, nn.MultiheadAttention)
        return attn

    def parameter(self) -> nn.Parameter:
        """The parameter holding this projection's weight (the whole packed one when packed)."""
        attn = self.owner
        w = attn.in_proj_weight if attn._qkv_same_embed_dim else getattr(attn, _SEPARATE[self.part])
        assert isinstance(w, nn.Parameter)
        return w

    def rows(self) -> slice:
        e = self.owner.embed_dim
        return slice(self.part * e, (self.part + 1) * e)

    def weight_of(self, w: torch.Tensor) -> torch.Tensor:
        """This projection's ``(embed_dim, in)`` rows of ``w`` (the parameter or its gradient)."""
        return w[self.rows()] if self.owner._qkv_same_embed_dim else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.owner.in_proj_bias
        b = None if bias is None else bias[self.rows()]
        return F.linear(x, self.weight_of(self.parameter()), b)


class AttentionProjectionHandler(LinearHandler):
    """K-FAC contribution of an :class:`AttentionProjection`: a Linear layer (every token a row) whose
    gradient matrix is its rows of the packed weight's (and bias's) gradient."""

    #: Its parameter also gets the other projections' gradient: the outside-gradient check does not apply.
    shares_parameter = True

    def __repr__(self) -> str:
        return "AttentionProjectionHandler()"

    def parameters(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(module, AttentionProjection)
        return module.parameter(), module.owner.in_proj_bias

    def dims(self, module: nn.Module, bias: bool) -> tuple[int, int]:
        assert isinstance(module, AttentionProjection)
        w = module.weight_of(module.parameter())
        return w.shape[1] + int(bias), w.shape[0]

    def grad_blocks(
        self, module: nn.Module, bias: bool, create: bool = False
    ) -> list[tuple[torch.Tensor | None, int, int]] | None:
        """:meth:`WeightBiasHandler.grad_blocks` of the projection's rows of the (packed) weight and bias
        gradients (row slices: views, no copy)."""
        assert isinstance(module, AttentionProjection)
        w, b = self.parameters(module)
        if w.grad is None:
            return None
        m = module.weight_of(w.grad)
        n_w = m.shape[1]
        blocks: list[tuple[torch.Tensor | None, int, int]] = [(m, 0, n_w)]
        if bias:
            assert b is not None
            if b.grad is None and create:
                b.grad = torch.zeros_like(b)
            bg = None if b.grad is None else b.grad[module.rows()].view(-1, 1)
            blocks.append((bg, n_w, n_w + 1))
        return blocks

    def grad(self, module: nn.Module, bias: bool) -> torch.Tensor | None:
        assert isinstance(module, AttentionProjection)
        w, b = self.parameters(module)
        if w.grad is None:
            return None
        g = module.weight_of(w.grad)
        if bias:
            assert b is not None
            bg = b.grad[module.rows()] if b.grad is not None else g.new_zeros(g.shape[0])
            g = torch.cat([g, bg.reshape(-1, 1).to(g.dtype)], dim=1)
        return g

    def set_grad(
        self, module: nn.Module, grad: torch.Tensor, bias: bool, scale: torch.Tensor | None = None
    ) -> None:
        assert isinstance(module, AttentionProjection)
        if scale is not None:
            grad = grad * scale.to(grad.dtype)
        w, b = self.parameters(module)
        assert w.grad is not None
        n_w = grad.shape[1] - int(bias)
        module.weight_of(w.grad).copy_(grad[:, :n_w])
        if bias:
            assert b is not None
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            b.grad[module.rows()].copy_(grad[:, n_w])


#: Each attention module's three projections, made once (a new scan finds the same modules).
_PROJECTIONS: weakref.WeakKeyDictionary[nn.MultiheadAttention, tuple[AttentionProjection, ...]] = (
    weakref.WeakKeyDictionary()
)
#: Attention modules running :func:`attention_forward` -> how many registered projections asked for it.
_INSTALLED: weakref.WeakKeyDictionary[nn.MultiheadAttention, int] = weakref.WeakKeyDictionary()


def projections(attn: nn.MultiheadAttention) -> tuple[AttentionProjection, ...]:
    """The q, k and v projections of ``attn`` (the same modules at every call)."""
    found = _PROJECTIONS.get(attn)
    if found is None:
        found = tuple(AttentionProjection(attn, i) for i in range(3))
        _PROJECTIONS[attn] = found
    return found


def install_attention_forward(attn: nn.MultiheadAttention) -> _Installed:
    """Run :func:`attention_forward` as ``attn``'s forward until the returned handle is removed (the
    handles of all its registered layers: counted)."""
    return _Installed(attn)


class _Installed:
    """A removable handle: ``attn`` runs :func:`attention_forward` until every handle is removed."""

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        self.attn: nn.MultiheadAttention | None = attn
        count = _INSTALLED.get(attn, 0)
        if count == 0:
            attn.__dict__["forward"] = _EngineForward(attn)
        _INSTALLED[attn] = count + 1

    def remove(self) -> None:
        attn, self.attn = self.attn, None
        if attn is None:
            return
        count = _INSTALLED.get(attn, 1) - 1
        if count <= 0:
            _INSTALLED.pop(attn, None)
            attn.__dict__.pop("forward", None)
        else:
            _INSTALLED[attn] = count


class _EngineForward:
    """The instance ``forward`` of an attention module while the engine's runs. A copy of the module
    (``copy.deepcopy``, pickling) gets one bound to the copy, which no preconditioner registered: it runs
    the module's own forward and feeds no factors."""

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        self.ref = weakref.ref(attn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        attn = self.ref()
        assert attn is not None
        return attention_forward(attn, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _EngineForward:
        attn = self.ref()
        copied = memo.get(id(attn), attn)
        assert isinstance(copied, nn.MultiheadAttention)
        return _EngineForward(copied)

    def __reduce__(self) -> tuple[Any, ...]:
        attn = self.ref()
        assert attn is not None
        return (_EngineForward, (attn,))


def attention_forward(
    attn: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attn(query, key, value, ...)`` with its projections as module calls (module docstring); the
    module's own forward outside training mode or without gradients."""
    projs = _PROJECTIONS.get(attn)
    for p in projs or ():
        p.training = attn.training  # what the engine reads of a registered layer's mode
    # Under torch.compile the module's own forward runs: hooks of modules outside the model tree do not
    # survive tracing, so its projections count as not run (reported) rather than recorded wrongly.
    if (
        projs is None
        or not (attn.training and torch.is_grad_enabled())
        or torch.compiler.is_compiling()
    ):
        return type(attn).forward(
            attn,
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not attn.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    n, tgt, _ = query.shape
    heads, e = attn.num_heads, attn.embed_dim
    hd = e // heads
    q, k, v = projs[0](query), projs[1](key), projs[2](value)
    dtype = q.dtype
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=dtype,
            check_other=False,
        )
        is_causal = is_causal and key_padding_mask is None and attn_mask is None
    if attn.bias_k is not None and attn.bias_v is not None:
        k = torch.cat([k, attn.bias_k.reshape(1, 1, e).expand(n, 1, e)], 1)
        v = torch.cat([v, attn.bias_v.reshape(1, 1, e).expand(n, 1, e)], 1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    qh = q.reshape(n, tgt, heads, hd).transpose(1, 2)
    kh = k.reshape(n, k.shape[1], heads, hd).transpose(1, 2)
    vh = v.reshape(n, v.shape[1], heads, hd).transpose(1, 2)
    if attn.add_zero_attn:
        kh = torch.cat([kh, kh.new_zeros(n, heads, 1, hd)], 2)
        vh = torch.cat([vh, vh.new_zeros(n, heads, 1, hd)], 2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src = kh.shape[2]
    mask = None
    if attn_mask is not None:
        mask = (
            attn_mask.reshape(1, 1, tgt, src)
            if attn_mask.dim() == 2
            else attn_mask.reshape(n, heads, tgt, src)
        )
    if key_padding_mask is not None:
        pad = key_padding_mask.reshape(n, 1, 1, src)
        mask = pad if mask is None else mask + pad
    dropout = attn.dropout if attn.training else 0.0
    weights = None
    if need_weights:
        scores = (qh * math.sqrt(1.0 / hd)) @ kh.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ vh
        if average_attn_weights:
            weights = weights.mean(1)
    else:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, dropout_p=dropout, is_causal=is_causal
        )
    out = attn.out_proj(out.transpose(1, 2).reshape(n, tgt, e))
    if not batched:
        out = out.squeeze(0)
        weights = None if weights is None else weights.squeeze(0)
    elif not attn.batch_first:
        out = out.transpose(0, 1)
    return out, weights
