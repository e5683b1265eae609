"""Sparse embedding tables: the facts every service shares (issue 9, S5).

* ``TableSpec``: one table's options, as the job file declares them and the wire carries them.
* ``owner_of`` / ``owned_by``: which PS shard owns a row. Rows are dealt round-robin by id,
  ``id % shards``: any id range (hot ids are often the small ones) spreads evenly over the shards,
  and a shard needs no table of ranges. This is the one function everyone calls.
* ``init_rows``: a row's initial value is a pure function of (table seed, table name, row id),
  a counter-based hash (splitmix64), so a row created on first touch has the same value
  whichever worker touched it first, in whatever order, on whichever shard count.
* ``encode_block`` / ``decode_block``: tensors as little-endian bytes in a ``pb.RowBlock``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pstrain.protos import pstrain_pb2 as pb

TableInit = Literal["normal", "uniform", "zeros"]
TableOptimizer = Literal["sgd", "adagrad", "adam"]
Averaging = Literal["count", "devices"]
TableLrSchedule = Literal["follow", "constant"]


class RowError(ValueError):
    """Row ids, values or counts that do not fit a table (negative, out of range, wrong dtype or shape)."""


@dataclass(frozen=True)
class TableSpec:
    """One sparse embedding table (``embeddings.<name>`` in the job file)."""

    name: str
    rows: int
    dim: int
    init: TableInit = "normal"
    init_scale: float = 0.01
    seed: int = 0
    optimizer: TableOptimizer = "sgd"
    lr: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    averaging: Averaging = "count"
    lr_schedule: TableLrSchedule = "follow"

    def to_pb(self) -> pb.EmbeddingTableSpec:
        return pb.EmbeddingTableSpec(
            name=self.name,
            rows=self.rows,
            dim=self.dim,
            init=self.init,
            init_scale=self.init_scale,
            seed=self.seed,
            optimizer=self.optimizer,
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            averaging=self.averaging,
            lr_schedule=self.lr_schedule,
        )

    @classmethod
    def from_pb(cls, spec: pb.EmbeddingTableSpec) -> TableSpec:
        return cls(
            spec.name,
            spec.rows,
            spec.dim,
            spec.init,  # type: ignore[arg-type]
            spec.init_scale,
            spec.seed,
            spec.optimizer,  # type: ignore[arg-type]
            spec.lr,
            spec.beta1,
            spec.beta2,
            spec.eps,
            spec.averaging,  # type: ignore[arg-type]
            spec.lr_schedule or "follow",  # type: ignore[arg-type]
        )

    @property
    def row_bytes(self) -> int:
        return self.dim * 4


def owner_of(ids: torch.Tensor, shards: int) -> torch.Tensor:
    """The PS shard owning each row id: ``id % shards``."""
    return torch.remainder(ids, shards)


def owned_by(shard_id: int, shards: int, rows: int) -> int:
    """How many rows of a ``rows``-row table shard ``shard_id`` owns (for memory figures)."""
    return max(0, math.ceil((rows - shard_id) / shards))


def check_ids(ids: torch.Tensor, rows: int, what: str) -> None:
    """Raise ``RowError`` unless ``ids`` is a 1-D int64 tensor of ids in ``[0, rows)``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        kind = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise RowError(f"{what}: row ids must be a 1-D int64 tensor, got {kind}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise RowError(f"{what}: row ids must be in [0, {rows}), got [{int(ids.min())}, {int(ids.max())}]")


# ---------------------------------------------------------------------- initial values

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _table_key(seed: int, name: str) -> np.uint64:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _uniform01(spec: TableSpec, ids: np.ndarray, stream: int) -> np.ndarray:
    """Uniform floats in (0, 1), one per (id, column), from a hash of (seed, table, id, column, stream)."""
    cols = np.arange(spec.dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        counter = ids.astype(np.uint64)[:, None] * np.uint64(2 * spec.dim) + cols[None, :] * np.uint64(2)
        bits = _splitmix64(_splitmix64(counter + np.uint64(stream)) ^ _table_key(spec.seed, spec.name))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def init_rows(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """The initial rows for ``ids`` (float32, ``len(ids) x dim``): a function of (seed, table, id) alone."""
    n = int(ids.numel())
    if spec.init == "zeros" or n == 0:
        return torch.zeros(n, spec.dim, dtype=torch.float32)
    raw = ids.numpy()
    if spec.init == "uniform":
        values = (2.0 * _uniform01(spec, raw, 0) - 1.0) * spec.init_scale
    else:  # normal, by Box-Muller from two independent uniforms
        u1, u2 = _uniform01(spec, raw, 0), _uniform01(spec, raw, 1)
        values = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2) * spec.init_scale
    return torch.from_numpy(values.astype(np.float32))


# ---------------------------------------------------------------------- wire blocks


def encode_block(
    table: str, ids: torch.Tensor, values: torch.Tensor | None = None, counts: torch.Tensor | None = None
) -> pb.RowBlock:
    block = pb.RowBlock(table=table, ids=ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    if values is not None:
        block.values = values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    if counts is not None:
        block.counts = counts.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
    return block


def decode_block(block: pb.RowBlock, dim: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(ids, values or None, counts or None) of a block; ``RowError`` when the byte lengths do not fit."""
    if len(block.ids) % 8:
        raise RowError(f"table {block.table!r}: ids take {len(block.ids)} bytes, not a whole number of int64")
    ids = torch.from_numpy(np.frombuffer(block.ids, dtype="<i8").astype(np.int64))
    n = int(ids.numel())
    values = counts = None
    if block.values:
        if len(block.values) != n * dim * 4:
            raise RowError(
                f"table {block.table!r}: {n} ids of dim {dim} need {n * dim * 4} value bytes, got {len(block.values)}"
            )
        values = torch.from_numpy(np.frombuffer(block.values, dtype="<f4").astype(np.float32)).view(n, dim)
    elif n and block.counts:
        raise RowError(f"table {block.table!r}: a push block carries values for its ids")
    if block.counts:
        if len(block.counts) != n * 4:
            raise RowError(f"table {block.table!r}: {n} ids need {n * 4} count bytes, got {len(block.counts)}")
        counts = torch.from_numpy(np.frombuffer(block.counts, dtype="<i4").astype(np.int32))
    return ids, values, counts
