"""Sparse tables in the exported model (issue 9).

A table is exported whole: the rows the PS shards hold (every row touched in training) over the
initial values of the rows nobody touched (``init_rows``, the same function the shards use).

* Up to ``TABLE_IN_MODEL_LIMIT_BYTES`` (1 GiB) in all, the tables go into ``model.pt`` under each
  ``SparseEmbedding``'s ``<path>.weight``: ``model.load_state_dict(torch.load("model.pt"))`` gives
  a model that evaluates as trained.
* Past it, ``model.pt`` holds the dense model only and each table is written to
  ``tables/<name>.pt`` (its spec and the touched rows only, so it is as small as training made it);
  ``pstrain.nn.load_sparse_tables(model, out_dir / "tables")`` loads them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

import torch
from torch import nn

from pstrain.nn import sparse_layers
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.sparse_rows import TableSpec, init_rows

if TYPE_CHECKING:
    from pstrain.coordinator.config import JobConfig
    from pstrain.coordinator.export import ModelExport

TABLE_IN_MODEL_LIMIT_BYTES = 1 << 30
PullTables = Callable[[list[str], int], dict[str, tuple[torch.Tensor, torch.Tensor]]]
"""(PS addresses in shard order, version) -> {table: (touched ids, their rows)}."""


def _save(payload: dict[str, object], fh: IO[bytes]) -> None:
    torch.save(payload, fh)


def full_table(spec: TableSpec, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The whole table: initial values, overwritten by the rows the shards hold."""
    table = init_rows(spec, torch.arange(spec.rows, dtype=torch.int64))
    table[ids] = rows
    return table


def table_entries(
    model: nn.Module,
    specs: list[TableSpec],
    pulled: dict[str, tuple[torch.Tensor, torch.Tensor]],
    out_dir: Path | None,
    limit_bytes: int = TABLE_IN_MODEL_LIMIT_BYTES,
) -> dict[str, torch.Tensor]:
    """The state_dict entries the tables add to model.pt; past ``limit_bytes`` they go to ``out_dir/tables``."""
    by_name = {s.name: s for s in specs}
    layers = list(sparse_layers(model))
    used = {layer.table for _, layer in layers}  # a table two layers share is one tensor in model.pt
    if sum(by_name[name].rows * by_name[name].row_bytes for name in used) > limit_bytes:
        if out_dir is not None:
            for spec in specs:
                ids, rows = pulled[spec.name]
                payload = {"spec": spec.__dict__.copy(), "ids": ids, "rows": rows}
                atomic_write(out_dir / "tables" / f"{spec.name}.pt", functools.partial(_save, payload))
        return {}
    tables = {name: full_table(by_name[name], *pulled[name]) for name in used}
    return {f"{path}.weight" if path else "weight": tables[layer.table] for path, layer in layers}


def attach_table_export(export: ModelExport, cfg: JobConfig, security: TransportSecurity) -> None:
    """Make ``export`` pull the job's sparse tables from the PS shards (nothing when it has none)."""
    specs = cfg.table_specs()
    if not specs:
        return
    from pstrain.runtime.sparse_client import pull_tables  # gRPC only where a job has tables

    export.table_specs = specs
    export.pull_tables = lambda addresses, version: pull_tables(addresses, specs, version, security)
