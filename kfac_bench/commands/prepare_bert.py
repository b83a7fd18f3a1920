"""``kfac-bench prepare-bert``: NVIDIA-format BERT pretraining shards (HDF5) from plain text; the work is
:func:`kfac_bench.data.bert_prepare.prepare_shards`'s. argparse's usage errors become one line and exit
status 2, like every other user error."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence

from kfac_bench.errors import ConfigError

__all__ = ["SUMMARY", "main", "parser"]

SUMMARY = """\
  prepare-bert
            BERT pretraining shards (NVIDIA HDF5) from plain text:
            kfac-bench prepare-bert --input FILE ... --output-dir DIR [options] (--help lists them)"""


def parser() -> argparse.ArgumentParser:
    """The command's arguments: the keyword arguments of ``prepare_shards``."""
    from kfac_bench.data.bert_corpus import VOCAB_TRAINERS

    p = argparse.ArgumentParser(
        prog="kfac-bench prepare-bert",
        description="Build NVIDIA-format BERT pretraining shards (HDF5) from plain text: one sentence "
        "per line, documents separated by blank lines. Paper phases: --max-seq-length 128 "
        "--max-predictions-per-seq 20 (phase 1), 512 / 80 (phase 2).",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files")
    p.add_argument("--output-dir", required=True, help="directory for the .hdf5 shards")
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument(
        "--vocab-file", help="existing WordPiece vocab.txt (e.g. bert-large-uncased)"
    )
    vocab.add_argument(
        "--vocab-size",
        type=int,
        default=30522,
        help="make a vocabulary of at most this size from the input, saved as OUTPUT/vocab.txt",
    )
    p.add_argument(
        "--vocab-trainer",
        choices=VOCAB_TRAINERS,
        default="wordpiece",
        help="how --vocab-size builds the vocabulary: tokenizers' WordPiece trainer, or the "
        "deterministic frequency list (whole words + characters)",
    )
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=5, help="passes over the corpus")
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument(
        "--heldout-fraction", type=float, default=0.0, help="of documents -> OUTPUT/heldout"
    )
    p.add_argument("--heldout-shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--cased", action="store_true", help="keep case (default: uncased, lowercase)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in OUTPUT")
    return p


def _parse(args: Sequence[str]) -> argparse.Namespace:
    # argparse reports a bad argument as usage + error on stderr and exits 2; keep only its error line.
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser().parse_args(list(args))
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        message = lines[-1].split(": error: ", 1)[-1] if lines else f"exit status {exc.code}"
        raise ConfigError(f"prepare-bert: {message} (see kfac-bench prepare-bert --help)") from None


def main(args: Sequence[str]) -> int:
    """``kfac-bench prepare-bert ARGS``: writes the shards and prints the files written."""
    try:
        ns = _parse(args)
    except SystemExit:  # --help was printed
        return 0
    from kfac_bench.data.bert_prepare import is_own_output, prepare_shards
    from kfac_bench.safe_files import output_folder

    # The one output-folder rule (new or empty), checked before the corpus is read; --overwrite lets the
    # folder hold an earlier preparation, which is replaced.
    output_folder(
        ns.output_dir,
        f"--output-dir {ns.output_dir}",
        "the shards",
        replaceable=is_own_output if ns.overwrite else None,
        fix="pass --overwrite to replace an earlier preparation (shards, heldout/, vocab.txt), or name "
        "a new or empty folder"
        if not ns.overwrite
        else "name a new or empty folder",
    ).close()

    result = prepare_shards(
        ns.input,
        ns.output_dir,
        vocab_file=ns.vocab_file,
        vocab_size=ns.vocab_size,
        max_seq_length=ns.max_seq_length,
        max_predictions_per_seq=ns.max_predictions_per_seq,
        masked_lm_prob=ns.masked_lm_prob,
        short_seq_prob=ns.short_seq_prob,
        dupe_factor=ns.dupe_factor,
        num_shards=ns.num_shards,
        seed=ns.seed,
        heldout_fraction=ns.heldout_fraction,
        heldout_shards=ns.heldout_shards,
        lowercase=not ns.cased,
        vocab_trainer=ns.vocab_trainer,
        overwrite=ns.overwrite,
    )
    print(
        f"wrote {result.num_examples} training examples "
        f"(max_seq_length={ns.max_seq_length}, "
        f"max_predictions_per_seq={ns.max_predictions_per_seq}) to {len(result.shards)} shards:"
    )
    for path in result.shards:
        print(f"  {path}")
    if result.heldout_shards:
        print(f"wrote {result.num_heldout_examples} held-out examples:")
        for path in result.heldout_shards:
            print(f"  {path}")
    print(f"vocabulary: {result.vocab_file} ({result.vocab_size} tokens; model vocab_size >= this)")
    return 0
