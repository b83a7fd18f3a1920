"""Typed schemas of every config group, registered with Hydra's ConfigStore by :mod:`kfac_bench.config`.

Every YAML in ``configs/<group>/`` names its schema first in its defaults list, so a misspelt key or a value
of the wrong type fails when the config is composed, naming the key. Closed choices are enums whose member
names are their lower-case values (OmegaConf parses enums by name), so YAML and the command line use the
plain strings (``compute_method=inverse``); the K-FAC ones are derived from the engine's enums.

Names follow the paper's vocabulary (CONTRIBUTING.md, convention 2): the K-FAC fields that the engine takes
are spelled exactly like :class:`kfac_bench.kfac.KFACPreconditioner`'s keyword arguments; a test keeps them in
step.
"""

# ruff: noqa: UP006, UP035
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Dict, List

from omegaconf import MISSING

from kfac_bench import kfac
from kfac_bench.config.bounds import bounded


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"
    lamb = "lamb"


class ScheduleName(str, Enum):
    warmup_multistep = "warmup_multistep"
    polynomial = "polynomial"
    cosine = "cosine"
    constant = "constant"


class WarmupMethod(str, Enum):
    """How the LR warms up (the names of maskrcnn-benchmark's ``SOLVER.WARMUP_METHOD``).

    ``linear``: the factor rises linearly from ``warmup_start_factor`` to 1. ``mlperf_linear``: the rate
    rises by ``warmup_factor`` per step to the base rate, ``lr(t) = lr - (warmup - t) * warmup_factor``
    (an absolute slope, not a factor of the rate; NVIDIA DeepLearningExamples MaskRCNN
    ``maskrcnn_benchmark/solver/lr_scheduler.py``, ``WarmupMultiStepLR``).
    """

    linear = "linear"
    mlperf_linear = "mlperf_linear"


class ScheduleUnit(str, Enum):
    """What the numbers of an LR schedule count: epochs, optimizer steps, or a fraction of all steps."""

    epochs = "epochs"
    steps = "steps"
    fraction = "fraction"


def _by_value(engine_enum: type[Enum]) -> type[Enum]:
    """The config twin of an engine enum, built from its values: member names *are* the values, so YAML and
    the command line use the engine's strings (OmegaConf parses enums by member name, the engine's members
    are upper-case). A choice the engine adds is a choice of the config at once."""
    members = {m.value: m.value for m in engine_enum}
    return Enum(engine_enum.__name__, members, type=str, module=__name__)  # type: ignore[return-value]


#: K-FAC's closed choices, one source: :mod:`kfac_bench.kfac`'s enums. A type checker sees the engine's
#: enums themselves (their members hold the same values, and the defaults below are looked up by value).
if TYPE_CHECKING:
    from kfac_bench.kfac import (
        AssignmentStrategy,
        ComputeMethod,
        FactorReduction,
        FactorScaling,
        Placement,
    )
else:
    ComputeMethod = _by_value(kfac.ComputeMethod)
    FactorScaling = _by_value(kfac.FactorScaling)
    AssignmentStrategy = _by_value(kfac.AssignmentStrategy)
    Placement = _by_value(kfac.Placement)
    FactorReduction = _by_value(kfac.FactorReduction)

#: Their defaults, looked up by value (the same members under either view).
_DEFAULTS: dict[str, Enum] = {
    "compute_method": ComputeMethod("eigen"),
    "factor_scaling": FactorScaling("expand"),
    "assignment_strategy": AssignmentStrategy("compute"),
    "placement": Placement("lpt"),
    "factor_reduction": FactorReduction("allreduce"),
}


class Precision(str, Enum):
    """Mixed precision of the forward/backward pass; used on CUDA only (CPU runs stay in float32)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ProgressKind(str, Enum):
    """``auto``: a bar on a TTY, plain periodic lines otherwise."""

    auto = "auto"
    bar = "bar"
    lines = "lines"
    none = "none"


class TrainMode(str, Enum):
    """``train``: train to the target, evaluating and checkpointing. ``benchmark``: throughput only (no
    evaluation, no checkpoints, no MLPerf log): ``benchmark_warmup_steps`` untimed steps, then
    ``benchmark_steps`` timed ones, reported as samples/s and step-time percentiles (the ``--mode benchmark``
    of NVIDIA's DeepLearningExamples)."""

    train = "train"
    benchmark = "benchmark"


class TrackerKind(str, Enum):
    """``train.tracker``: an experiment tracker the run also logs to (rank 0), besides its own files."""

    none = "none"
    mlflow = "mlflow"
    wandb = "wandb"


class LauncherName(str, Enum):
    local = "local"
    torchrun = "torchrun"


# ----------------------------------------------------------------------------------------------------------
# Generic groups (one schema, several YAML options each)


@dataclass
class OptimizerConfig:
    """``optimizer/``: the first-order update that runs after K-FAC rewrites the gradients.

    ``lr`` is the per-worker base rate; with ``scale_lr_with_world_size`` the run uses ``lr * world_size``
    (the paper's linear scaling rule). LAMB is timm's ``timm.optim.Lamb``.
    """

    name: OptimizerName = OptimizerName.sgd
    lr: float = bounded(0.1, gt=0, le=1e6)
    momentum: float = bounded(0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = bounded(0.0, ge=0)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, gt=0)
    scale_lr_with_world_size: bool = False
    #: Exclude biases and normalisation weights from weight decay (the BERT recipe's convention).
    no_decay_bias_and_norm: bool = False


@dataclass
class LRScheduleConfig:
    """``lr_schedule/``: a multiplier of the base LR as a plain function of training progress.

    Linear warm-up over ``warmup`` units from ``warmup_start_factor`` (None: ``1 / world_size``, the paper's
    "from LR/N up to LR", i.e. from the single-worker rate) to 1; with ``warmup_method: mlperf_linear``
    the rate instead rises by ``warmup_factor`` (in LR units) per step and reaches the base rate at the end
    of the warm-up, multiplied by ``gamma`` for every milestone passed (see :class:`WarmupMethod`).
    Then: ``warmup_multistep`` multiplies by ``gamma`` at every milestone passed; ``polynomial`` decays as
    ``(1 - t/total) ** power`` to ``min_factor``; ``cosine`` follows a half cosine to ``min_factor``;
    ``constant`` stays at 1.
    ``total`` defaults to the run's length. ``decay_from_start``: the polynomial/cosine progress counts from
    step 0, not from the end of the warm-up, as NVIDIA's BERT ``PolyWarmUpScheduler`` does (the paper's BERT
    runs): the rate then drops from 1 to ``(1 - warmup/total) ** power`` when the warm-up ends.
    """

    name: ScheduleName = ScheduleName.warmup_multistep
    unit: ScheduleUnit = ScheduleUnit.epochs
    warmup: float = bounded(0.0, ge=0)
    warmup_start_factor: float | None = bounded(None, ge=0, le=1)
    warmup_method: WarmupMethod = WarmupMethod.linear
    warmup_factor: float = bounded(0.0, ge=0)
    milestones: List[float] = field(default_factory=list)
    gamma: float = bounded(0.1, gt=0)
    power: float = bounded(1.0, ge=0)
    min_factor: float = bounded(0.0, ge=0, le=1)
    total: float | None = bounded(None, gt=0)
    decay_from_start: bool = False


@dataclass
class KFACConfig:
    """``kfac/``: whether and how K-FAC preconditions the gradients.

    The fields from ``factor_update_steps`` to ``factor_position_fraction`` are the engine's keyword
    arguments, same names and meaning (see ``KFACPreconditioner``; ``batch_dim`` as regex -> dim, empty:
    detected). ``grad_worker_fraction`` is a number in (0, 1] or one of ``comm_opt`` (1), ``mem_opt``
    (1/world size), ``hybrid_opt``.

    Harness-only fields:
        enabled: False is the first-order baseline (``kfac=none``): same loop, data order and metrics.
        damping_decay_epochs / damping_decay_factor: damping is multiplied by the factor once per
            milestone passed, as a plain function of the epoch (not compounding per call).
        update_interval_decay_epochs / update_interval_decay_factor: both update intervals are multiplied
            by the factor (the reference's ``update_freq_alpha``) once per milestone passed.
        reference_world_size: if set, both intervals are given for this world size and scaled by
            ``reference_world_size / world_size`` (at least 1), which keeps the number of K-FAC updates per
            epoch constant as workers are added (the paper's ResNet-50 scaling runs: 2000 at 16 GPUs ... 125
            at 256 GPUs is ``inv_update_steps=2000 reference_world_size=16``).
    """

    enabled: bool = True
    factor_update_steps: int = bounded(1, ge=1)
    inv_update_steps: int = bounded(10, ge=1)
    damping: float = bounded(0.003, ge=0)
    factor_decay: float = bounded(0.95, ge=0, lt=1)
    kl_clip: float | None = bounded(0.001, gt=0)
    compute_method: ComputeMethod = _DEFAULTS["compute_method"]  # type: ignore[assignment]
    compute_eigenvalue_outer_product: bool = True
    factor_dtype: str | None = None
    inv_dtype: str | None = None
    skip_layers: List[str] = field(default_factory=list)
    factor_scaling: FactorScaling = _DEFAULTS["factor_scaling"]  # type: ignore[assignment]
    grad_worker_fraction: str = "comm_opt"
    assignment_strategy: AssignmentStrategy = _DEFAULTS["assignment_strategy"]  # type: ignore[assignment]
    colocate_factors: bool = True
    placement: Placement = _DEFAULTS["placement"]  # type: ignore[assignment]
    factor_reduction: FactorReduction = _DEFAULTS["factor_reduction"]  # type: ignore[assignment]
    allreduce_bucket_cap_mb: float = bounded(25.0, gt=0)
    symmetry_aware: bool = False
    comm_dtype: str | None = None
    track_stage_times: bool = True
    coverage_threshold: float = bounded(0.5, ge=0, le=1)
    factor_batch_fraction: float = bounded(1.0, gt=0, le=1)
    batch_dim: Dict[str, int] = field(default_factory=dict)
    lowrank_fraction: float = bounded(0.25, gt=0, le=1)
    lowrank_min_dim: int = bounded(1024, ge=1)
    factor_position_fraction: float = bounded(1.0, gt=0, le=1)
    damping_decay_epochs: List[int] = field(default_factory=list)
    damping_decay_factor: float = bounded(0.5, gt=0)
    update_interval_decay_epochs: List[int] = field(default_factory=list)
    update_interval_decay_factor: float = bounded(10.0, gt=0)
    reference_world_size: int | None = bounded(None, ge=1)


@dataclass
class LauncherConfig:
    """``launcher/``: ``local`` runs in this process (or under an outer torchrun/srun); ``torchrun`` starts
    ``nproc_per_node`` processes on this machine through ``torch.distributed.run``; a failed rank restarts
    every rank (up to ``max_restarts`` times) and they resume from the last checkpoint."""

    name: LauncherName = LauncherName.local
    nproc_per_node: int = bounded(1, ge=1)
    max_restarts: int = bounded(0, ge=0)
    monitor_interval: float = bounded(1.0, gt=0)


# ----------------------------------------------------------------------------------------------------------
# The loop and the whole run


@dataclass
class TrainConfig:
    """``train``: the loop's settings.

    Length: ``epochs``, or ``max_steps`` optimizer steps if set (whichever ends first). Batches:
    ``batch_size`` is the per-process micro-batch; ``global_batch_size`` (if set) fixes the examples per
    optimizer step and derives ``accumulation_steps = global / (batch_size * world_size)``.
    ``targets`` maps task metrics to target values; the run reaches its target when all are met
    (``higher_is_better`` comes from the task). ``limit_*_batches`` cut epochs short for smoke runs.
    """

    epochs: int = bounded(10, ge=1)
    max_steps: int | None = bounded(None, ge=1)
    batch_size: int = bounded(32, ge=1)
    eval_batch_size: int | None = bounded(None, ge=1)
    global_batch_size: int | None = bounded(None, ge=1)
    accumulation_steps: int = bounded(1, ge=1)
    grad_clip_norm: float | None = bounded(None, gt=0)
    eval_every_epochs: int = bounded(1, ge=0)
    eval_every_steps: int | None = bounded(None, ge=0)
    targets: Dict[str, float] = field(default_factory=dict)
    stop_at_target: bool = False
    seed: int = bounded(0, ge=0, lt=2**62)  # seed + rank fits torch's 64-bit seed
    precision: Precision = Precision.fp32
    device: DeviceKind = DeviceKind.auto
    num_workers: int = bounded(0, ge=0)
    #: torch CPU threads per process; None: the machine's cores divided by the ranks on this node.
    cpu_threads: int | None = bounded(None, ge=1)
    find_unused_parameters: bool = False
    checkpoint_every_epochs: int = bounded(1, ge=0)
    checkpoint_every_steps: int | None = bounded(None, ge=0)
    #: Checkpoints kept in ``checkpoints/`` (the newest K); a resume falls back to an older one when the
    #: newest fails its checksum.
    keep_checkpoints: int = bounded(2, ge=2)
    #: Save a checkpoint when the run ends (finished, or stopped at its target). False: only the periodic
    #: and preemption checkpoints, for runs whose final state nobody resumes or starts from (the image
    #: smoke twins: a full ResNet-50 / Mask R-CNN checkpoint is 250-400 MB).
    checkpoint_at_end: bool = True
    resume: bool = True
    log_every_steps: int = bounded(20, ge=1)
    progress: ProgressKind = ProgressKind.auto
    limit_train_batches: int | None = bounded(None, ge=1)
    limit_eval_batches: int | None = bounded(None, ge=1)
    tensorboard: bool = True
    #: Also log to MLflow or Weights & Biases (``kfac_bench/metrics/trackers.py``): the config as
    #: parameters, every evaluation's metrics, and time-to-target when the run ends.
    tracker: TrackerKind = TrackerKind.none
    #: MLflow's tracking URI (default: a file store in the run directory, ``mlruns/``); W&B's directory
    #: (default: the run directory). W&B runs offline unless ``WANDB_MODE`` says otherwise.
    tracker_uri: str | None = None
    #: MLflow's experiment / W&B's project: runs of every arm go to one, to be compared there.
    tracker_project: str = "kfac-bench"
    #: ``mlperf.log``: None (the default, "auto") writes it only for a run of an MLPerf benchmark (a
    #: ``benchmark_name`` that MLPerf Training has: ``resnet``, ``maskrcnn``, ``bert``) in ``train`` mode;
    #: true always, false never.
    mlperf_log: bool | None = None
    benchmark_name: str = "kfac_bench"
    mode: TrainMode = TrainMode.train
    benchmark_steps: int = bounded(100, ge=1)
    benchmark_warmup_steps: int = bounded(10, ge=0)
    #: Start from another run (BERT phase 2 from phase 1; the phase-2 recipes set it to
    #: ``model.init_checkpoint``): its run directory or ``checkpoints/last.pt``. Model, optimizer state and
    #: K-FAC factors are carried over; counters and LR schedule start at 0
    #: (``kfac_bench/checkpoint/warm_start.py``). Ignored when this run directory resumes from its own
    #: checkpoint.
    init_from: str | None = None
    #: The campaign this run belongs to: runs compared together share one. None: the Hydra sweep folder of a
    #: ``--multirun`` job, or none for a single run. Recorded in ``summary.json``; ``compare`` never pools
    #: two campaigns silently.
    campaign: str | None = None


@dataclass
class TuningConfig:
    """``tuning``: where a recipe's hyperparameters come from, for ``compare``'s fairness checks.

    ``arm`` is the arm the values were tuned for: the optimizer's name (``sgd``, ``lamb``, ...) for a
    first-order arm, ``kfac`` for a K-FAC arm. ``source`` says how (the command that ran the grid, or the
    paper's table). ``values`` holds the tuned values as nested config keys (``{optimizer: {lr: 0.1},
    lr_schedule: {...}, kfac: {damping: 0.003}}``): a run whose config differs from them is not the tuned
    configuration. ``kfac-bench tune`` writes this block into the recipes it produces. ``source`` None: no
    tuning record.
    """

    arm: str | None = None
    source: str | None = None
    values: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    """The whole run. ``model``, ``dataset`` and ``task`` carry the schema of their selected option
    (``_target_`` plus the builder's keyword arguments)."""

    model: Any = MISSING
    dataset: Any = MISSING
    task: Any = MISSING
    optimizer: OptimizerConfig = MISSING
    lr_schedule: LRScheduleConfig = MISSING
    kfac: KFACConfig = MISSING
    launcher: LauncherConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    #: A free-form name for the run (recipes set it), shown by ``compare``.
    name: str = "run"
    #: Where the hyperparameters come from (recipes set it).
    tuning: TuningConfig = field(default_factory=TuningConfig)


# ----------------------------------------------------------------------------------------------------------
# Builders selectable in model/ dataset/ task/ (one schema per builder; its fields are the builder's kwargs)


@dataclass
class SmallCNNConfig:
    _target_: str = "kfac_bench.models.small_cnn.build_small_cnn"
    channels: int = 32
    hidden: int = 64
    num_classes: int = 10
    image_size: int = 8


@dataclass
class DigitsConfig:
    _target_: str = "kfac_bench.data.digits.build_digits"
    root: str | None = None
    val_fraction: float = bounded(0.2, gt=0, lt=1)
    split_seed: int = 0


@dataclass
class ClassificationTaskConfig:
    _target_: str = "kfac_bench.tasks.classification.build_classification"
    label_smoothing: float = bounded(0.0, ge=0, lt=1)
    topk: List[int] = field(default_factory=lambda: [1, 5])
    target_metric: str = "top1"


#: (group, name, dataclass): stored as ``schema/<group>/<name>``; YAML options extend them by that path.
SCHEMAS: list[tuple[str, str, type]] = [
    ("optimizer", "base", OptimizerConfig),
    ("lr_schedule", "base", LRScheduleConfig),
    ("kfac", "base", KFACConfig),
    ("launcher", "base", LauncherConfig),
    ("model", "small_cnn", SmallCNNConfig),
    ("dataset", "digits", DigitsConfig),
    ("task", "classification", ClassificationTaskConfig),
]
