"""Where a run's measurements go (rank 0 only): a JSON-lines file of evaluations, TensorBoard scalars and
MLPerf-style events written with the ``mlperf-logging`` package.

Sinks do not depend on the loop's order, so they are plain objects the loop calls.

Files in the run directory:
    ``eval.jsonl``: one line per evaluation: step, epoch, samples, wall_time_s, train_time_s, metrics.
    ``tb/``: TensorBoard events (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``kfac/<stage>_s``,
    ``eval/<metric>``).
    ``mlperf.log``: ``:::MLLOG {...}`` lines (run_start, eval_accuracy, run_stop with status).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["EVAL_FILE", "MLPERF_FILE", "JsonlSink", "MLPerfSink", "TensorBoardSink", "read_jsonl"]

EVAL_FILE = "eval.jsonl"
MLPERF_FILE = "mlperf.log"


class JsonlSink:
    """Appends one JSON object per line (the file survives restarts: a resumed run keeps appending, after
    :meth:`truncate_after` dropped what came after its checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()

    def truncate_after(self, step: int) -> int:
        """Keep only records of steps ``<= step``, one per step (the last written), and no cut-off line;
        a run resumed from the checkpoint at ``step`` then never repeats a step. Returns the records
        dropped."""
        if not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines()
        by_step: dict[int, str] = {}
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut off by a crash
            at = record.get("step") if isinstance(record, dict) else None
            if isinstance(at, int) and at <= step:
                by_step[at] = line
        kept = [by_step[k] for k in sorted(by_step)]
        if kept != lines:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        return len(lines) - len(kept)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TensorBoardSink:
    """Scalars keyed by the global optimizer step. The event file is opened at the first scalar, with the
    purge step :meth:`purge_after` set: TensorBoard then discards the events an earlier process of the run
    logged after the step this one resumed from."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.purge_step: int | None = None
        self._writer: Any = None

    def purge_after(self, step: int) -> None:
        """Events of steps ``> step`` written before are dropped (``SummaryWriter(purge_step=step + 1)``)."""
        self.purge_step = step + 1

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        return self._writer

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


class MLPerfSink:
    """MLPerf events through ``mlperf_logging.mllog`` into the run's ``mlperf.log`` only (not stdout)."""

    def __init__(self, path: Path, benchmark: str) -> None:
        from mlperf_logging.mllog import constants
        from mlperf_logging.mllog.mllog import MLLogger

        self.c = constants
        logger = logging.getLogger(f"kfac_bench.mlperf.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path)
        logger.addHandler(self._handler)
        self.log = MLLogger(logger=logger, default_stack_offset=2)
        self.benchmark = benchmark

    def run_start(self, global_batch_size: int, resumed: bool) -> None:
        self.log.event(key=self.c.SUBMISSION_BENCHMARK, value=self.benchmark)
        self.log.event(key=self.c.GLOBAL_BATCH_SIZE, value=global_batch_size)
        self.log.start(key=self.c.RUN_START, metadata={"resumed": resumed})

    def eval(self, metric: str, value: float, epoch: float, samples: int) -> None:
        self.log.event(
            key=self.c.EVAL_ACCURACY,
            value=value,
            metadata={self.c.EPOCH_NUM: epoch, "metric": metric, "samples_count": samples},
        )

    def run_stop(self, status: str) -> None:
        mlperf_status = self.c.SUCCESS if status == "success" else self.c.ABORTED
        self.log.end(
            key=self.c.RUN_STOP,
            metadata={self.c.STATUS: mlperf_status, "kfac_bench_status": status},
        )

    def close(self) -> None:
        self._handler.close()
