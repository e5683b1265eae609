"""The model as the coordinator knows it: its layout, its initial weights, its final export."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from pstrain.coordinator.config import JobConfig
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.initial_tables import CheckpointTable, take_tables
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.factories import FactoryArgumentsError, FactoryError, build_model, describe_exception
from pstrain.runtime.layout import ParamLayout


class ModelState:
    def __init__(self, cfg: JobConfig) -> None:
        try:
            self.model = build_model(cfg.model.factory, json.dumps(cfg.model.kwargs), seed=cfg.job.seed)
            self.layout = ParamLayout.of(self.model)
        except FactoryError as exc:
            key = "model.kwargs" if isinstance(exc, FactoryArgumentsError) else "model.factory"
            raise ConfigError(f"{key}: {exc}") from exc
        self.tables: dict[str, CheckpointTable] = {}  # issue 9: init_checkpoint's sparse tables (initial_tables.py)
        if cfg.model.init_checkpoint:
            self._load_checkpoint(cfg.model.init_checkpoint)
            self.tables = take_tables(self.model, cfg.model.init_checkpoint, cfg.table_specs())
        self.initial = self.layout.flatten(self.model)

    def _load_checkpoint(self, path: str) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except OSError as exc:
            raise ConfigError(f"model.init_checkpoint: cannot load {path}: {exc.strerror or exc}") from exc
        except pickle.UnpicklingError as exc:
            raise ConfigError(
                f"model.init_checkpoint: cannot load {path}: not a state_dict torch.load(weights_only=True) can read"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - not a file torch.load(weights_only=True) reads, whatever it is
            raise ConfigError(f"model.init_checkpoint: cannot load {path}: {describe_exception(exc)}") from exc
        try:
            self.model.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - RuntimeError for other keys or shapes, TypeError for a non-dict
            raise ConfigError(
                f"model.init_checkpoint: {path} does not fit the model: {describe_exception(exc)}"
            ) from exc

    def initial_range(self, start: int, end: int) -> torch.Tensor:
        return self.initial[start:end]

    def state_dict(self, flat: torch.Tensor, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The trained model under its own keys: parameters from ``flat``, buffers as uploaded."""
        if flat.numel() != self.layout.total:
            raise ValueError(f"flat vector has {flat.numel()} elements, the model {self.layout.total}")
        self.layout.unflatten_into(self.model, flat)
        with torch.no_grad():
            own = dict(self.model.named_buffers())
            for name, value in buffers.items():
                if name not in own or own[name].shape != value.shape:
                    raise ValueError(f"uploaded buffer {name!r} does not match the model")
                own[name].copy_(value)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: Path, flat: torch.Tensor, buffers: dict[str, torch.Tensor]) -> None:
        state = self.state_dict(flat, buffers)
        atomic_write(path, lambda fh: torch.save(state, fh))
