"""``mlperf.log``: one MLPerf training log per run of an MLPerf benchmark (:func:`writes_log`), written with
the ``mlperf-logging`` package, that the package's compliance checker accepts and whose ``run_start`` ->
``run_stop`` is the run's time to target.

What a run logs (rank 0; keys as in ``mlperf_logging.mllog.constants``):

* once, before training: ``init_start``, ``cache_clear``, ``submission_*``, the run's hyperparameters
  (``global_batch_size``, ``gradient_accumulation_steps``, ``opt_*``, ...), ``train_samples``,
  ``eval_samples``, ``init_stop``, then ``run_start``;
* per epoch: ``epoch_start`` / ``epoch_stop`` (``epoch_num`` counts from 1, ``samples_count``; a step budget
  that ends mid-epoch leaves its last epoch without ``epoch_stop``); per stretch of training between two
  evaluations: ``block_start`` / ``block_stop`` (``step_num``, ``samples_count``: evaluations every N steps
  fall inside epochs); per evaluation: ``eval_start``, ``eval_accuracy`` (every target metric: one value,
  or MLPerf's dict such as Mask R-CNN's ``{"BBOX": .., "SEGM": ..}``), ``eval_stop``;
* ``run_stop`` exactly once: status ``success`` right after the first evaluation that meets every target
  (later evaluations go to ``eval.jsonl`` and TensorBoard only), or ``aborted`` when the run ends without
  meeting them (or diverges). A run without targets stops with ``success`` when it ends. A preempted run
  logs no ``run_stop``: it is not over.

Timestamps are the run's clock: ``run_start`` is the moment the training loop starts, and every later event is
stamped ``run_start + wall_time_s`` (the wall clock of :class:`kfac_bench.train.state.TrainState`), so the
checker's and the result summariser's ``run_stop - run_start`` is ``summary.json``'s ``time_to_target_s``
exactly. Across a preemption the log stays one run: the checkpoint records the log's length and the clock's
origin; the resumed process cuts the log back to that length (dropping whatever the lost work logged after
the checkpoint), logs no second ``init_*``/``run_start``, and keeps stamping from the same origin. The time
the job spent preempted or queued is therefore not counted (as in ``summary.json``); the resumed process
marks where it took over with an informational ``kfac_bench_resume`` event carrying the real Unix time.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_bench import safe_files
from kfac_bench.metrics.sinks import json_safe

__all__ = [
    "ACCURACY_KEYS",
    "DIVISION",
    "MLPERF_BENCHMARKS",
    "MLPERF_FILE",
    "RULESET",
    "MLPerfLog",
    "RunFacts",
    "accuracy_value",
    "writes_log",
]

MLPERF_FILE = "mlperf.log"
#: The compliance checker's ruleset the logs follow: the last MLPerf Training round with all three of the
#: papers' benchmarks (ResNet-50, Mask R-CNN, BERT): ``python -m mlperf_logging.compliance_checker
#: --usage training --ruleset 3.1.0 mlperf.log``.
RULESET = "3.1.0"
#: K-FAC is not the reference optimizer, and the paper's baselines keep the paper's hyperparameters (see
#: README "Time to target and MLPerf logs"): every run is an open-division result.
DIVISION = "open"
#: The ``train.benchmark_name`` values that are MLPerf Training benchmarks (its ``submission_benchmark``
#: names, ``mlperf_logging.mllog.constants``) that this project's recipes reproduce: only their runs write
#: ``mlperf.log`` by default, since the compliance checker has no rules for any other name.
MLPERF_BENCHMARKS = ("resnet", "maskrcnn", "bert")
#: ``eval_accuracy``'s value for a benchmark whose MLPerf rules read several metrics (our metric -> MLPerf
#: key; mlperf-logging training_3.1.0/closed_maskrcnn.yaml reads ``v['value']['BBOX']`` and ``['SEGM']``).
ACCURACY_KEYS: dict[str, dict[str, str]] = {"maskrcnn": {"bbox_map": "BBOX", "segm_map": "SEGM"}}
#: Statuses of a finished run that stop the MLPerf run (a preempted or crashed run is not finished).
_STOPPING = {"success": "success", "target_not_reached": "aborted", "diverged": "aborted"}


def writes_log(setting: bool | None, benchmark: str, timed_run: bool = True) -> bool:
    """Whether a run writes ``mlperf.log``: ``train.mlperf_log`` when set, else (auto) exactly for a timed
    run (not ``train.mode=benchmark``) of one of :data:`MLPERF_BENCHMARKS`."""
    if setting is not None:
        return bool(setting)
    return timed_run and benchmark in MLPERF_BENCHMARKS


@dataclass
class RunFacts:
    """What the header of a run's log states, gathered when the run is built.

    Attributes:
        benchmark: ``submission_benchmark`` (``resnet``, ``maskrcnn``, ``bert`` are MLPerf's).
        platform: ``submission_platform``, e.g. ``8xNVIDIA H100``.
        init_start_s: Unix time at which building the run began (``init_start``).
        train_samples / eval_samples: examples in the training set and examples one evaluation scores.
        targets: metric -> target (what ``eval_accuracy`` reports).
        primary: the metric reported when there are no targets.
        hyperparameters: MLPerf key -> value (``global_batch_size``, ``opt_base_learning_rate``, ...).
    """

    benchmark: str
    platform: str = "cpu"
    init_start_s: float = field(default_factory=time.time)
    train_samples: int = 0
    eval_samples: int = 0
    targets: Mapping[str, float] = field(default_factory=dict)
    primary: str = ""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)


def accuracy_value(
    benchmark: str, metrics: Mapping[str, float], targets: Sequence[str], primary: str
) -> Any:
    """``eval_accuracy``'s value: MLPerf's dict for the benchmark (:data:`ACCURACY_KEYS`), else the one
    target metric (or the primary metric without targets), else a dict of every target metric; None if the
    evaluation reported none of them."""
    keys = ACCURACY_KEYS.get(benchmark)
    if keys:
        found = {mlperf: metrics[ours] for ours, mlperf in keys.items() if ours in metrics}
        return found or None
    names = list(targets) or [primary]
    if len(names) == 1:
        return metrics.get(names[0])
    return {n: metrics[n] for n in names if n in metrics} or None


class MLPerfLog:
    """The run's ``mlperf.log`` (see the module docstring); a checkpoint part (``state_dict`` /
    ``load_state_dict``) on every rank, writing only where ``enabled``.

    Args:
        path: the log file.
        facts: the header's contents.
        enabled: False on ranks other than 0 or when the run writes no log (:func:`writes_log`).
    """

    def __init__(self, path: Path, facts: RunFacts, *, enabled: bool = True) -> None:
        self.path, self.facts, self.enabled = Path(path), facts, enabled
        self.anchor_ms: float | None = None  # run_start's time: the run clock's origin
        self.stopped = False
        self.in_block = False
        self._restored_bytes: int | None = None
        self.log: Any = None
        self._handler: logging.Handler | None = None
        if enabled:
            from mlperf_logging.mllog import constants
            from mlperf_logging.mllog.mllog import MLLogger

            self.c = constants
            logger = logging.getLogger(f"kfac_bench.mlperf.{id(self)}")
            logger.propagate = False
            logger.setLevel(logging.INFO)
            self._handler = _NoFollowHandler(self.path)
            logger.addHandler(self._handler)
            self.log = MLLogger(logger=logger, default_stack_offset=2)

    # -- the run clock ---------------------------------------------------------------------------------

    def _ms(self, wall_s: float) -> int:
        assert self.anchor_ms is not None
        return round(self.anchor_ms + 1000.0 * wall_s)

    def _event(
        self, key: str, value: Any = None, wall_s: float | None = None, **metadata: Any
    ) -> None:
        time_ms = self._ms(wall_s) if wall_s is not None else None
        value, metadata = json_safe(value), json_safe(metadata)  # NaN -> null: the lines stay JSON
        self.log.event(key=key, value=value, metadata=metadata or None, time_ms=time_ms)

    # -- start, resume, stop ---------------------------------------------------------------------------

    def begin(
        self,
        wall_s: float,
        resumed: bool,
        step: int = 0,
        samples: int = 0,
        world: Mapping[str, Any] | None = None,
    ) -> None:
        """The run (or a resumed part of it) starts training with ``wall_s`` seconds already on its clock.

        A fresh run (or a resumed one whose checkpoint carries no log) starts a new file: header and
        ``run_start``; a resumed run continues the restored log with a ``kfac_bench_resume`` marker whose
        value holds the step and ``world`` (the world size, platform and accumulation it continues on,
        which may differ from the header's: the global batch does not).
        """
        if not self.enabled:
            return
        if resumed and self._restored_bytes is not None:
            self._flush_truncate(
                self._restored_bytes
            )  # what the lost work logged after the checkpoint
            if not self.stopped:  # after run_stop the MLPerf run is over: nothing more to mark
                unix_ms = int(time.time() * 1e3)
                value = {"step": step, **(world or {})}
                self._event("kfac_bench_resume", value, wall_s, unix_time_ms=unix_ms)
            return
        self._flush_truncate(0)
        self.stopped = self.in_block = False
        now_ms = time.time() * 1e3
        if self.anchor_ms is None:
            self.anchor_ms = now_ms - 1000.0 * wall_s
        self._header(min(now_ms, self.anchor_ms))
        self.log.start(key=self.c.RUN_START, time_ms=self._ms(0.0), metadata={"resumed": resumed})
        self.block(True, step, samples, wall_s)

    def _header(self, init_stop_ms: float) -> None:
        """``init_start`` when building the run began; the run's facts and ``init_stop`` now."""
        f, c, stop = self.facts, self.c, int(init_stop_ms)
        self.log.event(key=c.INIT_START, time_ms=min(int(f.init_start_s * 1e3), stop))
        facts: list[tuple[str, Any]] = [
            (c.CACHE_CLEAR, False),  # no caches are dropped before a run
            (c.SUBMISSION_BENCHMARK, f.benchmark),
            (c.SUBMISSION_ORG, "kfac-bench"),
            (c.SUBMISSION_DIVISION, DIVISION),
            (c.SUBMISSION_STATUS, "research"),
            (c.SUBMISSION_PLATFORM, f.platform),
            *f.hyperparameters.items(),
            (c.TRAIN_SAMPLES, f.train_samples),
            (c.EVAL_SAMPLES, f.eval_samples),
        ]
        for key, value in facts:
            self.log.event(key=key, value=value, time_ms=stop)
        self.log.event(key=c.INIT_STOP, time_ms=stop)

    def run_stop(self, status: str, wall_s: float) -> None:
        """MLPerf's ``run_stop`` (once per run): ``status`` is kfac-bench's (``success`` ...)."""
        if not self.enabled or self.stopped or self.anchor_ms is None:
            return
        self.stopped = True
        self.log.end(
            key=self.c.RUN_STOP,
            time_ms=self._ms(wall_s),
            metadata={self.c.STATUS: _STOPPING.get(status, "aborted"), "kfac_bench_status": status},
        )

    def close(self, status: str | None, wall_s: float) -> None:
        """The process ends: a finished run that has not stopped yet stops now (``aborted`` unless it had
        no targets and ended normally); a preempted or crashed one logs nothing."""
        if status in _STOPPING and not (status == "success" and self.facts.targets):
            self.run_stop(status, wall_s)
        if self._handler is not None:
            self._handler.close()

    # -- epochs and evaluations (nothing after run_stop) ------------------------------------------------

    def _live(self) -> bool:
        return self.enabled and not self.stopped and self.anchor_ms is not None

    def epoch(self, started: bool, epoch_num: int, samples: int, wall_s: float) -> None:
        """``epoch_start`` (``started``) or ``epoch_stop`` of epoch ``epoch_num`` (from 1)."""
        if self._live():
            key = self.c.EPOCH_START if started else self.c.EPOCH_STOP
            self._event(key, None, wall_s, epoch_num=epoch_num, samples_count=samples)

    def block(self, started: bool, step: int, samples: int, wall_s: float) -> None:
        """``block_start`` / ``block_stop``: training from ``step`` on / until ``step``."""
        if self._live() and started != self.in_block:
            key = self.c.BLOCK_START if started else self.c.BLOCK_STOP
            self._event(key, None, wall_s, step_num=step, samples_count=samples)
            self.in_block = started

    def eval_start(self, epoch: float, step: int, samples: int, wall_s: float) -> None:
        """An evaluation starts: the block of training before it stops."""
        if self._live():
            self.block(False, step, samples, wall_s)
            self._event(self.c.EVAL_START, None, wall_s, epoch_num=epoch, samples_count=samples)

    def eval_result(self, record: Mapping[str, Any], target_met: bool, more_training: bool) -> None:
        """``eval_accuracy`` and ``eval_stop`` of one evaluation ``record``; then ``run_stop`` with
        ``success`` when ``target_met`` (the first evaluation that meets every target), or else the next
        block of training if there is ``more_training``."""
        if not self._live():
            return
        f, wall = self.facts, record["wall_time_s"]
        meta = {"epoch_num": record["epoch"], "samples_count": record["samples"]}
        value = accuracy_value(f.benchmark, record["metrics"], list(f.targets), f.primary)
        if value is not None:
            self._event(self.c.EVAL_ACCURACY, value, wall, **meta)
        self._event(self.c.EVAL_STOP, None, wall, **meta)
        if target_met:
            self.run_stop("success", wall)
        elif more_training:
            self.block(True, record["step"], record["samples"], wall)

    # -- checkpoint part ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        size = self.path.stat().st_size if self.enabled and self.path.is_file() else None
        return {
            "bytes": size,
            "anchor_ms": self.anchor_ms,
            "stopped": self.stopped,
            "in_block": self.in_block,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the log as of the checkpoint: :meth:`begin` cuts the file back to its length then (rank
        0), when the resumed run starts training (a finished run started again leaves it whole)."""
        self.anchor_ms, self.stopped = state["anchor_ms"], bool(state["stopped"])
        self.in_block = bool(state["in_block"])
        size = state["bytes"]
        self._restored_bytes = None
        if not self.enabled or size is None or self.anchor_ms is None:
            return
        if not self.path.is_file() or self.path.stat().st_size < size:
            return  # the log is gone or shorter: begin() starts it again on the same clock
        self._restored_bytes = size

    def _flush_truncate(self, size: int) -> None:
        if self._handler is not None:
            self._handler.close()  # reopened (appending) by the next event
        if os.path.lexists(self.path):
            fd = safe_files.open_in_place(self.path, create=False)  # never a planted link's target
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)


class _NoFollowHandler(logging.FileHandler):
    """Appends to the log file, opened at the first event through :func:`safe_files.open_in_place` (a
    planted link is refused, its target never written)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)

    def _open(self) -> Any:
        return os.fdopen(safe_files.open_in_place(self.baseFilename), "a", encoding="utf-8")

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], safe_files.LinkRefused):
            raise  # the run stops with its one line (logging would print a traceback and go on)
        super().handleError(record)
