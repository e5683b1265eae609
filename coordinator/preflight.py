"""Everything a job file names, built once before any process starts.

``pstrain local`` runs it before it launches anything, the coordinator before it serves, and
``pstrain plan`` before it plans, so a job whose user code cannot work fails within seconds with
exit 2 and one line naming the key (``model.factory: examples.foo:make raised ValueError: ...``)
instead of minutes later in a worker's log. The user's traceback stays chained to the
``ConfigError`` (``__cause__``) for the caller's log. Key by key:

* ``model.factory``, ``model.kwargs``, ``model.init_checkpoint``: build the model (seeded), lay it
  out (float32 parameters, at least one) and load the checkpoint into it;
* ``data.factory``, ``data.kwargs``: build the dataset, which must hold a sample, and read sample 0
  the way a worker batches it: an (input, target) pair of tensors; a numeric ``batch.per_device``
  must not exceed the dataset;
* ``loss``: resolve it (a built-in name, or an importable callable);
* ``eval.factory``, ``eval.kwargs``: import it and check its signature takes ``(model, **kwargs)``.
  It is not called: it runs once, on the trained model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from torch.utils.data import Dataset

from pstrain.coordinator.config import JobConfig
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.model_state import ModelState
from pstrain.runtime.factories import (
    FactoryArgumentsError,
    FactoryError,
    LossFn,
    build_dataset,
    check_arguments,
    check_sample,
    import_callable,
    resolve_loss,
)


@dataclass(frozen=True)
class CheckedJob:
    """What the preflight built; the coordinator plans with it instead of building it again."""

    model: ModelState
    dataset: Dataset
    loss: LossFn


def named(section: str, exc: FactoryError) -> ConfigError:
    """The ``ConfigError`` for a factory's failure: ``<section>.kwargs`` when the arguments are wrong."""
    key = f"{section}.kwargs" if isinstance(exc, FactoryArgumentsError) else f"{section}.factory"
    return ConfigError(f"{key}: {exc}")


def load_dataset(cfg: JobConfig) -> Dataset:
    try:
        dataset = build_dataset(cfg.data.factory, json.dumps(cfg.data.kwargs))
        check_sample(cfg.data.factory, dataset)
    except FactoryError as exc:
        raise named("data", exc) from exc
    size = len(dataset)  # type: ignore[arg-type]
    per_device = cfg.batch.per_device
    if isinstance(per_device, int) and per_device > size:
        raise ConfigError(f"batch.per_device: {per_device} exceeds the dataset's {size} samples")
    return dataset


def load_loss(cfg: JobConfig) -> LossFn:
    try:
        return resolve_loss(cfg.loss)
    except FactoryError as exc:
        raise ConfigError(f"loss: {exc}") from exc


def check_eval(cfg: JobConfig) -> None:
    if not cfg.eval.factory:
        return
    try:
        check_arguments(cfg.eval.factory, import_callable(cfg.eval.factory), None, **cfg.eval.kwargs)
    except FactoryError as exc:
        raise named("eval", exc) from exc


def preflight(cfg: JobConfig) -> CheckedJob:
    """Build and check everything the job file names; the first problem raises ``ConfigError`` naming its key."""
    model = ModelState(cfg)
    dataset = load_dataset(cfg)
    loss = load_loss(cfg)
    check_eval(cfg)
    return CheckedJob(model, dataset, loss)
