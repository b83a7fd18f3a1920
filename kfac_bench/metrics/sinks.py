"""Where a run's measurements go (rank 0 only): a JSON-lines file of evaluations and TensorBoard scalars;
MLPerf's log is :mod:`kfac_bench.metrics.mlperf`.

Sinks do not depend on the loop's order, so they are plain objects the loop calls.

Files in the run directory:
    ``eval.jsonl``: one line per evaluation: step, epoch, samples, wall_time_s, train_time_s, metrics.
        Strict JSON: a non-finite number (a diverged run's metric) is written as ``null`` (:func:`json_safe`).
    ``tb/``: TensorBoard events (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``kfac/<stage>_s``,
    ``eval/<metric>``) and, when the run ends, its HParams: the config and arm as hyperparameters,
    time-to-target and throughput as ``hparams/<measure>`` metrics (TensorBoard's HPARAMS tab then lists
    the runs of a sweep side by side). TensorBoard is a side channel: its folder is checked when the run
    starts (:func:`check_log_dir`: refused there in one line), and a write that fails later is one warning
    line, after which the run goes on without it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from kfac_bench import safe_files
from kfac_bench.errors import UserError

__all__ = [
    "EVAL_FILE",
    "JsonlSink",
    "TensorBoardSink",
    "check_log_dir",
    "json_safe",
    "read_jsonl",
]

EVAL_FILE = "eval.jsonl"


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) inside dicts, lists and tuples replaced by ``None``:
    ``json.dumps`` would write them as ``NaN``/``Infinity``, which is not JSON and which strict parsers
    (``jq``, JavaScript, most non-Python readers) reject."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(value) for value in obj]
    return obj


class JsonlSink:
    """Appends one JSON object per line (the file survives restarts: a resumed run keeps appending, after
    :meth:`truncate_after` dropped what came after its checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(json_safe(record), sort_keys=True, allow_nan=False) + "\n"
        with os.fdopen(safe_files.open_in_place(self.path), "w", encoding="utf-8") as f:
            f.write(line)

    def truncate_after(self, step: int) -> int:
        """Keep only records of steps ``<= step``, one per step (the last written), and no cut-off line;
        a run resumed from the checkpoint at ``step`` then never repeats a step. Returns the records
        dropped."""
        if not self.path.is_file():
            return 0
        lines = self.path.read_bytes().splitlines()
        by_step: dict[int, str] = {}
        for raw in lines:
            try:
                line = raw.decode("utf-8")
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut off by a crash (or not a record: undecodable, absurdly nested)
            at = record.get("step") if isinstance(record, dict) else None
            if isinstance(at, int) and at <= step:
                by_step[at] = line
        kept = [by_step[k] for k in sorted(by_step)]
        if [line.encode("utf-8") for line in kept] != lines:
            safe_files.write_atomic(self.path, "".join(line + "\n" for line in kept))
        return len(lines) - len(kept)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_log_dir(log_dir: Path, setting: str) -> None:
    """``log_dir`` is, or can be made, a folder this process can create files in (checked by creating
    and removing one).

    Raises:
        UserError: one line naming the folder, the problem and ``setting`` (the key that turns it off).
    """
    log_dir = Path(log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=log_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{log_dir} cannot hold TensorBoard's event files ({exc.strerror or exc}): remove or fix "
            f"it, or set {setting}=false"
        ) from None


class TensorBoardSink:
    """Scalars keyed by the global optimizer step. The event file is opened at the first scalar, with the
    purge step :meth:`purge_after` set: TensorBoard then discards the events an earlier process of the run
    logged after the step this one resumed from. Best effort: the first write that fails is one warning
    line, and the sink writes nothing more (:attr:`failed`)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.purge_step: int | None = None
        self.failed = False
        self._writer: Any = None

    def _off(self, exc: Exception) -> None:
        self.failed = True
        print(
            f"kfac-bench: warning: TensorBoard's writer failed in {self.log_dir} "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); it is off for the rest of this "
            "run, which goes on (eval.jsonl, checkpoints and summary.json are written as usual)",
            file=sys.stderr,
            flush=True,
        )

    def purge_after(self, step: int) -> None:
        """Events of steps ``> step`` written before are dropped (``SummaryWriter(purge_step=step + 1)``)."""
        self.purge_step = step + 1

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            safe_files.ensure_dir(self.log_dir)
            # A random suffix: the event file's name (time, host, pid) cannot be planted as a link first.
            self._writer = SummaryWriter(
                log_dir=str(self.log_dir),
                purge_step=self.purge_step,
                filename_suffix=f".{secrets.token_hex(8)}",
            )
        return self._writer

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.failed:
            return
        try:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step)
        except Exception as exc:  # a full or vanished disk, a library error: never the run's end
            self._off(exc)

    def hparams(self, values: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """The run's hyperparameters and end-of-run metrics (``hparams/<name>``), in the run's own event
        file (``SummaryWriter.add_hparams`` would write them to a subfolder, apart from the scalars)."""
        if self.failed:
            return
        try:
            from torch.utils.tensorboard.summary import hparams

            tagged = {f"hparams/{k}": v for k, v in metrics.items()}
            experiment, start, end = hparams(values, tagged)
            writer = self.writer._get_file_writer()
            for event in (experiment, start, end):
                writer.add_summary(event)
        except Exception as exc:
            self._off(exc)
            return
        self.scalars(tagged, step)

    def close(self) -> None:
        if self._writer is not None and not self.failed:
            try:
                self._writer.flush()
                self._writer.close()
            except Exception as exc:
                self._off(exc)
