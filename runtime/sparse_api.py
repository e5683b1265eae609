"""What a worker needs from the sparse tables on the PS, independent of how the shards are reached.

Two implementations keep one contract (``tests/test_sparse_table.py`` runs the same checks on both):

- ``pstrain.runtime.sparse_client.SparseClient``: gRPC ``SparseTables`` calls, one per shard, concurrently.
- ``pstrain.ps_server.sparse_local_client.LocalSparseClient``: in-memory ``SparseShard``s, no network.

Both raise the dense seam's errors (``pstrain.runtime.ps_api``: ``InvalidRequest``, ``StepConflict``,
``Unavailable``, ...), so the trainer's retry policy covers row calls as it covers dense ones.

Per step a worker pulls once, from the shards owning any of its ids (one request each), and
pushes once to every shard (an empty push when none of its rows lives there): a shard counts
one push per worker to complete a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from pstrain.runtime.sparse_rows import owner_of

RowGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(ids int64 [n] unique, gradient sums float32 [n, dim], device counts int32 [n]) of one table."""


@dataclass(frozen=True)
class RowsAck:
    shard_id: int
    version: int
    duplicate: bool
    completed: bool
    skipped: bool = False


class SparseRowsClient(Protocol):
    shards: int

    def pull_rows(self, min_version: int, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows of ``ids`` (unique int64 per table) as of version ``min_version``, waiting for it (a shard one
        step further answers from its pre-update copy, so a redone step sees the same rows; further is stale).

        Returns ``{table: float32 [len(ids), dim]}`` in the order of ``ids``.
        """
        ...

    def push_rows(
        self, worker_id: int, step: int, rows: Mapping[str, RowGrads] | None, device_count: int
    ) -> list[RowsAck]:
        """This worker's row gradients of ``step`` to every shard (``None``: skip the step); blocks for the acks."""
        ...

    def progress(self, worker_id: int) -> list[tuple[int, int]]:
        """Per shard: (its tables' version, the last step ``worker_id`` pushed rows for, -1 if none)."""
        ...

    def close(self, cancel: bool = False) -> None: ...


def split_ids(
    ids: Mapping[str, torch.Tensor], shards: int
) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Per shard: ({table: its ids}, {table: their positions in the caller's tensor}); tables without ids left out."""
    out: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = [({}, {}) for _ in range(shards)]
    for name, table_ids in ids.items():
        owners = owner_of(table_ids, shards)
        for shard in range(shards):
            where = (owners == shard).nonzero().flatten()
            if where.numel():
                out[shard][0][name] = table_ids[where]
                out[shard][1][name] = where
    return out


def split_rows(rows: Mapping[str, RowGrads], shards: int) -> list[dict[str, RowGrads]]:
    """Per shard, each table's (ids, grads, counts) it owns; every shard gets a (possibly empty) mapping."""
    out: list[dict[str, RowGrads]] = [{} for _ in range(shards)]
    for name, (ids, grads, counts) in rows.items():
        owners = owner_of(ids, shards)
        for shard in range(shards):
            where = (owners == shard).nonzero().flatten()
            if where.numel():
                out[shard][name] = (ids[where], grads[where], counts[where])
    return out


def merge_rows(
    ids: Mapping[str, torch.Tensor],
    dims: Mapping[str, int],
    parts: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """Put each shard's rows (``parts``: per shard ({table: rows}, {table: positions})) back in the caller's order."""
    out = {name: torch.empty(int(t.numel()), dims[name], dtype=torch.float32) for name, t in ids.items()}
    for rows, where in parts:
        for name, values in rows.items():
            out[name][where[name]] = values
    return out
