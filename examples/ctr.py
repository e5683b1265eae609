"""A DLRM-style click-through-rate model on a synthetic click log with a planted ground truth (issue 9).

The log: users, items and contexts drawn with Zipf-like popularity (a few ids are hot, most are
rare, as in real logs); a click happens with probability ``sigmoid(truth)`` where the planted
truth is a per-id bias for each feature plus a user-item affinity (dot product of hidden
factors). The Bayes-optimal AUC is therefore well below 1 and a model's held-out AUC says how
much of the planted structure it recovered. ``train_set`` and ``evaluate`` draw from the same
generator and split it the same seeded way, so the AUC is measured on clicks training never saw.

The model: one ``SparseEmbedding`` table per feature (rows live on the PS shards), their
pairwise dot products (DLRM's interaction), and an MLP over embeddings + interactions.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pstrain.nn import SparseEmbedding

TABLES = ("user", "item", "ctx")


class Dlrm(nn.Module):
    def __init__(self, users: int, items: int, contexts: int, dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            [SparseEmbedding(name, rows, dim) for name, rows in zip(TABLES, (users, items, contexts), strict=True)]
        )
        pairs = len(TABLES) * (len(TABLES) - 1) // 2
        self.mlp = nn.Sequential(nn.Linear(len(TABLES) * dim + pairs, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def sparse_ids(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Column k of the input holds the ids of table k."""
        return {name: inputs[:, k] for k, name in enumerate(TABLES)}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        embedded = [table(inputs[:, k : k + 1]) for k, table in enumerate(self.tables)]  # one id per bag
        stacked = torch.stack(embedded, dim=1)  # (batch, tables, dim)
        dots = stacked @ stacked.transpose(1, 2)
        i, j = torch.triu_indices(len(TABLES), len(TABLES), offset=1)
        return self.mlp(torch.cat([stacked.flatten(1), dots[:, i, j]], dim=1))


def dlrm(
    users: int = 200_000, items: int = 100_000, contexts: int = 1000, dim: int = 16, hidden: int = 64
) -> nn.Module:
    return Dlrm(users, items, contexts, dim, hidden)


def _zipf(rng: np.random.Generator, rows: int, n: int, exponent: float) -> np.ndarray:
    """``n`` ids in ``[0, rows)`` with Zipf-like popularity; which ids are hot is a seeded permutation."""
    weights = 1.0 / np.arange(1, rows + 1) ** exponent
    ranks = rng.choice(rows, size=n, p=weights / weights.sum())
    return rng.permutation(rows)[ranks]


def click_log(samples: int, users: int, items: int, contexts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [samples, 3] int64, clicks [samples] int64) from the planted truth."""
    ids, clicks, _ = _log(samples, users, items, contexts, seed)
    return ids, clicks


@lru_cache(maxsize=4)
def _log(
    samples: int, users: int, items: int, contexts: int, seed: int, factors: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    user, item = _zipf(rng, users, samples, 1.05), _zipf(rng, items, samples, 1.05)
    ctx = rng.integers(0, contexts, samples)
    user_bias, item_bias = rng.normal(0, 1.0, users), rng.normal(0, 1.0, items)
    ctx_bias = rng.normal(0, 0.5, contexts)
    user_f = rng.normal(0, 1 / np.sqrt(factors), (users, factors))
    item_f = rng.normal(0, 1 / np.sqrt(factors), (items, factors))
    truth = user_bias[user] + item_bias[item] + ctx_bias[ctx] + 2.0 * (user_f[user] * item_f[item]).sum(1) - 0.5
    clicks = rng.random(samples) < 1 / (1 + np.exp(-truth))
    ids = torch.from_numpy(np.stack([user, item, ctx], axis=1).astype(np.int64))
    return ids, torch.from_numpy(clicks.astype(np.int64)), torch.from_numpy(truth)


def _split(samples: int, users: int, items: int, contexts: int, seed: int, holdout: float):  # type: ignore[no-untyped-def]
    ids, clicks = click_log(samples, users, items, contexts, seed)
    cut = int(samples * (1 - holdout))
    return TensorDataset(ids[:cut], clicks[:cut]), TensorDataset(ids[cut:], clicks[cut:])


def train_set(
    samples: int = 200_000,
    users: int = 200_000,
    items: int = 100_000,
    contexts: int = 1000,
    seed: int = 0,
    holdout: float = 0.1,
) -> TensorDataset:
    return _split(samples, users, items, contexts, seed, holdout)[0]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum formula (ties get their average rank)."""
    order = scores.argsort()
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    sorted_scores = scores[order]
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    average = ends - (counts.to(torch.float64) - 1) / 2
    ranks[order] = average[inverse]
    positives = labels.bool()
    p, n = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - p * (p + 1) / 2) / (p * n))


def evaluate(
    model: nn.Module,
    samples: int = 200_000,
    users: int = 200_000,
    items: int = 100_000,
    contexts: int = 1000,
    seed: int = 0,
    holdout: float = 0.1,
) -> dict[str, float]:
    ids, clicks = _split(samples, users, items, contexts, seed, holdout)[1].tensors
    logits = model(ids)
    score = logits[:, 1] - logits[:, 0]
    return {
        "heldout_auc": auc(score, clicks),
        "heldout_loss": float(nn.functional.cross_entropy(logits, clicks)),
        "heldout_click_rate": float(clicks.float().mean()),
        "heldout_samples": float(len(clicks)),
    }


def bayes_auc(
    samples: int = 200_000,
    users: int = 200_000,
    items: int = 100_000,
    contexts: int = 1000,
    seed: int = 0,
    holdout: float = 0.1,
) -> float:
    """The held-out AUC of the planted truth itself: the ceiling any model can reach."""
    ids, clicks, truth = _log(samples, users, items, contexts, seed)
    cut = int(samples * (1 - holdout))
    return auc(truth[cut:], clicks[cut:])
