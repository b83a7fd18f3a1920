"""What a run records while it trains, on rank 0: evaluations to ``eval.jsonl``, scalars to TensorBoard,
MLPerf events (:mod:`kfac_bench.metrics.mlperf`), an experiment tracker's metrics
(:mod:`kfac_bench.metrics.trackers`), and progress lines (or a bar); when it ends, the summary's
time-to-target to TensorBoard's HParams and to the tracker (:meth:`Recorder.finish`).

The loop calls :meth:`Recorder.on_step` after every optimizer step, :meth:`Recorder.on_epoch` when an epoch
starts and ends, and :meth:`Recorder.on_eval_start` / :meth:`Recorder.on_eval` around every evaluation; none
changes the loop's order (CONTRIBUTING.md, convention 3: callbacks only for what does not depend on
order). Other ranks get a recorder that writes nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from kfac_bench.metrics import sinks
from kfac_bench.metrics.mlperf import MLPERF_FILE, MLPerfLog, RunFacts
from kfac_bench.metrics.progress import Progress
from kfac_bench.metrics.timekeeping import Clock, StageTotals, Throughput
from kfac_bench.metrics.trackers import Tracker, hparams, summary_metrics

__all__ = ["Recorder", "RunProgress"]


class RunProgress(Protocol):
    """Where the run is (``kfac_bench.train.state.TrainState`` has these)."""

    step: int
    epoch: int
    samples: int
    throughput: Throughput
    wall: Clock


class Recorder:
    """The run's sinks and progress display.

    Args:
        run_dir: where ``eval.jsonl``, ``tb/`` and ``mlperf.log`` go.
        state: the run's progress, read at every call.
        stages: K-FAC seconds per stage (logged per step to TensorBoard).
        primary: the target metric, shown in progress lines and logged as MLPerf's eval accuracy.
        total_steps: optimizer steps of the whole run (progress bar, ETA, last log line).
        enabled: False on ranks other than 0 (nothing is written).
        progress: ``train.progress`` (``auto``, ``bar``, ``lines``, ``none``).
        log_every_steps: steps between two logged training points.
        tensorboard / mlperf: write those sinks.
        benchmark: MLPerf's ``submission_benchmark``.
        facts: what ``mlperf.log``'s header states (default: only the benchmark and ``primary``).
        tracker: an experiment tracker (``train.tracker``), or None.

    Attributes:
        mlperf: the run's MLPerf log, a checkpoint part on every rank (it restores the log on resume).
    """

    def __init__(
        self,
        run_dir: Path,
        state: RunProgress,
        stages: StageTotals,
        primary: str,
        total_steps: int,
        *,
        enabled: bool = True,
        progress: str = "auto",
        log_every_steps: int = 20,
        tensorboard: bool = True,
        mlperf: bool = True,
        benchmark: str = "kfac_bench",
        facts: RunFacts | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.state, self.stages, self.primary = state, stages, primary
        self.total_steps, self.every = total_steps, max(log_every_steps, 1)
        self.enabled = enabled
        self.jsonl = sinks.JsonlSink(Path(run_dir) / sinks.EVAL_FILE) if enabled else None
        self.tb = sinks.TensorBoardSink(Path(run_dir) / "tb") if enabled and tensorboard else None
        self.mlperf = MLPerfLog(
            Path(run_dir) / MLPERF_FILE,
            facts or RunFacts(benchmark, primary=primary),
            enabled=enabled and mlperf,
        )
        self.tracker = tracker if enabled else None
        self.progress = Progress(progress, total_steps, log_every_steps, enabled=enabled)
        self.last_metric: dict[str, float] = {}
        self._reset_window()
        self._stages_before = stages.totals()

    def _reset_window(self) -> None:
        self._loss, self._n = 0.0, 0
        self._t, self._samples = time.perf_counter(), self.state.samples

    def rewind(self, step: int) -> None:
        """The run continues from the checkpoint at ``step``: evaluations and TensorBoard events that an
        earlier process logged after it are dropped, so no step is recorded twice."""
        if self.jsonl is not None:
            self.jsonl.truncate_after(step)
        if self.tb is not None:
            self.tb.purge_after(step)

    def start(self, global_batch: int, resumed: bool, world: dict[str, Any] | None = None) -> None:
        """The run (or a resumed part of it) starts training: MLPerf's header and ``run_start`` (once per
        run; a resumed run continues the log it restored, marking the resume with ``world``: the world
        size, platform and accumulation it continues on)."""
        self._reset_window()
        self._stages_before = self.stages.totals()
        hyper = self.mlperf.facts.hyperparameters
        if "global_batch_size" not in hyper:
            self.mlperf.facts.hyperparameters = {"global_batch_size": global_batch, **hyper}
        s = self.state
        self.mlperf.begin(s.wall.elapsed, resumed, s.step, s.samples, world=world)

    def on_epoch(self, started: bool) -> None:
        """An epoch starts (``started``) or ends; ``state.epoch`` counts the epochs completed before it."""
        s = self.state
        self.mlperf.epoch(started, s.epoch + 1, s.samples, s.wall.elapsed)

    def on_eval_start(self, epoch: float) -> None:
        """An evaluation starts after ``epoch`` epochs of training."""
        s = self.state
        self.mlperf.eval_start(epoch, s.step, s.samples, s.wall.elapsed)

    def on_step(self, loss: float, lr: float) -> None:
        """After an optimizer step: every ``log_every_steps`` steps (and at the last), the mean loss since
        the last point, the LR, samples/s and per-step K-FAC stage seconds."""
        s = self.state
        self._loss += loss
        self._n += 1
        if s.step % self.every and s.step != self.total_steps:
            return
        now = time.perf_counter()
        rate = (s.samples - self._samples) / max(now - self._t, 1e-9)
        mean_loss = self._loss / self._n
        shown = {"loss": mean_loss, "lr": lr, "samples/s": rate, **self.last_metric}
        step_s = s.throughput.mean_step_time_s
        eta = step_s * (self.total_steps - s.step) if step_s else None
        self.progress.update(s.step, s.epoch, shown, eta)
        if self.tb is not None:
            scalars = {"train/loss": mean_loss, "train/lr": lr, "train/samples_per_s": rate}
            totals = self.stages.totals()
            for k, v in totals.items():
                scalars[f"kfac/{k}_s_per_step"] = (v - self._stages_before.get(k, 0.0)) / self._n
            self._stages_before = totals
            self.tb.scalars(scalars, s.step)
        self._reset_window()

    def on_eval(self, record: dict[str, Any], target_met: bool = False) -> None:
        """After an evaluation: ``record`` holds step, epoch, samples, wall/train seconds and metrics;
        ``target_met``: it is the first evaluation that meets every target (MLPerf's ``run_stop``)."""
        metrics = record["metrics"]
        self.last_metric = {self.primary: metrics[self.primary]} if self.primary in metrics else {}
        if not self.enabled:
            return
        assert self.jsonl is not None
        self.jsonl.write(record)
        self.progress.message(
            f"eval step {record['step']} epoch {record['epoch']:.2f}: "
            + " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            + f" (train {record['train_time_s']:.1f}s, wall {record['wall_time_s']:.1f}s)"
        )
        if self.tb is not None:
            self.tb.scalars({f"eval/{k}": v for k, v in metrics.items()}, record["step"])
        if self.tracker is not None:
            self.tracker.metrics({f"eval/{k}": v for k, v in metrics.items()}, record["step"])
        self.mlperf.eval_result(record, target_met, more_training=record["step"] < self.total_steps)

    def close(self, status: str | None = None) -> None:
        """Close the display and MLPerf's log; a finished run whose targets were not met gets MLPerf's
        ``run_stop`` (aborted) first (a preempted or crashed run has none). A run that ended (``status``
        set) keeps TensorBoard and the tracker open for :meth:`finish`; a crashed one closes them."""
        self.progress.close()
        self.mlperf.close(status, self.state.wall.elapsed)
        if status is None:
            self.finish(None, None)

    def leave(self, status: str) -> None:
        """A finished run started again had nothing to train: close the display, MLPerf's log and the
        sinks without logging anything (the logs hold the run's own end already)."""
        self.progress.close()
        self.mlperf.close(None, self.state.wall.elapsed)
        self.finish(None, status)

    def finish(self, summary: dict[str, Any] | None, status: str | None) -> None:
        """The run's ``summary.json`` is written: its config and arm as TensorBoard HParams with the
        time-to-target and throughput as their metrics (not for a preempted run, whose numbers are not
        final), the same to the tracker; then close both (idempotent)."""
        if self.tb is not None:
            if summary is not None and status != "preempted":
                values = hparams(summary.get("config") or {})
                self.tb.hparams(values, summary_metrics(summary), int(summary.get("steps") or 0))
            self.tb.close()
            self.tb = None
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.finish(summary, status)
