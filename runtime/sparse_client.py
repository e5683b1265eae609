"""The gRPC ``SparseRowsClient``: one channel per PS shard, one request per shard per call, concurrently.

Rows travel as little-endian bytes in ``pb.RowBlock``s (``runtime.sparse_rows``); status codes
become the ``ps_api`` errors the dense client raises (``runtime.ps_client.ERRORS``), so the
trainer retries and reports row calls as it does dense ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.ps_api import Cancelled, result_of
from pstrain.runtime.ps_client import ERRORS
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.sparse_api import RowGrads, RowsAck, merge_rows, split_ids, split_rows
from pstrain.runtime.sparse_rows import TableSpec, decode_block, encode_block
from pstrain.runtime.transport import open_channel

T = TypeVar("T")


class SparseClient:
    """Thread-safe; ``bytes_sent`` / ``bytes_received`` count row payloads (ids, values, counts) for metrics."""

    def __init__(
        self,
        addresses: list[str],
        tables: list[TableSpec],
        push_timeout_s: float = 120.0,
        pull_timeout_s: float = 600.0,
        security: TransportSecurity = INSECURE,
    ) -> None:
        self.shards = len(addresses)
        self._addresses = list(addresses)
        self._dims = {t.name: t.dim for t in tables}
        self._push_timeout_s = push_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._channels = [open_channel(a, security) for a in addresses]
        self._stubs = [pb_grpc.SparseTablesStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(addresses)), thread_name_prefix="sparse-client")
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def pull_rows(self, min_version: int, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        jobs = [(shard, split) for shard, split in enumerate(split_ids(ids, self.shards)) if split[0]]
        futures = [self._submit(self._pull_one, shard, min_version, split[0]) for shard, split in jobs]
        parts = [(result_of(f), split[1]) for f, (_, split) in zip(futures, jobs, strict=True)]
        return merge_rows(ids, self._dims, parts)

    def push_rows(
        self, worker_id: int, step: int, rows: Mapping[str, RowGrads] | None, device_count: int
    ) -> list[RowsAck]:
        pieces: list[dict[str, RowGrads] | None] = (
            [None] * self.shards if rows is None else list(split_rows(rows, self.shards))
        )
        futures = [
            self._submit(self._push_one, shard, worker_id, step, piece, device_count)
            for shard, piece in enumerate(pieces)
        ]
        return [result_of(f) for f in futures]

    def progress(self, worker_id: int) -> list[tuple[int, int]]:
        futures = [self._submit(self._progress_one, shard, worker_id) for shard in range(self.shards)]
        return [result_of(f) for f in futures]

    def close(self, cancel: bool = False) -> None:
        self._closed.set()
        if cancel:
            for channel in self._channels:
                channel.close()
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        for channel in self._channels:
            channel.close()

    # ------------------------------------------------------------------ one shard

    def _pull_one(self, shard: int, min_version: int, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        request = pb.PullRowsRequest(
            shard_id=shard, min_version=min_version, blocks=[encode_block(n, t) for n, t in ids.items()]
        )
        reply = self._stubs[shard].PullRows(request, timeout=self._pull_timeout_s)
        rows = {}
        for block in reply.blocks:
            got, values, _ = decode_block(block, self._dims[block.table])
            if values is None or not torch.equal(got, ids[block.table]):
                raise ValueError(f"shard {shard} answered a pull of table {block.table!r} with other rows")
            rows[block.table] = values
        self._count(request.ByteSize(), reply.ByteSize())
        return rows

    def _push_one(
        self, shard: int, worker_id: int, step: int, piece: dict[str, RowGrads] | None, device_count: int
    ) -> RowsAck:
        request = pb.PushRowsRequest(
            shard_id=shard, worker_id=worker_id, step=step, device_count=device_count, skip=piece is None
        )
        for name, (ids, grads, counts) in (piece or {}).items():
            request.blocks.append(encode_block(name, ids, grads, counts))
        try:
            reply = self._stubs[shard].PushRows(request, timeout=self._push_timeout_s)
        except grpc.RpcError as exc:
            refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            if not refused or self._progress_one(shard, worker_id)[0] not in (step - 1, step):  # step: since landed
                raise
            # One step ahead of this shard: the step's pull went only to the shards owning this worker's ids, so a
            # shard still missing a peer's rows of the step before (in flight) was never waited for. Wait for it, as
            # a pull would, and push once more.
            self._stubs[shard].PullRows(
                pb.PullRowsRequest(shard_id=shard, min_version=step), timeout=self._pull_timeout_s
            )
            reply = self._stubs[shard].PushRows(request, timeout=self._push_timeout_s)
        self._count(request.ByteSize(), reply.ByteSize())
        return RowsAck(shard, reply.version, reply.duplicate, reply.completed, reply.skipped)

    def _progress_one(self, shard: int, worker_id: int) -> tuple[int, int]:
        request = pb.RowsVersionRequest(shard_id=shard, worker_id=worker_id)
        reply = self._stubs[shard].RowsVersion(request, timeout=self._push_timeout_s)
        return reply.version, reply.worker_step

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _submit(self, fn: Callable[..., T], shard: int, *args: object):  # type: ignore[no-untyped-def]
        if self._closed.is_set():
            raise Cancelled("the sparse-table client is closed")
        try:
            return self._pool.submit(self._translated, fn, shard, *args)
        except RuntimeError as exc:
            raise Cancelled("the sparse-table client is closed") from exc

    def _translated(self, fn: Callable[..., T], shard: int, *args: object) -> T:
        try:
            return fn(shard, *args)
        except grpc.RpcError as exc:
            error = ERRORS.get(exc.code())  # type: ignore[attr-defined]
            if error is None:
                raise
            raise error(f"sparse shard {shard} at {self._addresses[shard]}: {exc.details()}") from exc  # type: ignore[attr-defined]


def read_table(
    address: str,
    shard_id: int,
    table: str,
    dim: int,
    min_version: int,
    timeout_s: float = 600.0,
    security: TransportSecurity = INSECURE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row shard ``shard_id`` holds of ``table`` at ``min_version`` or newer: (ids, rows)."""
    channel = open_channel(address, security)
    try:
        stub = pb_grpc.SparseTablesStub(channel)
        ids, rows = [], []
        request = pb.ReadTableRequest(shard_id=shard_id, table=table, min_version=min_version)
        for block in stub.ReadTable(request, timeout=timeout_s):
            got, values, _ = decode_block(block, dim)
            ids.append(got)
            rows.append(values if values is not None else torch.empty(0, dim))
        return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64), torch.cat(rows) if rows else torch.empty(
            0, dim
        )
    finally:
        channel.close()


def pull_tables(
    addresses: list[str], specs: list[TableSpec], version: int, security: TransportSecurity = INSECURE
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every touched row of every table at ``version`` from all shards: {table: (ids, rows)} (the export)."""
    out = {}
    for spec in specs:
        parts = [read_table(a, k, spec.name, spec.dim, version, security=security) for k, a in enumerate(addresses)]
        out[spec.name] = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return out
