"""Numeric checks the worker and the PS shard must apply identically."""

from __future__ import annotations

import torch


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf in ``values``.

    A sum is one cheap pass and is finite exactly when no element is NaN/Inf, unless finite
    values overflow it; only then does the elementwise check run. The worker (before pushing)
    and the shard (on receipt) both call this, so they never disagree about a gradient.
    """
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())
