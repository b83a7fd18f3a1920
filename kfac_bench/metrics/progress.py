"""Progress on rank 0: a tqdm bar on a terminal, plain periodic lines otherwise (log files, CI)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Shows step progress with loss, last metric, samples/s and the run's ETA.

    Args:
        kind: ``auto`` (bar if stderr is a TTY), ``bar``, ``lines`` or ``none``.
        total_steps: optimizer steps of the whole run (for the bar and the ETA).
        every: steps between two lines in ``lines`` mode.
        enabled: False on ranks other than 0.
    """

    def __init__(self, kind: str, total_steps: int, every: int, enabled: bool = True) -> None:
        if kind == "auto":
            kind = "bar" if sys.stderr.isatty() else "lines"
        self.kind = kind if enabled else "none"
        self.total = total_steps
        self.every = max(1, every)
        self.bar: Any = None
        if self.kind == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, dynamic_ncols=True, unit="step")

    def update(self, step: int, epoch: int, stats: dict[str, Any], eta_s: float | None) -> None:
        """Report that ``step`` optimizer steps are done; ``stats`` holds loss, lr, samples/s, metric."""
        if self.kind == "bar":
            self.bar.n = step
            self.bar.set_postfix({k: _short(v) for k, v in stats.items()}, refresh=True)
        elif self.kind == "lines" and (step % self.every == 0 or step == self.total):
            fields = " ".join(f"{k} {_short(v)}" for k, v in stats.items())
            print(
                f"epoch {epoch} step {step}/{self.total} {fields} eta {_fmt_s(eta_s)}", flush=True
            )

    def message(self, text: str) -> None:
        """A line that does not break the bar."""
        if self.kind == "bar":
            self.bar.write(text)
        elif self.kind == "lines":
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
