"""Build what a job spec names: the model, the dataset, the loss.

Every process imports the user's code by ``pkg.module:callable`` path, so users train their
own models without touching pstrain; this module is the single place that resolves them.
How the built model maps to the flat parameter vector is ``runtime.layout``'s job.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}


class FactoryError(ValueError):
    """A factory path that does not resolve, or returns the wrong kind of object."""


def import_object(path: str) -> Any:
    """Resolve ``"pkg.module:attr"`` (``attr`` may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"{path!r} is not of the form 'pkg.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def build_model(factory: str, kwargs_json: str, seed: int | None = None) -> torch.nn.Module:
    """Call the model factory; with ``seed`` the initial weights are reproducible."""
    kwargs = json.loads(kwargs_json or "{}")
    if seed is not None:
        torch.manual_seed(seed)
    model = import_object(factory)(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"model factory {factory!r} returned {type(model).__name__}, not torch.nn.Module")
    return model


def build_dataset(factory: str, kwargs_json: str) -> torch.utils.data.Dataset:
    dataset = import_object(factory)(**json.loads(kwargs_json or "{}"))
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise FactoryError(f"data factory {factory!r} must return a map-style Dataset with __len__ and __getitem__")
    return dataset


def resolve_loss(name: str) -> LossFn:
    if name in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[name]
    if ":" not in name:
        raise FactoryError(f"unknown loss {name!r}: use one of {sorted(BUILTIN_LOSSES)} or 'pkg.module:callable'")
    loss = import_object(name)
    if not callable(loss):
        raise FactoryError(f"loss {name!r} is not callable")
    return loss
