"""Reader for NVIDIA-format BERT pretraining shards (HDF5), sharded across ranks.

A shard is an HDF5 file holding one example per row in six datasets (``n`` rows each):

* ``input_ids``: (n, max_seq_length), written as int32;
* ``input_mask``: (n, max_seq_length), int8, 1 = real token, 0 = padding;
* ``segment_ids``: (n, max_seq_length), int8, 0 = ``[CLS]`` A ``[SEP]``, 1 = B ``[SEP]``;
* ``masked_lm_positions``: (n, max_predictions_per_seq), int32, ascending, 0 = padding;
* ``masked_lm_ids``: (n, max_predictions_per_seq), int32, the original ids at those positions;
* ``next_sentence_labels``: (n,), int8, 1 = B is a random sentence, 0 = B follows A.

Any integer dtype is read. This is the layout written by NVIDIA's ``create_pretraining_data.py`` (and by
:mod:`kfac_bench.data.bert_prepare`). Position 0 holds ``[CLS]``, which is never masked, so a masked
position of 0 marks padding, exactly as NVIDIA's loader reads it.

Items are dicts of int64 tensors that ``transformers.BertForPreTraining`` consumes as keyword arguments:
``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels`` (original id at masked positions,
``-100`` elsewhere) and ``next_sentence_label`` (a scalar); the default collate stacks them into batches.

Standalone, :class:`BertPretrainingDataset` gives each torch.distributed rank its own contiguous block of
examples; :func:`build_bert_pretraining`, the harness builder, leaves the splitting to the loop's samplers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from kfac_bench.data.base import DataSplits
from kfac_bench.errors import DatasetError

#: HDF5 datasets every shard must hold, in NVIDIA's order.
SHARD_FIELDS: tuple[str, ...] = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
#: Label value ignored by ``BertForPreTraining``'s and ``torch.nn.CrossEntropyLoss``'s default.
IGNORE_INDEX = -100
#: Sub-directory of a prepared data directory that holds the held-out (evaluation) shards.
HELDOUT_SUBDIR = "heldout"
#: Name parts of NVIDIA's shards (``bertPrep.py --action create_hdf5_files`` writes
#: ``<dataset>_training_<i>.hdf5`` and ``<dataset>_test_<i>.hdf5`` into one folder; ``run_pretraining.py``
#: trains on the files whose name contains "training").
NVIDIA_TRAINING, NVIDIA_TEST = "training", "test"

_HOW_TO_GET = (
    "Create shards with `kfac-bench prepare-bert --input CORPUS.txt --output-dir DIR` "
    "or point to NVIDIA's BERT hdf5 shards"
)


def list_shards(root: str | os.PathLike[str]) -> list[Path]:
    """Sorted ``*.hdf5`` / ``*.h5`` files directly inside ``root`` (not recursive).

    Raises:
        DatasetError: ``root`` is not a directory or holds no shard files.
    """
    path = Path(root)
    if not path.is_dir():
        raise DatasetError(path, "a directory of BERT pretraining .hdf5 shards", _HOW_TO_GET)
    files = sorted(p for p in path.iterdir() if p.suffix in (".hdf5", ".h5") and p.is_file())
    if not files:
        raise DatasetError(path, "at least one .hdf5 shard file in the directory", _HOW_TO_GET)
    return files


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rank_range(num_examples: int, rank: int, world_size: int, drop_remainder: bool) -> range:
    """The contiguous block of global example indices that ``rank`` reads.

    With ``drop_remainder`` every rank gets exactly ``num_examples // world_size`` examples (the last
    ``num_examples % world_size`` are never read), which keeps DDP ranks in lock-step. Without it the
    blocks partition all examples and differ in length by at most one (used for evaluation, where
    counts are summed across ranks). Contiguous blocks keep each rank on few files.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if drop_remainder:
        per_rank = num_examples // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    return range(rank * num_examples // world_size, (rank + 1) * num_examples // world_size)


class BertPretrainingDataset(Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset over a directory of shards; this rank's block of the concatenated examples.

    Examples are ordered by sorted file name, then by row, and rank ``r`` of ``W`` reads the block
    :func:`rank_range` gives; shuffling is left to the sampler. Files are opened lazily, once per
    process, so the dataset can be used with DataLoader worker processes. Each example is read on its
    own (a random row decompresses one gzip chunk, about a millisecond), so GPU runs want a few loader
    workers per rank.

    Args:
        root: directory holding the ``*.hdf5`` shards.
        shard_by_rank: split the examples across torch.distributed ranks (when initialised). Turn it off
            when a ``DistributedSampler`` already shards the indices.
        drop_remainder: give every rank the same number of examples (see :func:`rank_range`).
        rank: override of the torch.distributed rank (for tests and tools); needs ``world_size``.
        world_size: override of the torch.distributed world size.
        files: the shards to read (default: every shard directly inside ``root``).

    Raises:
        DatasetError: missing directory, no shards, a shard missing a field, or inconsistent shapes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        shard_by_rank: bool = True,
        drop_remainder: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        files: Sequence[Path] | None = None,
    ) -> None:
        self.files = sorted(files) if files is not None else list_shards(root)
        sizes = [self._check_shard(f) for f in self.files]
        self.max_seq_length, self.max_predictions_per_seq = self._common_shapes(sizes)
        counts = np.array([n for n, _, _ in sizes], dtype=np.int64)
        # offsets[i] = global index of the first example of file i; offsets[-1] = total.
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        total = int(self.offsets[-1])
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        if rank is None or world_size is None:
            rank, world_size = _dist_rank_world() if shard_by_rank else (0, 1)
        self.rank, self.world_size = rank, world_size
        self.indices = rank_range(total, rank, world_size, drop_remainder)
        self._handles: dict[int, h5py.File] = {}
        self._pid = -1

    @staticmethod
    def _check_shard(path: Path) -> tuple[int, int, int]:
        try:
            with h5py.File(path, "r") as f:
                missing = [k for k in SHARD_FIELDS if k not in f]
                if missing:
                    raise DatasetError(
                        path,
                        f"HDF5 datasets {', '.join(SHARD_FIELDS)} (missing: {', '.join(missing)})",
                    )
                shapes = {k: f[k].shape for k in SHARD_FIELDS}
        except OSError as err:
            raise DatasetError(path, f"a readable HDF5 file ({err})") from err
        n, seq = shapes["input_ids"][0], shapes["input_ids"][1]
        preds = shapes["masked_lm_positions"][1]
        expected = {
            "input_ids": (n, seq),
            "input_mask": (n, seq),
            "segment_ids": (n, seq),
            "masked_lm_positions": (n, preds),
            "masked_lm_ids": (n, preds),
            "next_sentence_labels": (n,),
        }
        if shapes != expected:
            raise DatasetError(path, f"dataset shapes {expected}, found {shapes}")
        return n, seq, preds

    def _common_shapes(self, sizes: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
        shapes = {(seq, preds) for _, seq, preds in sizes}
        if len(shapes) != 1:
            raise DatasetError(
                self.files[0].parent,
                f"shards of one max_seq_length/max_predictions_per_seq, found {sorted(shapes)}",
            )
        return next(iter(shapes))

    def __len__(self) -> int:
        return len(self.indices)

    def _handle(self, file_index: int) -> h5py.File:
        # h5py handles must not cross a fork: reopen in each DataLoader worker process.
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if file_index not in self._handles:
            self._handles[file_index] = h5py.File(self.files[file_index], "r")
        return self._handles[file_index]

    def locate(self, index: int) -> tuple[Path, int]:
        """The (shard file, row) that local example ``index`` is read from."""
        global_index = self.indices[index]
        file_index = int(np.searchsorted(self.offsets, global_index, side="right")) - 1
        return self.files[file_index], global_index - int(self.offsets[file_index])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        global_index = self.indices[index]  # raises IndexError past the end
        file_index = int(np.searchsorted(self.offsets, global_index, side="right")) - 1
        row = global_index - int(self.offsets[file_index])
        f = self._handle(file_index)
        arrays = {k: np.asarray(f[k][row], dtype=np.int64) for k in SHARD_FIELDS}
        return example_from_arrays(arrays)

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_handles"], state["_pid"] = {}, -1
        return state

    def close(self) -> None:
        """Close the HDF5 files this process opened."""
        for f in self._handles.values():
            f.close()
        self._handles = {}


def example_from_arrays(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """One example's HDF5 rows -> ``BertForPreTraining`` keyword tensors (int64).

    ``labels`` is ``IGNORE_INDEX`` everywhere except at the non-padding ``masked_lm_positions``, where
    it holds ``masked_lm_ids`` (NVIDIA's loader does the same with -1 as its ignore value).
    """
    input_ids = torch.from_numpy(arrays["input_ids"])
    positions = torch.from_numpy(arrays["masked_lm_positions"])
    ids = torch.from_numpy(arrays["masked_lm_ids"])
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    real = positions != 0
    labels[positions[real]] = ids[real]
    return {
        "input_ids": input_ids,
        "attention_mask": torch.from_numpy(arrays["input_mask"]),
        "token_type_ids": torch.from_numpy(arrays["segment_ids"]),
        "labels": labels,
        "next_sentence_label": torch.from_numpy(arrays["next_sentence_labels"]).reshape(()),
    }


def split_shards(
    root: str | os.PathLike[str], heldout_root: str | os.PathLike[str] | None = None
) -> tuple[list[Path], list[Path]]:
    """(training shards, held-out shards) of a data directory, in either layout:

    * NVIDIA's, as its data scripts leave it: ``*_training_N.hdf5`` and ``*_test_N.hdf5`` side by side.
      The files named "training" train (NVIDIA's ``run_pretraining.py`` reads only those); the files named
      "test" are held out.
    * ``kfac-bench prepare-bert``'s: every shard in ``root`` trains; ``root/heldout`` is held out.

    ``heldout_root``, if given, is held out instead (an NVIDIA folder then still trains on its
    "training" files only).

    Raises:
        DatasetError: no shards, a shard in an NVIDIA folder named neither "training" nor "test", or no
            held-out shards.
    """
    files = list_shards(root)
    training = [f for f in files if NVIDIA_TRAINING in f.name]
    nvidia = bool(training)
    if nvidia:
        test = [f for f in files if f not in training and NVIDIA_TEST in f.name]
        other = [f for f in files if f not in training and f not in test]
        if other:
            raise DatasetError(
                other[0],
                f"a shard named like NVIDIA's (*_{NVIDIA_TRAINING}_N.hdf5 or *_{NVIDIA_TEST}_N.hdf5) in a "
                f"folder of NVIDIA shards ({len(other)} other file(s)); move it out",
            )
    else:
        training, test = files, []
    if heldout_root is not None:
        return training, list_shards(heldout_root)
    if nvidia:
        if not test:
            raise DatasetError(
                Path(root),
                f"held-out shards: NVIDIA's *_{NVIDIA_TEST}_N.hdf5 next to the training shards",
                "or give dataset.heldout_root=DIR",
            )
        return training, test
    return training, list_shards(Path(root) / HELDOUT_SUBDIR)


def build_bert_pretraining(
    root: str = "data/bert/phase1", heldout_root: str | None = None
) -> DataSplits:
    """Dataset builder (``dataset._target_``): training and held-out shards of a data directory, NVIDIA's
    folder as its scripts leave it or ``kfac-bench prepare-bert``'s (:func:`split_shards`).

    Both datasets hold all examples (``shard_by_rank=False``): the training loop's samplers split them
    across ranks (a ``DistributedSampler`` for training, a no-padding shard for evaluation), and sharding
    here as well would give each rank only ``1/world_size**2`` of the data.

    Args:
        root: directory with the shards (NVIDIA's ``*_training_N.hdf5`` + ``*_test_N.hdf5``, or the
            training shards of ``kfac-bench prepare-bert --output-dir``).
        heldout_root: directory with the evaluation shards; default NVIDIA's test shards in ``root``, or
            ``root/heldout``.

    Raises:
        DatasetError: either directory missing, without shards, or with malformed shards.
    """
    training, heldout = split_shards(root, heldout_root)
    held = Path(heldout_root) if heldout_root is not None else Path(root)
    return DataSplits(
        train=BertPretrainingDataset(root, shard_by_rank=False, files=training),
        val=BertPretrainingDataset(held, shard_by_rank=False, drop_remainder=False, files=heldout),
    )
