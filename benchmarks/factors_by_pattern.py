"""K-FAC on third-party model code: which layers' factors are exact under which training pattern.

Run: ``python -m benchmarks.factors_by_pattern [--models M ...] [--patterns P ...] [--json PATH]`` (CPU,
float64, minutes). Each model is a tiny configuration of a torchvision / Hugging Face / timm family (same
layer types and forward code as the full size, random weights, dropout and stochastic depth off). ResNets are
left to the recipe tests: their 4609² factors make a float64 eigendecomposition per pattern too slow for this
table. For each pattern the factors after one factor step (``factor_decay=0``, two accumulated micro-batches)
are compared with those of the plain eager run of the same model and batches; the plain run itself is what
``tests/kfac`` checks against dense float64 factors.

A cell is ``exact`` when every layer preconditioned in the plain run has factors within 1e-9 (relative,
Frobenius) of the plain run's, else it names the largest difference, and it lists layers left out (with the
reason ``coverage()`` gives). ``n/a``: the library has no switch for the pattern.

``pruned``: the first registered layer is pruned (``torch.nn.utils.prune.l1_unstructured``) after the
preconditioner was built; the cell lists the layers left out at the next step (the pruned one, as
``computed_weight``, and no other); factors are not compared (the pruned weights change every activation
after them).

``bf16_autocast`` is compared differently: the float32 copy of the model takes one step under CPU bf16
autocast, and each layer's factors are compared with dense float64 factors of the input and output gradient
that layer received (captured by hooks of this script, upcast), as ``tests/kfac/test_amp.py`` does; it also
counts the layers whose input and output gradient were bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

from kfac_bench.kfac import KFACPreconditioner
from kfac_bench.models.layer_types import register_harness_layer_types

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kfac_bench.kfac.state import LayerState

D = torch.float64
Batch = Any
# What a loss function calls: a module, or what torch.compile makes of one.
Forward = Callable[..., Any]
LossFn = Callable[[Forward, Batch], torch.Tensor]


# ------------------------------------------------------------------ models
def _vision_batches(n: int = 2, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(n, 3, size, size, generator=g, dtype=D),
            torch.randint(0, 10, (n,), generator=g),
        )
        for _ in range(2)
    ]


def _vision_loss(model: Forward, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=10)


def _tv_swin(v2: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from torchvision.models import swin_transformer as tv

        block = tv.SwinTransformerBlockV2 if v2 else tv.SwinTransformerBlock
        merge = tv.PatchMergingV2 if v2 else tv.PatchMerging
        return tv.SwinTransformer(
            [4, 4],
            16,
            [2],
            [2],
            [2, 2],
            stochastic_depth_prob=0.0,
            num_classes=10,
            block=block,
            downsample_layer=merge,
        )

    return build


def _tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=10)


def _tv_mobilenet_v3() -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(
            name, pretrained=False, num_classes=10, drop_path_rate=0.0, **kwargs
        )

    return build


def _hf(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers as tf

        common: dict[str, Any] = dict(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2
        )
        if kind == "bert":
            bert = tf.BertConfig(
                **common,
                intermediate_size=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                max_position_embeddings=32,
            )
            return tf.BertForMaskedLM(bert)
        if kind == "gpt2":
            gpt2 = tf.GPT2Config(
                vocab_size=64,
                n_embd=16,
                n_layer=2,
                n_head=2,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            return tf.GPT2LMHeadModel(gpt2)
        llama = tf.LlamaConfig(
            **common, intermediate_size=32, num_key_value_heads=2, max_position_embeddings=32
        )
        return tf.LlamaForCausalLM(llama)

    return build


def _text_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 12), generator=g) for _ in range(2)]


def _text_loss(model: Forward, ids: Batch) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "torchvision ViT": (_tv_vit, "vision"),
    "torchvision Swin V1": (_tv_swin(False), "vision"),
    "torchvision Swin V2": (_tv_swin(True), "vision"),
    "torchvision ConvNeXt": (_tv_convnext, "vision"),
    "torchvision MobileNetV3": (_tv_mobilenet_v3, "vision"),
    "timm tf_efficientnet_b0": (_timm("tf_efficientnet_b0"), "vision"),
    "timm vit_tiny_patch16": (_timm("vit_tiny_patch16_224", img_size=32), "vision"),
    "HF BERT": (_hf("bert"), "text"),
    "HF GPT-2": (_hf("gpt2"), "text"),
    "HF LLaMA": (_hf("llama"), "text"),
}


# ------------------------------------------------------------------ patterns
@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def run(model: nn.Module, kind: str, pattern: str) -> KFACPreconditioner:
    batches = _vision_batches() if kind == "vision" else _text_batches()
    loss_fn: LossFn = _vision_loss if kind == "vision" else _text_loss
    model.train()
    if pattern == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    if pattern.startswith("ckpt_"):
        cast("PreTrainedModel", model).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": pattern == "ckpt_reentrant"}
        )
    p = KFACPreconditioner(
        model,
        factor_decay=0.0,
        kl_clip=None,
        accumulation_steps=2,
        coverage_threshold=0.0,
        factor_scaling="per_example",  # the convention of _dense_factors and of the table's cells
    )
    if pattern == "pruned":  # after construction, as a training script that prunes would
        first = next(iter(p.layers.values())).module
        torch.nn.utils.prune.l1_unstructured(first, "weight", amount=0.5)
    torch.manual_seed(0)  # the same random draws in every pattern
    forward: Forward = model
    if pattern == "compile":
        forward = torch.compile(model, backend="aot_eager")
    if pattern == "ddp_no_sync":
        ddp = nn.parallel.DistributedDataParallel(model)
        with ddp.no_sync():
            (loss_fn(ddp, batches[0]) / 2).backward()
        (loss_fn(ddp, batches[1]) / 2).backward()
    else:
        for b in batches:
            (loss_fn(forward, b) / 2).backward()
    p.step()
    return p


class _Tap(torch.autograd.Function):
    """Identity (a copy, not a view) whose backward records the gradient arriving at the layer's output."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        ctx.grads = grads
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.grads.append(grad.detach())
        return grad, None


class _Received:
    """The input and output gradient of every call of the given layers, captured by hooks of its own.

    The hook replaces the output with a ``_Tap`` copy (after the engine's hook has seen the original), so the
    gradient is the one for the layer's output even when the model then modifies it in place: a retained
    ``.grad`` or a tensor hook would give the gradient of the modified tensor (MobileNetV3's and Swin V2's
    in-place activations)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.calls: dict[str, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {
            n: [] for n in modules
        }
        for name, m in modules.items():
            m.register_forward_hook(self._hook(name), with_kwargs=True)

    def _hook(self, name: str) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, kwargs: Any, out: torch.Tensor) -> torch.Tensor:
            x = args[0] if args else kwargs["input"]
            grads: list[torch.Tensor] = []
            self.calls[name].append((x.detach(), grads))
            return _Tap.apply(out, grads)

        return hook


def _dense_factors(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 A and G (``per_example`` scaling) of one call, straight from the definitions: rows from unfold
    for a Conv2d, the last dimension otherwise (Linear, transformers' Conv1D); ``g`` is the received
    gradient of the mean loss, so the per-example gradient is ``g * N``."""
    x, g = x.to(D), g.to(D)
    n = x.shape[0]
    if isinstance(module, nn.Conv2d):
        xp = F.pad(x, module._reversed_padding_repeated_twice)
        a = F.unfold(xp, module.kernel_size, dilation=module.dilation, stride=module.stride)
        a, d = a.transpose(1, 2), g.flatten(2).transpose(1, 2)
    else:
        a, d = x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        a = torch.cat([a, a.new_ones(*a.shape[:2], 1)], dim=2)
    d = d * n
    return torch.einsum("ntd,nte->de", a, a) / n, torch.einsum("ntd,nte->de", d, d) / (
        n * d.shape[1]
    )


def run_autocast(base: nn.Module, kind: str, plain: KFACPreconditioner) -> dict[str, Any]:
    """One float32 step of the model under CPU bf16 autocast; every preconditioned layer's factors against
    dense float64 factors of the (upcast) tensors that layer received."""
    model = copy.deepcopy(base).float().train()
    if kind == "vision":
        x, y = _vision_batches()[0]
        batch: Batch = (x.float(), y)
        loss_fn: LossFn = _vision_loss
    else:
        batch, loss_fn = _text_batches()[0], _text_loss
    p = KFACPreconditioner(
        model, factor_decay=0.0, kl_clip=None, coverage_threshold=0.0, factor_scaling="per_example"
    )
    rec = _Received({n: layer.module for n, layer in p.layers.items()})
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, batch)
    loss.float().backward()
    p.step()
    worst, left, low, low_g = 0.0, {}, 0, 0
    for name in plain.layers:
        layer = p.layers.get(name)
        calls = rec.calls.get(name, [])
        if layer is None or not layer.ready:
            left[name] = layer.not_ready_reason if layer is not None else "not registered"
            continue
        if len(calls) != 1 or len(calls[0][1]) != 1:
            left[name] = f"no reference ({len(calls)} calls captured)"
            continue
        x, (g,) = calls[0]
        low += x.dtype == torch.bfloat16
        low_g += g.dtype == torch.bfloat16
        for got, ref in zip(_factors(layer), _dense_factors(layer.module, x, g)):
            worst = max(worst, float((got.to(D) - ref).norm() / ref.norm().clamp_min(1e-300)))
    return {
        "max_rel": worst,
        "left_out": left,
        "layers": len(plain.layers),
        "bf16_inputs": low,
        "bf16_output_grads": low_g,
    }


def _factors(layer: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (A, G) running factors, which a layer that took a step holds."""
    if layer.a_factor is None or layer.g_factor is None:
        raise RuntimeError(f"layer {layer.name} holds no factors after a step")
    return layer.a_factor, layer.g_factor


def compare(plain: KFACPreconditioner, got: KFACPreconditioner) -> dict[str, Any]:
    worst, left = 0.0, {}
    reasons = {n: r for r, names in got.coverage().left_out.items() for n in names}
    for name, ref in plain.layers.items():
        layer = got.layers.get(name)
        if layer is None or not layer.ready:
            left[name] = (
                layer.not_ready_reason if layer is not None else reasons.get(name, "not registered")
            )
            continue
        for a, b in zip(_factors(layer), _factors(ref)):
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-300)))
    return {"max_rel": worst, "left_out": left}


PATTERNS = (
    "plain",
    "ckpt_reentrant",
    "ckpt_nonreentrant",
    "compile",
    "ddp_no_sync",
    "channels_last",
    "bf16_autocast",
    "pruned",
)


def measure(names: list[str], patterns: tuple[str, ...]) -> dict[str, Any]:
    register_harness_layer_types()
    out: dict[str, Any] = {}
    for name in names:
        build, kind = MODELS[name]
        torch.manual_seed(0)
        base = build().to(D)
        register_harness_layer_types()  # after the build: it registers the libraries already loaded
        plain = run(copy.deepcopy(base), kind, "plain")
        cov = plain.coverage()
        row: dict[str, Any] = {
            "coverage": str(cov),
            "eligible_share": cov.eligible_share,
            "left_out": {k: len(v) for k, v in cov.left_out.items()},
        }
        for pattern in patterns[1:]:
            if pattern.startswith("ckpt_") and kind != "text":
                row[pattern] = "n/a"
                continue
            if pattern == "channels_last" and kind != "vision":
                row[pattern] = "n/a"
                continue
            try:
                ctx = _one_rank_group() if pattern == "ddp_no_sync" else contextlib.nullcontext()
                with ctx:
                    if pattern == "bf16_autocast":
                        row[pattern] = run_autocast(base, kind, plain)
                    elif pattern == "pruned":
                        got = run(copy.deepcopy(base), kind, pattern)
                        row[pattern] = {"left_out": compare(plain, got)["left_out"]}
                    else:
                        row[pattern] = compare(plain, run(copy.deepcopy(base), kind, pattern))
            except Exception as err:  # report, do not stop the table
                row[pattern] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.factors_by_pattern", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--patterns", nargs="*", default=list(PATTERNS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.models, tuple(["plain", *[p for p in args.patterns if p != "plain"]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
