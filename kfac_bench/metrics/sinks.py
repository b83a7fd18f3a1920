"""Where a run's measurements go (rank 0 only): a JSON-lines file of evaluations and TensorBoard scalars;
MLPerf's log is :mod:`kfac_bench.metrics.mlperf`.

Sinks do not depend on the loop's order, so they are plain objects the loop calls.

Files in the run directory:
    ``eval.jsonl``: one line per evaluation: step, epoch, samples, wall_time_s, train_time_s, metrics.
    ``tb/``: TensorBoard events (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``kfac/<stage>_s``,
    ``eval/<metric>``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["EVAL_FILE", "JsonlSink", "TensorBoardSink", "read_jsonl"]

EVAL_FILE = "eval.jsonl"


class JsonlSink:
    """Appends one JSON object per line (the file survives restarts: a resumed run keeps appending)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TensorBoardSink:
    """Scalars keyed by the global optimizer step."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
