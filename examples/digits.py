"""Handwritten digits (the 8x8 set scikit-learn ships inside its wheel) with an MLP.

``train_set`` and ``evaluate`` split the 1797 images the same seeded way, so the held-out
accuracy printed by ``pstrain local`` is measured on images training never saw.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _split(seed: int, holdout: float) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * (1 - holdout))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def train_set(seed: int = 0, holdout: float = 0.2) -> TensorDataset:
    return _split(seed, holdout)[0]


def evaluate(model: nn.Module, seed: int = 0, holdout: float = 0.2) -> dict[str, float]:
    x, y = _split(seed, holdout)[1].tensors
    with torch.no_grad():
        logits = model(x)
    return {
        "heldout_accuracy": float((logits.argmax(dim=1) == y).float().mean()),
        "heldout_loss": float(nn.functional.cross_entropy(logits, y)),
        "heldout_samples": float(len(y)),
    }
