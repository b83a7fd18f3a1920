"""What a run records while it trains, on rank 0: evaluations to ``eval.jsonl``, scalars to TensorBoard,
MLPerf-style events, and progress lines (or a bar).

The loop calls :meth:`Recorder.on_step` after every optimizer step and :meth:`Recorder.on_eval` after every
evaluation; neither changes the loop's order (STYLE.md guideline 8: callbacks only for what does not depend
on order). Other ranks get a recorder that writes nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from kfac_bench.metrics import sinks
from kfac_bench.metrics.progress import Progress
from kfac_bench.metrics.tracker import StageTimes, Throughput

__all__ = ["Recorder", "RunProgress"]


class RunProgress(Protocol):
    """Where the run is (``kfac_bench.train.state.TrainState`` has these)."""

    step: int
    epoch: int
    samples: int
    throughput: Throughput


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
    """

    def __init__(
        self,
        run_dir: Path,
        state: RunProgress,
        stages: StageTimes,
        primary: str,
        total_steps: int,
        *,
        enabled: bool = True,
        progress: str = "auto",
        log_every_steps: int = 20,
        tensorboard: bool = True,
        mlperf: bool = True,
        benchmark: str = "kfac_bench",
    ) -> None:
        self.state, self.stages, self.primary = state, stages, primary
        self.total_steps, self.every = total_steps, max(log_every_steps, 1)
        self.enabled = enabled
        self.jsonl = sinks.JsonlSink(Path(run_dir) / sinks.EVAL_FILE) if enabled else None
        self.tb = sinks.TensorBoardSink(Path(run_dir) / "tb") if enabled and tensorboard else None
        self.mlperf = (
            sinks.MLPerfSink(Path(run_dir) / sinks.MLPERF_FILE, benchmark)
            if enabled and mlperf
            else None
        )
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

    def start(self, global_batch: int, resumed: bool) -> None:
        """The run (or a resumed part of it) starts: MLPerf's ``run_start``."""
        self._reset_window()
        self._stages_before = self.stages.totals()
        if self.mlperf is not None:
            self.mlperf.run_start(global_batch, resumed=resumed)

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

    def on_eval(self, record: dict[str, Any]) -> None:
        """After an evaluation: ``record`` holds step, epoch, samples, wall/train seconds and metrics."""
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
        if self.mlperf is not None and self.primary in metrics:
            self.mlperf.eval(
                self.primary, metrics[self.primary], record["epoch"], record["samples"]
            )

    def close(self, status: str | None = None) -> None:
        """Close the display and the sinks; with the run's ``status``, MLPerf's ``run_stop`` first (a run
        that crashed has none)."""
        self.progress.close()
        if self.mlperf is not None:
            if status is not None:
                self.mlperf.run_stop(status)
            self.mlperf.close()
        if self.tb is not None:
            self.tb.close()
