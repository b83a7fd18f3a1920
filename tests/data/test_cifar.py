"""CIFAR-10 reader on generated files in the release format: content, transforms, errors."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kfac_bench.data.cifar import cifar10_split, write_tiny_cifar10
from kfac_bench.errors import DatasetError

# The reference CIFAR script's normalisation constants, typed here independently of the code.
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
STD = torch.tensor([0.2023, 0.1994, 0.2010]).view(3, 1, 1)
BATCHES = "cifar-10-batches-py"


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CIFAR-10 release tree with 100 train images (20 per batch file) and 30 test images."""
    return write_tiny_cifar10(tmp_path_factory.mktemp("cifar"), n_train=100, n_test=30, seed=3)


def read_release(root: Path, names: list[str]) -> tuple[np.ndarray, list[int]]:
    """Independent reader: the recipe on the CIFAR-10 page (pickle with encoding='bytes')."""
    data, labels = [], []
    for name in names:
        with open(root / BATCHES / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data.append(batch[b"data"])
        labels += batch[b"labels"]
    return np.concatenate(data).reshape(-1, 3, 32, 32), labels


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_test_split_is_the_normalised_release_content(cifar_root: Path) -> None:
    ds = cifar10_split(str(cifar_root), train=False)
    raw, labels = read_release(cifar_root, ["test_batch"])
    assert len(ds) == 30
    for i in (0, 7, 29):
        image, label = ds[i]
        assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
        expected = (torch.from_numpy(raw[i]).float() / 255 - MEAN) / STD
        torch.testing.assert_close(image, expected)
        assert label == labels[i]


def test_train_split_reads_all_five_batches_in_order(cifar_root: Path) -> None:
    ds = cifar10_split(cifar_root, train=True, augment=False)
    _, labels = read_release(cifar_root, [f"data_batch_{i}" for i in range(1, 6)])
    assert len(ds) == 100
    assert [ds[i][1] for i in range(len(ds))] == labels
    assert set(labels) <= set(range(10))
    assert ds.classes[0] == "airplane" and len(ds.classes) == 10  # from batches.meta


def test_files_are_readable_by_torchvision(
    cifar_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchvision's reader (latin1 decoding) must accept the fixture too; only its md5 check is
    # bypassed, since the generated files are not the official ones.
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    tv = tv_cifar.CIFAR10(str(cifar_root), train=True, download=False)
    ours = cifar10_split(cifar_root, train=True, augment=False)
    assert tv.targets == ours.targets  # type: ignore[attr-defined]
    assert np.array_equal(tv.data, ours.data.permute(0, 2, 3, 1).numpy())  # type: ignore[attr-defined]
    assert tv.classes == ours.classes  # type: ignore[attr-defined]


def test_train_augmentation_is_a_padded_crop_or_its_mirror(cifar_root: Path) -> None:
    torch.manual_seed(0)
    ds = cifar10_split(cifar_root, train=True, augment=True)
    raw, _ = read_release(cifar_root, ["data_batch_1"])
    normalised = (torch.from_numpy(raw[0]).float() / 255 - MEAN) / STD
    # Zero padding happens before normalisation: the border is (0 - mean) / std.
    border = (-MEAN / STD).expand(3, 40, 40).clone()
    border[:, 4:36, 4:36] = normalised
    crops = [border[:, y : y + 32, x : x + 32] for y in range(9) for x in range(9)]
    candidates = torch.stack(crops + [c.flip(-1) for c in crops])
    outputs = [ds[0][0] for _ in range(12)]
    for out in outputs:
        assert out.shape == (3, 32, 32)
        assert (candidates - out).abs().amax(dim=(1, 2, 3)).min() < 1e-5
    assert any(not torch.equal(outputs[0], o) for o in outputs[1:])


def test_root_may_point_at_the_batches_directory(cifar_root: Path) -> None:
    assert len(cifar10_split(cifar_root / BATCHES, train=False)) == 30


def test_missing_root_names_path_layout_and_source(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as info:
        cifar10_split(missing, train=True)
    message = str(info.value)
    assert str(missing) in message
    assert "cifar-10-batches-py" in message and "data_batch_1" in message
    assert "batches.meta" in message and "test_batch" in message
    assert "cifar-10-python.tar.gz" in message and "synthetic" in message


def test_unset_root_is_a_dataset_error() -> None:
    with pytest.raises(DatasetError, match=r"dataset\.root"):
        cifar10_split(None, train=True)


def test_root_without_batches_directory(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-python").mkdir()  # e.g. extracted to the wrong name
    with pytest.raises(DatasetError) as info:
        cifar10_split(tmp_path, train=False)
    assert str(tmp_path / BATCHES) in str(info.value)


def test_missing_batch_file_is_named(cifar_root: Path, tmp_path: Path) -> None:
    root = copy_tree(cifar_root, tmp_path / "c")
    os.remove(root / BATCHES / "data_batch_4")
    assert len(cifar10_split(root, train=False)) == 30  # the test split is still complete
    with pytest.raises(DatasetError, match="missing data_batch_4"):
        cifar10_split(root, train=True)


def test_garbage_file_is_a_dataset_error_naming_it(cifar_root: Path, tmp_path: Path) -> None:
    root = copy_tree(cifar_root, tmp_path / "c")
    (root / BATCHES / "test_batch").write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(DatasetError) as info:
        cifar10_split(root, train=False)
    assert str(root / BATCHES / "test_batch") in str(info.value)


@pytest.mark.parametrize(
    ("batch", "problem"),
    [
        ({b"labels": [0]}, "found keys"),
        ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, "found data uint8 (2, 1024)"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "found data float32"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "2 images, 1 labels"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "outside"),
    ],
)
def test_malformed_batch_contents(
    cifar_root: Path, tmp_path: Path, batch: dict[bytes, object], problem: str
) -> None:
    root = copy_tree(cifar_root, tmp_path / "c")
    with open(root / BATCHES / "test_batch", "wb") as f:
        pickle.dump(batch, f, protocol=2)
    with pytest.raises(DatasetError) as info:
        cifar10_split(root, train=False)
    assert problem in str(info.value)
    assert "test_batch" in str(info.value)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_pickle_with_foreign_globals_is_refused_without_running(
    cifar_root: Path, tmp_path: Path
) -> None:
    root = copy_tree(cifar_root, tmp_path / "c")
    marker = tmp_path / "code-ran"
    with open(root / BATCHES / "test_batch", "wb") as f:
        pickle.dump({b"data": _Payload(marker), b"labels": []}, f, protocol=2)
    with pytest.raises(DatasetError, match="not allowed"):
        cifar10_split(root, train=False)
    assert not marker.exists()


def test_worker_processes_deliver_the_same_eval_batches(cifar_root: Path) -> None:
    from kfac_bench.data.base import DataSplits
    from kfac_bench.data.loader import build_loaders

    ds = cifar10_split(cifar_root, train=False)
    _, inline, _ = build_loaders(DataSplits(ds, ds), batch_size=8, world_size=1, rank=0, seed=0)
    _, workers, _ = build_loaders(
        DataSplits(ds, ds), batch_size=8, world_size=1, rank=0, seed=0, num_workers=2
    )
    inline, workers = list(inline), list(workers)
    assert len(inline) == len(workers) == 4
    for (xa, ya), (xb, yb) in zip(inline, workers, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_pickles_written_with_numpy_1_module_paths_are_read(
    cifar_root: Path, tmp_path: Path
) -> None:
    # The release was pickled by numpy 1 under Python 2: its array constructor is named
    # numpy.core.multiarray._reconstruct (numpy 2 writes numpy._core). Both must be accepted.
    root = copy_tree(cifar_root, tmp_path / "c")
    path = root / BATCHES / "test_batch"
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in path.read_bytes()
    original = cifar10_split(cifar_root, train=False)
    patched = cifar10_split(root, train=False)
    assert torch.equal(original.data, patched.data)  # type: ignore[attr-defined]
