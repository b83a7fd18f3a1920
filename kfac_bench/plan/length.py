"""How long a recipe trains, in optimizer steps at N GPUs: its epochs (or step budget), its batch and
scaling rule, the training set's size, and the baseline arm it is compared with.

Steps per epoch follow the harness's loader (:func:`kfac_bench.data.loader.make_loaders`): each rank takes
``ceil(examples / N)`` examples (the sampler pads to equal shards), drops the last incomplete micro-batch, and
``accumulation`` micro-batches make one optimizer step. A recipe with ``train.max_steps`` stops at whichever
of its step budget and its epochs ends first.

The baseline arm of a K-FAC recipe ``NAME`` is the recipe ``NAME_<optimizer>`` (``resnet50_imagenet_sgd``,
``bert_large_pretrain_phase2_lamb``; a smoke twin ``NAME_smoke`` pairs with ``NAME_<optimizer>_smoke``), or
the one ``plan.baseline`` names; it is composed with the same command line less its ``kfac`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kfac_bench.config.bounds import validate_run
from kfac_bench.config.compose import compose_run
from kfac_bench.data.batching import accumulation_steps, rank_batch
from kfac_bench.errors import ConfigError

__all__ = [
    "TRAIN_EXAMPLES",
    "RunLength",
    "baseline_name",
    "load_baseline",
    "run_length",
    "steps_per_epoch",
    "with_length",
]

#: Training examples of the datasets whose size the config alone decides (dataset option -> examples; a
#: callable of the dataset node where the config splits it). ImageNet-1k: the ILSVRC-2012 training set
#: (``kfac_bench/data/imagenet.py``); CIFAR-10: its five training batches; digits: scikit-learn's 1797
#: images less the validation share. Others (COCO, the BERT shards) are known from their files only:
#: ``plan.dataset_size`` gives them, or the recipe's ``train.max_steps`` decides alone.
TRAIN_EXAMPLES: dict[str, Any] = {
    "imagenet": 1_281_167,
    "cifar10": 50_000,
    "digits": lambda d: 1797 - round(1797 * float(d.val_fraction)),
}


def steps_per_epoch(examples: int, world_size: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps per epoch on ``world_size`` ranks (padded shards, last micro-batch dropped)."""
    return (math.ceil(examples / world_size) // batch_size) // accumulation


@dataclass(frozen=True)
class RunLength:
    """A recipe's length and batch (its ``train`` node), and the examples of its training set.

    Attributes:
        recipe: the recipe's name.
        optimizer: the first-order optimizer's name (``sgd``, ``lamb``, ...).
        kfac: whether the recipe trains with K-FAC.
        epochs, max_steps: the recipe's ``train.epochs`` and ``train.max_steps`` (None: no step budget).
        batch_size: per-GPU micro-batch.
        global_batch_size: fixed examples per step, or None (then ``batch_size · N · accumulation``).
        accumulation: micro-batches per step when no global batch is set.
        examples: training examples (None: unknown, see :data:`TRAIN_EXAMPLES`).
        dataset: the dataset option's name.
    """

    recipe: str
    optimizer: str
    kfac: bool
    epochs: int
    max_steps: int | None
    batch_size: int
    global_batch_size: int | None
    accumulation: int
    examples: int | None
    dataset: str

    def rank_batch(self, world_size: int) -> int:
        """Each rank's micro-batch on ``world_size`` ranks: a stated global batch is split, not grown (the
        harness's rule, :func:`kfac_bench.data.batching.rank_batch`)."""
        return rank_batch(self.batch_size, world_size, self.global_batch_size)

    def micro_batches(self, world_size: int) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks (the harness's rule)."""
        return accumulation_steps(
            self.rank_batch(world_size), world_size, self.global_batch_size, self.accumulation
        )

    def global_batch(self, world_size: int) -> int:
        return self.rank_batch(world_size) * world_size * self.micro_batches(world_size)

    def steps(self, world_size: int) -> tuple[int | None, int | None, str]:
        """(optimizer steps to the end of training, steps per epoch, how they were counted) on
        ``world_size`` ranks; (None, None, why) when neither the dataset size nor a step budget is known,
        or an epoch holds no step."""
        per_epoch = None
        if self.examples is not None:
            per_epoch = steps_per_epoch(
                self.examples,
                world_size,
                self.rank_batch(world_size),
                self.micro_batches(world_size),
            )
        if per_epoch is not None and per_epoch > 0:
            by_epochs = self.epochs * per_epoch
            if self.max_steps is not None and self.max_steps < by_epochs:
                return self.max_steps, per_epoch, f"train.max_steps={self.max_steps}"
            return by_epochs, per_epoch, f"{self.epochs} epochs × {per_epoch} steps"
        if self.max_steps is not None:
            return self.max_steps, per_epoch, f"train.max_steps={self.max_steps}"
        if per_epoch == 0:
            return (
                None,
                0,
                f"an epoch of {self.examples} examples holds no step at {world_size} GPUs",
            )
        return (
            None,
            None,
            f"the size of dataset '{self.dataset}' is known from its files only: give "
            "plan.dataset_size=EXAMPLES",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_length(cfg: Any, recipe: str, dataset_size: int | None = None) -> RunLength:
    """The :class:`RunLength` of a composed run config (``dataset_size``: ``plan.dataset_size``)."""
    dataset = str(cfg.hydra.runtime.choices.get("dataset", "")) if "hydra" in cfg else ""
    examples = dataset_size
    if examples is None:
        known = TRAIN_EXAMPLES.get(dataset)
        examples = known(cfg.dataset) if callable(known) else known
    t = cfg.train
    return RunLength(
        recipe=recipe,
        optimizer=str(getattr(cfg.optimizer.name, "value", cfg.optimizer.name)),
        kfac=bool(cfg.kfac.enabled),
        epochs=int(t.epochs),
        max_steps=None if t.max_steps is None else int(t.max_steps),
        batch_size=int(t.batch_size),
        global_batch_size=None if t.global_batch_size is None else int(t.global_batch_size),
        accumulation=int(t.accumulation_steps),
        examples=None if examples is None else int(examples),
        dataset=dataset,
    )


def baseline_name(recipe: str, optimizer: str) -> str:
    """The baseline recipe's name by the recipes' convention (``NAME_sgd``, ``NAME_sgd_smoke``)."""
    if recipe.endswith("_smoke"):
        return f"{recipe.removesuffix('_smoke')}_{optimizer}_smoke"
    return f"{recipe}_{optimizer}"


def load_baseline(
    overrides: Sequence[str],
    kfac_arm: RunLength,
    name: str | None = None,
    dataset_size: int | None = None,
) -> RunLength:
    """The baseline arm's :class:`RunLength`: recipe ``name`` (default :func:`baseline_name`), composed
    with ``overrides`` (the plan's command line) less the recipe and every ``kfac`` key.

    Raises:
        ConfigError: no such recipe, or a baseline that trains with K-FAC.
    """
    chosen = name or baseline_name(kfac_arm.recipe, kfac_arm.optimizer)
    rest = [
        o
        for o in overrides
        if not o.lstrip("+~").startswith(("recipe=", "kfac=", "kfac.", "recipe.", "name="))
    ]
    try:
        cfg = compose_run([f"+recipe={chosen}", *rest], return_hydra_config=True)
    except ConfigError as err:
        if name is None and f"'{chosen}'" in str(err):
            raise ConfigError(
                f"no baseline recipe '{chosen}' for '{kfac_arm.recipe}': name one with "
                "plan.baseline=RECIPE"
            ) from None
        raise
    validate_run(cfg)
    length = run_length(cfg, chosen, dataset_size)
    if length.kfac:
        raise ConfigError(
            f"plan.baseline={chosen} trains with K-FAC: name a first-order recipe, e.g. "
            f"{baseline_name(kfac_arm.recipe, kfac_arm.optimizer)}"
        )
    return length


def with_length(arm: RunLength, epochs: int | None, max_steps: int | None) -> RunLength:
    """``arm`` with its epochs and/or step budget replaced (None: the recipe's), for ``plan.kfac_*`` and
    ``plan.baseline_*``."""
    from dataclasses import replace

    if epochs is not None:
        arm = replace(arm, epochs=epochs)
    if max_steps is not None:
        arm = replace(arm, max_steps=max_steps)
    return arm
