"""The overhead benchmark's reference arm (``--reference PATH``): kfac-pytorch is built with our arm's
hyperparameters, timed with the other arms and reported.

kfac-pytorch is not available here, so a stand-in package in its layout plays it: ``kfac/preconditioner.py``
with a ``KFACPreconditioner`` whose constructor has the real one's keyword-only parameters (no ``**kwargs``:
a name the real constructor lacks fails) and records what it was given.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.kfac_pytorch_reference import Reference, reference_factory
from benchmarks.overhead import main, measure
from benchmarks.training_step import classification

# The constructor's parameters as in kfac-pytorch's kfac/preconditioner.py (KAISA API), defaults included.
_STAND_IN = '''
"""Stand-in for kfac-pytorch's kfac.preconditioner: the real constructor's keywords, recorded."""

import logging

import torch

BUILT = []


class KFACPreconditioner:
    def __init__(
        self,
        model,
        *,
        factor_update_steps=1,
        inv_update_steps=1,
        damping=0.001,
        factor_decay=0.95,
        kl_clip=0.001,
        lr=0.1,
        accumulation_steps=1,
        allreduce_bucket_cap_mb=25.0,
        assignment_strategy="compute",
        colocate_factors=True,
        compute_method="eigen",
        compute_eigenvalue_outer_product=True,
        grad_worker_fraction=1.0,
        symmetry_aware=False,
        grad_scaler=None,
        factor_dtype=None,
        inv_dtype=torch.float32,
        skip_layers=None,
        update_factors_in_hook=True,
        loglevel=logging.DEBUG,
    ):
        self.given = {k: v for k, v in locals().items() if k not in ("self", "model", "__class__")}
        self._layers = {
            m: (n, None)
            for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
        }
        self.steps = 0
        BUILT.append(self)

    def step(self):
        self.steps += 1
'''


def _write_stand_in(
    root: Path, init: str = "import kfac.preconditioner as preconditioner\n"
) -> Path:
    (root / "kfac").mkdir(parents=True)
    (root / "kfac" / "__init__.py").write_text(init)
    (root / "kfac" / "preconditioner.py").write_text(_STAND_IN)
    return root


def _forget_kfac() -> None:
    for name in [m for m in sys.modules if m == "kfac" or m.startswith("kfac.")]:
        del sys.modules[name]


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``sys.path`` and any ``kfac`` modules as they were after the test (the stand-in is forgotten)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "kfac" or m.startswith("kfac.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    _forget_kfac()


@pytest.fixture
def stand_in(tmp_path: Path, isolated: None) -> Path:
    return _write_stand_in(tmp_path / "kfac-pytorch")


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _built() -> list:
    return sys.modules["kfac.preconditioner"].BUILT  # type: ignore[no-any-return]


def test_reference_arm_gets_our_hyperparameters_and_is_timed(stand_in: Path) -> None:
    torch.manual_seed(0)
    w = classification("tiny", _tiny, (8, 3, 8, 8), 5)
    row = measure(
        w,
        factor_steps=1,
        inv_steps=3,
        cycles=2,
        warmup_steps=1,
        reference=reference_factory(str(stand_in)),
    )
    (ref_precond,) = _built()
    # The benchmark's engine arguments (damping 0.003, lr 1e-3), the cadence, our engine's defaults for the
    # rest (decay 0.95, KL clip 0.001, eigen with the eigenvalue outer product, float32 for a float32 model).
    assert ref_precond.given == {
        "factor_update_steps": 1,
        "inv_update_steps": 3,
        "damping": 0.003,
        "factor_decay": 0.95,
        "kl_clip": 0.001,
        "lr": 1e-3,
        "accumulation_steps": 1,
        "allreduce_bucket_cap_mb": 25.0,
        "assignment_strategy": "compute",
        "colocate_factors": True,
        "compute_method": "eigen",
        "compute_eigenvalue_outer_product": True,
        "grad_worker_fraction": 1.0,
        "symmetry_aware": False,
        "grad_scaler": None,
        "factor_dtype": torch.float32,
        "inv_dtype": torch.float32,
        "skip_layers": [],
        "update_factors_in_hook": True,
        "loglevel": 10,
    }
    assert ref_precond.steps == 1 + 2 * 3  # the warm-up step, then every step of both rounds
    ref = row["reference"]
    assert ref["step_s"] > 0
    assert ref["ratio"] == ref["step_s"] / row["sgd_step_s"]
    assert ref["ours_over_reference"] == row["kfac_step_s"] / ref["step_s"]
    assert ref["layers"] == row["layers"] == 2
    assert list(ref["unmatched"]) == [
        "factor_scaling"
    ]  # ours per_example by default, its get_cov is kaisa
    assert ref["in_place_off"] == 0
    for arm in ("sgd", "exact", "reference"):
        assert set(row["phases_s_per_step"][arm]) == {"forward_backward", "precondition", "update"}
        assert row["phases_s_per_step"][arm]["forward_backward"] > 0


def test_mapping_of_non_default_arguments(stand_in: Path) -> None:
    reference = reference_factory(str(stand_in))
    assert isinstance(reference, Reference) and not reference.legacy
    model = _tiny().double()
    scaler = torch.amp.GradScaler("cpu")
    ours = {
        "factor_update_steps": 2,
        "inv_update_steps": 20,
        "damping": 0.01,
        "lr": 0.5,
        "skip_layers": ("classifier", "Linear"),
        "compute_method": "inverse",
        "grad_worker_fraction": "hybrid_opt",
        "factor_scaling": "kaisa",
        "factor_batch_fraction": 0.25,
        "kl_clip": 0.002,
    }
    kwargs, unmatched = reference.arguments(model, ours, scaler)
    built = reference(model, ours, scaler)  # accepted by the real constructor's keywords
    assert {k: built.given[k] for k in kwargs} == kwargs
    assert kwargs["compute_method"] == "inverse"
    assert kwargs["grad_worker_fraction"] == 0.5
    assert (
        kwargs["factor_dtype"] == kwargs["inv_dtype"] == torch.float64
    )  # ours for a float64 model
    assert kwargs["skip_layers"] == ["classifier", "Linear"]
    assert kwargs["grad_scaler"] == scaler.get_scale
    assert (kwargs["factor_update_steps"], kwargs["inv_update_steps"]) == (2, 20)
    assert (kwargs["damping"], kwargs["lr"], kwargs["kl_clip"]) == (0.01, 0.5, 0.002)
    assert set(unmatched) == {"factor_batch_fraction"}  # 'kaisa' is the reference's own scaling
    _, unmatched = reference.arguments(model, {"compute_method": "eigen_lowrank"})
    assert set(unmatched) == {"compute_method", "factor_scaling"}


def test_cli_reports_the_reference_row(
    stand_in: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["--quick", "--rounds", "1", "--variants", "exact", "--reference", str(stand_in)]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["results"]
    ref = row["reference"]
    assert ref["step_s"] > 0 and ref["layers"] == row["layers"]
    assert ref["in_place_off"] == 3  # the digits CNN's three ReLU(inplace=True), off in every arm
    # Built once for the timed arms and once for the op count, alike.
    (ops_row,) = data["ops"]
    assert set(ops_row["arms"]) == {"sgd", "ours", "reference"}
    built = _built()
    assert len(built) == 2
    assert all(b.given["inv_update_steps"] == 2 for b in built)  # --quick's cadence 1/2
    printed = capsys.readouterr().out
    assert "reference (kfac-pytorch)" in printed
    assert "not matched in the reference arm: factor_scaling" in printed
    assert "ref." in printed and "fwd+bwd" in printed


def test_source_tree_without_its_metadata_is_one_line(tmp_path: Path, isolated: None) -> None:
    root = _write_stand_in(
        tmp_path / "kfac-pytorch",
        # as kfac-pytorch's __init__ does, for a distribution that is surely not installed
        init="import importlib.metadata\n__version__ = importlib.metadata.version('kfac-pytorch-absent')\n",
    )
    with pytest.raises(SystemExit, match="pip install --no-deps -e"):
        reference_factory(str(root))


def test_plain_checkout_imports_with_the_version_it_declares(
    tmp_path: Path, isolated: None
) -> None:
    # A git clone of kfac-pytorch is not installed, yet its __init__ reads its installed version.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kfac-pytorch")
    root = _write_stand_in(
        tmp_path / "kfac-pytorch",
        init="import importlib.metadata\n"
        "import kfac.preconditioner as preconditioner\n"
        "__version__ = importlib.metadata.version('kfac-pytorch')\n",
    )
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "kfac_pytorch"\n'
        'version = "9.8.7"\n\n[project.urls]\nversion = "not this one"\n'
    )
    before = list(sys.path)
    reference = reference_factory(str(root))
    assert not reference.legacy
    assert sys.modules["kfac"].__version__ == "9.8.7"
    # Nothing installed: only the tree itself stays on the path, and the metadata is gone with the import.
    assert sys.path == [str(root), *before]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kfac-pytorch")
    built = reference(_tiny(), {"inv_update_steps": 10}, None)
    assert built.given["inv_update_steps"] == 10


def test_checkout_without_a_declared_version_still_imports(tmp_path: Path, isolated: None) -> None:
    root = _write_stand_in(
        tmp_path / "kfac-pytorch",
        init="import importlib.metadata\n"
        "import kfac.preconditioner as preconditioner\n"
        "__version__ = importlib.metadata.version('kfac-pytorch')\n",
    )
    reference_factory(str(root))
    assert sys.modules["kfac"].__version__ == "0+source"


# An SC20-era kfac.KFAC signature (kfac-pytorch's kfac/kfac.py of the diag_blocks era), defaults included.
_LEGACY_STAND_IN = '''
"""Stand-in for SC20-era kfac-pytorch: kfac.KFAC's keywords, recorded."""

BUILT = []


class KFAC:
    def __init__(
        self,
        model,
        lr=0.1,
        factor_decay=0.95,
        damping=0.001,
        kl_clip=0.001,
        fac_update_freq=10,
        kfac_update_freq=100,
        use_eigen_decomp=True,
        batch_averaged=True,
        diag_blocks=1,
        diag_warmup=0,
        distribute_layer_factors=None,
    ):
        self.given = {k: v for k, v in locals().items() if k not in ("self", "model", "__class__")}
        BUILT.append(self)

    def step(self):
        pass
'''


def test_sc20_era_reference_gets_what_it_takes(tmp_path: Path, isolated: None) -> None:
    root = tmp_path / "kfac-sc20"
    (root / "kfac").mkdir(parents=True)
    (root / "kfac" / "__init__.py").write_text(_LEGACY_STAND_IN)
    reference = reference_factory(str(root))
    assert reference.legacy
    ours = {"factor_update_steps": 1, "inv_update_steps": 10, "damping": 0.003, "lr": 1e-3}
    built = reference(_tiny(), {**ours, "skip_layers": ()}, None)
    assert built.given == {
        "lr": 1e-3,
        "factor_decay": 0.95,
        "damping": 0.003,
        "kl_clip": 0.001,
        "fac_update_freq": 1,
        "kfac_update_freq": 10,
        "use_eigen_decomp": True,
        "batch_averaged": True,
        "diag_blocks": 1,
        "diag_warmup": 0,
        "distribute_layer_factors": None,
    }
    _, unmatched = reference.arguments(_tiny(), {**ours, "skip_layers": ("fc",)})
    # ours LPT and K-FAC-expand by default (its round robin, KFC's per-example factors); it takes no skip list
    assert set(unmatched) == {"factor_scaling", "placement", "skip_layers"}
