"""``kfac-bench squad-eval DATA_FILE PRED_FILE``: official SQuAD v1.1 exact match and F1 of a prediction file
(a fine-tuning run writes its own as ``RUN_DIR/predictions.json``); the scoring is
:mod:`kfac_bench.tasks.squad_eval`'s."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  squad-eval
            score SQuAD v1.1 predictions like the official evaluate-v1.1.py:
            kfac-bench squad-eval DATA_FILE PRED_FILE   (prints {"exact_match": ..., "f1": ...})"""


def main(args: Sequence[str]) -> int:
    """Print ``{"exact_match": ..., "f1": ...}`` (percent); unanswered questions are listed on stderr."""
    from kfac_bench.tasks.squad_eval import main as squad_eval_main

    return squad_eval_main(args)
