"""``kfac-bench train``: validate the command line, then run it as a Hydra application.

The command line is composed once up front (:func:`kfac_bench.config.compose.compose_run`) so config
mistakes give one line and exit status 2 before Hydra starts; sweeps (``-m``) are checked value by value.
The Hydra job then either trains in this process (:func:`kfac_bench.train.run.train`) or, with
``launcher=torchrun``, starts the ranks, each of which runs this command again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfac_bench.config import config_dir
from kfac_bench.errors import UserError

__all__ = ["SUMMARY", "check_overrides", "help_text", "main"]

SUMMARY = """\
  train     train a model: kfac-bench train [+recipe=NAME] [group=option] [key=value ...]
            (kfac-bench train --help lists the config groups, options and recipes)"""

_FLAGS_WITH_VALUE = {
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}
_MAX_SWEEP_CHECKS = 32


def help_text() -> str:
    """The config groups with their options, and the recipes."""
    # Composing imports Hydra and the engine: done on use, so `kfac-bench --help` stays instant.
    from kfac_bench.config.compose import compose_run
    from kfac_bench.config.store import recipe_names

    lines = ["usage: kfac-bench train [-m] [+recipe=NAME] [group=option ...] [key=value ...]", ""]
    lines.append("config groups (group=option; the default is marked *):")
    defaults = compose_run([], return_hydra_config=False).keys()
    root = config_dir()
    chosen = _default_choices()
    for group in sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in (root / group).glob("*.yaml"))
        shown = [o + ("*" if chosen.get(group) == o else "") for o in options]
        lines.append(f"  {group:12s} {', '.join(shown)}")
    launchers = sorted(f.stem for f in (root / "hydra" / "launcher").glob("*.yaml"))
    lines.append(
        f"  {'hydra/launcher':12s} basic*, {', '.join(launchers)} (needs 'kfac-bench[slurm]')"
    )
    lines += [
        "",
        f"recipes (+recipe=NAME; default {chosen.get('recipe')}): {', '.join(recipe_names())}",
        "",
    ]
    lines.append(f"top-level keys: {', '.join(str(k) for k in defaults)}")
    lines += [
        "",
        "examples:",
        "  kfac-bench train                                  # the bundled digits job (SGD + K-FAC, CPU)",
        "  kfac-bench train kfac=none train.epochs=5         # first-order baseline, shorter",
        "  kfac-bench train +recipe=digits launcher=torchrun launcher.nproc_per_node=2",
        "  kfac-bench train -m kfac=none,comm_opt            # a sweep (Hydra multirun)",
        "  kfac-bench train --cfg job                        # print the composed config",
        "",
        "Hydra's own options: kfac-bench train --hydra-help",
    ]
    return "\n".join(lines) + "\n"


def _default_choices() -> dict[str, str]:
    from kfac_bench.config.compose import compose_run

    cfg = compose_run([], return_hydra_config=True)
    return {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items()}


def _split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(flags with their values, overrides)."""
    flags, overrides = [], []
    it = iter(args)
    for arg in it:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _FLAGS_WITH_VALUE:
                flags.append(next(it, ""))
        else:
            overrides.append(arg)
    return flags, overrides


def check_overrides(overrides: Sequence[str], multirun: bool) -> None:
    """Compose the config for ``overrides`` (each sweep value in turn when ``multirun``).

    Raises:
        ConfigError: one line naming the problem.
    """
    from kfac_bench.config.compose import compose_run, normalize_overrides

    if not multirun:
        compose_run(overrides, return_hydra_config=True)
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(normalize_overrides(overrides))
    base = [str(o.input_line) if not o.is_sweep_override() else _first(o) for o in parsed]
    compose_run(base, return_hydra_config=True)
    checks = 0
    for i, o in enumerate(parsed):
        if not o.is_sweep_override():
            continue
        for value in list(o.sweep_string_iterator())[1:]:
            if checks >= _MAX_SWEEP_CHECKS:
                return
            variant = list(base)
            variant[i] = f"{o.get_key_element()}={value}"
            compose_run(variant, return_hydra_config=True)
            checks += 1


def _first(override: object) -> str:
    value = next(iter(override.sweep_string_iterator()))  # type: ignore[attr-defined]
    return f"{override.get_key_element()}={value}"  # type: ignore[attr-defined]


def main(args: Sequence[str]) -> int:
    """``kfac-bench train ARGS``; returns the exit status (the worst over a sweep's jobs)."""
    from kfac_bench.config.compose import normalize_overrides

    if "--help" in args or "-h" in args:
        print(help_text(), end="")
        return 0
    flags, overrides = _split(args)
    multirun = "-m" in flags or "--multirun" in flags
    if not any(f in flags for f in ("--hydra-help", "--info", "-i", "--shell-completion", "-sc")):
        check_overrides(overrides, multirun)
    return _run_hydra(normalize_overrides(args))


def _run_hydra(args: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from kfac_bench.config.compose import PRIMARY
    from kfac_bench.config.store import register

    register()
    statuses: list[int] = []

    @hydra.main(config_path=str(config_dir()), config_name=PRIMARY, version_base="1.3")
    def job(cfg: DictConfig) -> None:
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        try:
            statuses.append(_job(cfg, run_dir, list(hc.overrides.task)))
        except UserError as exc:
            print(f"kfac-bench: error: {exc}", file=sys.stderr, flush=True)
            statuses.append(exc.exit_code)

    saved = sys.argv
    sys.argv = ["kfac-bench-train", *args]
    try:
        job()
    finally:
        sys.argv = saved
    return max(statuses, default=0)


def _job(cfg: Any, run_dir: Path, overrides: list[str]) -> int:
    from kfac_bench.train.launch import inside_launched_worker, launch_torchrun

    launcher = cfg.launcher
    if str(launcher.name.value) == "torchrun" and not inside_launched_worker():
        return launch_torchrun(
            overrides,
            run_dir,
            launcher.nproc_per_node,
            launcher.max_restarts,
            launcher.monitor_interval,
        )
    from kfac_bench.train.run import train

    return int(train(cfg, run_dir))
