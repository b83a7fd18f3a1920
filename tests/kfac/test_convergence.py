"""K-FAC needs fewer epochs than SGD to reach a fixed accuracy on real data (scikit-learn's digits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from kfac_bench.kfac import KFACPreconditioner

TARGET = 0.93
MAX_EPOCHS = 12


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    perm = torch.from_numpy(np.random.RandomState(0).permutation(len(y)))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def epochs_to_target(seed: int, use_kfac: bool) -> int:
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = digits()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    precond = (
        KFACPreconditioner(model, lr=0.02, damping=0.003, inv_update_steps=10) if use_kfac else None
    )
    g = torch.Generator().manual_seed(seed)  # the same data order for both arms
    for epoch in range(1, MAX_EPOCHS + 1):
        for idx in torch.randperm(len(ytr), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            if precond is not None:
                precond.step()
            opt.step()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        if acc >= TARGET:
            return epoch
    return MAX_EPOCHS + 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kfac_reaches_target_in_fewer_epochs_than_sgd(seed: int) -> None:
    sgd = epochs_to_target(seed, use_kfac=False)
    kfac = epochs_to_target(seed, use_kfac=True)
    assert kfac <= MAX_EPOCHS, "K-FAC never reached the target"
    assert kfac < sgd, f"seed {seed}: K-FAC took {kfac} epochs, SGD {sgd}"
