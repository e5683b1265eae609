"""``model.init_checkpoint``'s sparse tables, streamed to the PS shards that own their rows (issue 9).

The dense initial weights reach the shards from the coordinator (``FetchInitialParameters``: the
coordinator loads the checkpoint into its model, each shard streams its range); the tables follow
the same path: each fresh shard streams ``FetchInitialRows``, the checkpoint's rows it owns
(``id % ps_shards``), in blocks of ``ROWS_PER_BLOCK``, and sets them as the rows' initial values.

A checkpoint carries a table in either of the forms the export writes (``table_export.py``):

* in ``model.pt``, as the ``SparseEmbedding``'s ``<path>.weight`` (the whole table, or its first rows);
* past the export's size limit, as ``tables/<name>.pt`` beside ``model.pt`` (its spec and touched rows).

Rows the checkpoint does not carry keep the job's seeded init, and so do rows it carries with
exactly that value (a whole-table ``model.pt`` holds every row, most of them untouched): only rows
that differ are streamed, so a shard holds what training touched, not the whole table.

Memory: the coordinator holds each table once (the tensor ``torch.load`` read, taken from the
layer, which then holds nothing, so the export never writes the initial table back), and one
block per stream on top; a shard adds each block to its rows as it arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pstrain.coordinator.errors import ConfigError
from pstrain.nn import sparse_layers
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.sparse_rows import TableSpec, encode_block, init_rows

ROWS_PER_BLOCK = 65536  # rows per streamed block (16 MiB at dim 64)


@dataclass(frozen=True)
class CheckpointTable:
    """One table's rows in the checkpoint: ``ids`` None means ``rows`` are rows ``0..len(rows)-1``."""

    spec: TableSpec
    rows: torch.Tensor  # float32 [n, dim]
    ids: torch.Tensor | None = None  # int64 [n], ascending

    def owned_blocks(self, shard_id: int, shards: int, rows_per_block: int = ROWS_PER_BLOCK) -> Iterator[pb.RowBlock]:
        """Blocks of the rows shard ``shard_id`` owns that differ from the seeded init."""
        if self.ids is None:
            count = int(self.rows.shape[0])
            owned: torch.Tensor | None = None
        else:
            owned = (torch.remainder(self.ids, shards) == shard_id).nonzero().flatten()
            count = int(owned.numel())
        step = rows_per_block * (shards if self.ids is None else 1)
        for start in range(0, count, step):
            if owned is None:  # the whole table: this shard's ids are shard_id, shard_id + shards, ...
                if start + shard_id >= count:  # the table ends before this shard's first id of the block
                    break
                ids = torch.arange(start + shard_id, min(count, start + step), shards, dtype=torch.int64)
                rows = self.rows[ids]
            else:
                where = owned[start : start + step]
                ids, rows = self.ids[where], self.rows[where]  # type: ignore[index]
            moved = (rows != init_rows(self.spec, ids)).any(dim=1)
            if bool(moved.any()):
                yield encode_block(self.spec.name, ids[moved], rows[moved])


def take_tables(model: nn.Module, checkpoint: str, specs: list[TableSpec]) -> dict[str, CheckpointTable]:
    """The tables ``checkpoint`` carries (model.pt's ``<path>.weight``, else ``tables/<name>.pt`` beside it),
    taken out of ``model``'s layers after ``load_state_dict``; ``ConfigError`` when one does not fit its spec."""
    by_name = {s.name: s for s in specs}
    tables: dict[str, CheckpointTable] = {}
    for _, layer in sparse_layers(model):
        weight, layer.weight = layer.weight, torch.empty(0, layer.embedding_dim)
        spec = by_name.get(layer.table)
        if spec is None or layer.table in tables or weight.shape[0] == 0:
            continue
        tables[layer.table] = CheckpointTable(spec, weight.to(torch.float32))
    directory = Path(checkpoint).parent / "tables"
    for spec in specs:
        path = directory / f"{spec.name}.pt"
        if spec.name in tables or not path.is_file():
            continue
        tables[spec.name] = _table_file(spec, path)
    return tables


def _table_file(spec: TableSpec, path: Path) -> CheckpointTable:
    key = "model.init_checkpoint"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        saved, ids, rows = payload["spec"], payload["ids"], payload["rows"]
    except Exception as exc:  # noqa: BLE001 - unreadable, whatever the cause
        raise ConfigError(f"{key}: cannot load table {spec.name!r} from {path}: {exc}") from exc
    if (saved.get("rows"), saved.get("dim")) != (spec.rows, spec.dim):
        raise ConfigError(
            f"{key}: table {spec.name!r} in {path} is {saved.get('rows')} x {saved.get('dim')}; embeddings."
            f"{spec.name} declares {spec.rows} x {spec.dim}"
        )
    ids = ids.to(torch.int64)
    n = int(ids.numel())
    if tuple(rows.shape) != (n, spec.dim) or (n and (int(ids.min()) < 0 or int(ids.max()) >= spec.rows)):
        raise ConfigError(f"{key}: table {spec.name!r} in {path} has ids or rows that do not fit its spec")
    order = torch.argsort(ids)
    return CheckpointTable(spec, rows.to(torch.float32)[order], ids[order])


def initial_row_blocks(
    tables: dict[str, CheckpointTable], shard_id: int, shards: int, rows_per_block: int = ROWS_PER_BLOCK
) -> Iterator[pb.RowBlock]:
    """Every table's blocks for shard ``shard_id``, table by table in name order."""
    for name in sorted(tables):
        yield from tables[name].owned_blocks(shard_id, shards, rows_per_block)
