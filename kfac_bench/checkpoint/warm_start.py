"""Starting a run from another run's checkpoint, as BERT phase 2 starts from phase 1 (``train.init_from``).

NVIDIA's ``run_pretraining.py --phase2 --init_checkpoint`` and the authors' gpauloski/BERT-PyTorch
``run_pretraining.py`` (``prepare_optimizers``, ``--previous_phase_end_step``) start phase 2 from the phase-1
checkpoint's model, optimizer state and (the authors') K-FAC state, with the step counter set back to 0 and
the phase-2 learning rate, warm-up and length in place of phase 1's. Here that is:

carried over
    * the model's weights (every key, every shape: a checkpoint of another model stops the run);
    * the optimizer's per-parameter state (LAMB's first and second moments, SGD's momentum), with its step
      counter reset (LAMB's bias correction starts again, as NVIDIA's phase 2 does);
    * K-FAC's running factors A and G of every layer that both runs precondition, as the starting point of
      this run's running averages (their decompositions are recomputed at this run's first step).

started afresh
    * step, epoch and sample counters, clocks, the target tracker, the data order (this run's seed);
    * the optimizer's hyperparameters and the LR schedule (this run's ``optimizer`` and ``lr_schedule``);
    * K-FAC's step counter and hyperparameters (this run's ``kfac``), the AMP loss scale.

Phase 1 without K-FAC (a LAMB phase 1 before a K-FAC phase 2, TPDS Table 4a): K-FAC's factors start from the
identity, as in any first K-FAC step. Phase 2 without K-FAC (Table 4b): phase 1's factors are not used.
Layers that only this run preconditions (another ``kfac.skip_layers``) start from the identity; layers that
only phase 1 preconditioned are dropped; the line this module returns says how many were carried.

A run directory that holds its own checkpoint resumes from it instead (the run is already under way). The
BERT phase-2 recipes set ``train.init_from`` to ``model.init_checkpoint`` (the key their commands pass), so
the model builder has loaded the same weights already; loading them again here changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kfac_bench.checkpoint.files import NoGoodCheckpoint
from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.errors import ConfigError, UserError

__all__ = ["locate", "start_from"]

_KEY = "train.init_from"


def locate(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: a run directory, its ``checkpoints/`` folder, or the newest
    checkpoint file in it.

    Raises:
        ConfigError: nothing there (one line naming the path).
    """
    p = Path(path)
    if p.is_dir():
        return p / CHECKPOINT_DIR if (p / CHECKPOINT_DIR).is_dir() else p
    if p.is_file():
        return p.parent
    raise ConfigError(
        f"{_KEY} '{path}' does not exist: give the phase-1 run directory or its checkpoints/last.pt "
        "(the BERT phase-2 recipes take it as model.init_checkpoint)"
    )


def start_from(
    path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer, precond: Any
) -> str:
    """Load the model, the optimizer's per-parameter state and K-FAC's factors of the checkpoint at ``path``
    into this run's freshly built parts (see the module docstring); every rank calls it.

    Returns:
        One line saying what was carried over.

    Raises:
        ConfigError: ``path`` holds no checkpoint, or a checkpoint of another kind (not a kfac-bench training
            checkpoint, another model, another optimizer, another parameter grouping): one line.
    """
    folder = locate(path)
    manager = CheckpointManager(folder, {}, is_main=False)
    if Path(path).is_file() and Path(path).resolve() != manager.last_path.resolve():
        raise ConfigError(
            f"{_KEY} '{path}' is not the newest checkpoint of its run ({manager.last_path}): give the run "
            "directory"
        )
    try:
        saved = manager.read()
    except (
        NoGoodCheckpoint
    ):  # the resume wording ("restore a good copy") does not fit a start point
        raise ConfigError(
            f"{_KEY}: {manager.last_path} is not a readable checkpoint (it fails verification or does not "
            "load): give the phase-1 run's checkpoints/last.pt"
        ) from None
    except UserError:
        raise
    except Exception as err:  # torch.load raises many unrelated types for a file it cannot read
        raise ConfigError(
            f"{_KEY}: {manager.last_path} is not a readable checkpoint ({type(err).__name__})"
        ) from None
    if saved is None:
        raise ConfigError(f"{_KEY}: no checkpoint in '{folder}': give the phase-1 run directory")
    where = f"{_KEY}: {manager.last_path}"
    if not isinstance(saved, dict) or not all(
        k in saved for k in ("model", "optimizer", "train_state")
    ):
        raise ConfigError(
            f"{where} is not a kfac-bench training checkpoint (no model/optimizer/train_state parts); "
            "a weights-only file goes to model.init_checkpoint"
        )
    _load_model(module, saved["model"], where)
    _load_optimizer_state(optimizer, saved["optimizer"], where)
    kfac = _load_factors(precond, saved.get("precond"), where)
    return (
        f"kfac-bench: started from {manager.last_path} (step {saved.get('step')}): model, optimizer state, "
        f"{kfac}; steps, LR schedule and K-FAC step counter start at 0"
    )


def _load_model(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as err:
        problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        first = (problems[0] if problems else str(err).splitlines()[0])[:200]
        raise ConfigError(
            f"{where} holds another model's weights: {first} ({len(problems)} problems)"
        ) from None


def _load_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], where: str
) -> None:
    """Per-parameter state from ``saved`` (an ``optimizer.state_dict()``), with this run's param groups
    (LR, betas, weight decay, ...) and every step counter back at 0."""
    current = optimizer.state_dict()
    groups, saved_groups = current["param_groups"], saved.get("param_groups", [])
    missing = sorted(set(optimizer.defaults) - set(saved_groups[0])) if saved_groups else []
    if missing:
        raise ConfigError(
            f"{where} holds the state of another optimizer (its settings lack {', '.join(missing[:4])}): "
            "start phase 2 with phase 1's optimizer"
        )
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ConfigError(
            f"{where} holds optimizer state for parameter groups of sizes {saved_sizes}, this run has "
            f"{sizes} (another model or optimizer.no_decay_bias_and_norm setting)"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, entry in saved.get("state", {}).items():
        param = params[int(index)]
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ConfigError(
                    f"{where}: optimizer state '{name}' of parameter {index} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}"
                )
        state[int(index)] = {
            k: (torch.zeros_like(v) if torch.is_tensor(v) else 0) if k == "step" else v
            for k, v in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _load_factors(precond: Any, saved: dict[str, Any] | None, where: str) -> str:
    """Phase 1's running factors into this run's preconditioner (step counter 0, no decompositions: they
    are recomputed at the first step); what was done, in words."""
    if precond is None:
        return "no K-FAC (phase 1's factors unused)" if saved else "no K-FAC"
    if saved is None:
        return "K-FAC factors from the identity (phase 1 ran without K-FAC)"
    old = saved.get("layers", {})
    layers: dict[str, dict[str, Any]] = {}
    carried = 0
    for name, layer in precond.layers.items():
        entry = old.get(name) or {}
        a, g = entry.get("a_factor"), entry.get("g_factor")
        for kind, t, dim in (("A", a, layer.a_dim), ("G", g, layer.g_dim)):
            if t is not None and tuple(t.shape) != (dim, dim):
                raise ConfigError(
                    f"{where}: K-FAC factor {kind} of {name} is {tuple(t.shape)}, this run's is "
                    f"({dim}, {dim})"
                )
        layers[name] = {"a_factor": a, "g_factor": g}
        carried += a is not None and g is not None
    precond.load_state_dict({"steps": 0, "layers": layers})
    new = sum(name not in old for name in layers)
    line = f"K-FAC factors of {carried}/{len(layers)} layers"
    if carried < len(layers):
        line += f" (the others from the identity; {new} not among phase 1's K-FAC layers)"
    return line
