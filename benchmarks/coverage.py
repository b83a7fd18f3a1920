"""Which layers K-FAC preconditions in each recipe's model, as the engine reports it (README section).

Run: ``python -m benchmarks.coverage [--json PATH]``. Each model is built on the meta device (no memory, no
weights) with the recipe's builder arguments, and scanned with the recipe's ``kfac.skip_layers`` (read from
``recipes/NAME.yaml``; a recipe without the key uses the default, none). The numbers are what
``KFACPreconditioner(model, skip_layers=...).coverage()`` reports at construction, before any step.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from torch import nn

from kfac_bench.kfac import Coverage, scan_model

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _resnet32() -> nn.Module:
    from kfac_bench.models.cifar_resnet import build_cifar_resnet

    return build_cifar_resnet(depth=32, num_classes=10)


def _resnet50() -> nn.Module:
    from kfac_bench.models.torchvision_models import build_torchvision_resnet

    return build_torchvision_resnet("resnet50", num_classes=1000)


def _maskrcnn() -> nn.Module:
    from kfac_bench.models.maskrcnn import build_maskrcnn

    return build_maskrcnn(num_classes=91)


def _bert_large() -> nn.Module:
    from kfac_bench.models.bert import build_bert

    return build_bert("large")


#: README row label -> (recipe whose skip_layers apply, model builder with that recipe's arguments).
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "ResNet-32 (CIFAR-10)": ("resnet32_cifar10", _resnet32),
    "ResNet-50 (ImageNet)": ("resnet50_imagenet", _resnet50),
    "Mask R-CNN R50-FPN, heads only": ("maskrcnn_coco", _maskrcnn),
    "BERT-Large (pretraining)": ("bert_large_pretrain_phase1", _bert_large),
}


def recipe_skip_layers(recipe: str) -> list[str]:
    data = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())
    return list((data.get("kfac") or {}).get("skip_layers") or [])


def coverage(recipe: str, build: Callable[[], nn.Module]) -> Coverage:
    with torch.device("meta"):
        model = build()
    return scan_model(model, recipe_skip_layers(recipe)).coverage()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write every report (Coverage.to_dict) to this file")
    args = parser.parse_args(argv)
    reports = {}
    print(
        "| model (recipe) | layers | preconditioned | of trainable | of matrices/kernels | left out |"
    )
    print("|---|---|---|---|---|---|")
    for label, (recipe, build) in MODELS.items():
        cov = coverage(recipe, build)
        reports[label] = cov.to_dict()
        left = "; ".join(
            f"{k.replace('_', ' ')} {len(v)}"
            + (
                " (" + ", ".join(f"{t}×{n}" for t, n in cov.unsupported_types.items()) + ")"
                if k == "unsupported_type"
                else ""
            )
            for k, v in cov.left_out.items()
        )
        print(
            f"| {label} (`{recipe}`) | {cov.layers} | {cov.preconditioned_params / 1e6:.2f}M | "
            f"{100 * cov.share:.1f}% of {cov.trainable_params / 1e6:.2f}M | "
            f"{100 * cov.eligible_share:.1f}% | {left or '—'} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main()
