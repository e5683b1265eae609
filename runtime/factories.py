"""Build what a job spec names: the model, the dataset, the loss.

Every process imports the user's code by ``pkg.module:callable`` path, so users train their
own models without touching pstrain; this module is the single place that resolves them.
How the built model maps to the flat parameter vector is ``runtime.layout``'s job.

Whatever goes wrong in the user's code comes back as a ``FactoryError`` whose message is one
line (``tests.helpers:make raised ValueError: ...``) with the original exception chained as
its cause, so a caller prints the line and logs the traceback. Callers add the job-file key
(``model.factory``); ``FactoryArgumentsError`` tells them the key is the ``kwargs`` beside it.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}


class FactoryError(ValueError):
    """A factory path that does not resolve, raises, or returns the wrong kind of object."""


class FactoryArgumentsError(FactoryError):
    """The factory's signature does not take the kwargs the job gives it."""


def describe_exception(exc: BaseException, limit: int = 300) -> str:
    """``ValueError: the message``, on one line and cut at ``limit``: what a one-line error shows of an exception."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def import_object(path: str) -> Any:
    """Resolve ``"pkg.module:attr"`` (``attr`` may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"{path!r} is not of the form 'pkg.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise FactoryError(f"importing module {module_name!r} for {path!r} raised {describe_exception(exc)}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def import_callable(path: str) -> Callable[..., Any]:
    fn = import_object(path)
    if not callable(fn):
        raise FactoryError(f"{path} is a {type(fn).__name__}, not a callable")
    return fn  # type: ignore[no-any-return]


def check_arguments(path: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Raise ``FactoryArgumentsError`` when ``fn(*args, **kwargs)`` would fail for its signature alone."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the call itself will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        takes = ", ".join(signature.parameters)
        given = ", ".join([*("<model>" for _ in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise FactoryArgumentsError(f"{path}({takes}) cannot be called as ({given}): {exc}") from exc


def call_factory(path: str, kwargs: dict[str, Any]) -> Any:
    """Import ``path`` and call it with ``kwargs``; every failure is a one-line ``FactoryError``."""
    fn = import_callable(path)
    check_arguments(path, fn, **kwargs)
    try:
        return fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code: named, chained, and logged by the caller
        raise FactoryError(f"{path} raised {describe_exception(exc)}") from exc


def build_model(factory: str, kwargs_json: str, seed: int | None = None) -> torch.nn.Module:
    """Call the model factory; with ``seed`` the initial weights are reproducible."""
    kwargs = json.loads(kwargs_json or "{}")
    if seed is not None:
        torch.manual_seed(seed)
    model = call_factory(factory, kwargs)
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{factory} returned {type(model).__name__}, not a torch.nn.Module")
    if next(iter(model.parameters()), None) is None:
        raise FactoryError(f"{factory} built a model without parameters: there is nothing to train")
    return model


def build_dataset(factory: str, kwargs_json: str) -> torch.utils.data.Dataset:
    """Call the data factory; the dataset must be map-style and hold at least one sample."""
    dataset = call_factory(factory, json.loads(kwargs_json or "{}"))
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise FactoryError(f"{factory} must return a map-style Dataset with __len__ and __getitem__")
    try:
        size = len(dataset)
    except Exception as exc:  # noqa: BLE001 - the user's __len__
        raise FactoryError(f"len() of the dataset {factory} built raised {describe_exception(exc)}") from exc
    if size == 0:
        raise FactoryError(f"{factory} returned an empty dataset (0 samples)")
    return dataset  # type: ignore[no-any-return]


def check_sample(factory: str, dataset: torch.utils.data.Dataset) -> None:
    """Read sample 0 as a worker would (``default_collate``): it must give an (input, target) pair of tensors."""
    try:
        sample = dataset[0]
    except Exception as exc:  # noqa: BLE001 - the user's __getitem__
        raise FactoryError(f"reading sample 0 of {factory} raised {describe_exception(exc)}") from exc
    what = f"sample 0 of {factory} is {_kind(sample)}, not an (input, target) pair of tensors"
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise FactoryError(what)
    try:
        batch = default_collate([sample])
    except Exception as exc:  # noqa: BLE001 - whatever default_collate cannot batch
        raise FactoryError(f"{what} ({describe_exception(exc)})") from exc
    if not all(isinstance(part, torch.Tensor) for part in batch):
        raise FactoryError(what)


def _kind(value: Any) -> str:
    """``(str, int)`` for a pair, ``dict`` for anything else: what a sample is, for the error."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(type(item).__name__ for item in value) + ")"
    return type(value).__name__


def resolve_loss(name: str) -> LossFn:
    if name in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[name]
    if ":" not in name:
        raise FactoryError(f"unknown loss {name!r}: use one of {sorted(BUILTIN_LOSSES)} or 'pkg.module:callable'")
    return import_callable(name)
