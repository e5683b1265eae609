"""gRPC adapter for a ``SparseShard``: decode row blocks, call the shard, map errors (issue 9).

Registered beside the dense ``ParameterServer`` service on the PS's asyncio server
(``add_sparse_tables``). The shard's calls go to a worker thread: a pull waits for the step's
last push, and the shard's lock may be held by an update.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.ps_server.versions import VersionMarks
from pstrain.runtime.admission import Overloaded
from pstrain.runtime.identity import PermissionDenied
from pstrain.runtime.sparse_api import RowGrads
from pstrain.runtime.sparse_rows import RowError, decode_block, encode_block
from pstrain.runtime.transport import MAX_MESSAGE_BYTES, abort_on_errors

translate = abort_on_errors(
    {
        InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        RowError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownWorker: grpc.StatusCode.NOT_FOUND,
        StepConflict: grpc.StatusCode.FAILED_PRECONDITION,
        NotReady: grpc.StatusCode.UNAVAILABLE,
        WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
        Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

ROWS_PER_BLOCK = 65536  # ReadTable streams a table in blocks of this many rows (16 MiB at dim 64)
REPLY_ROW_BYTES = MAX_MESSAGE_BYTES - (1 << 20)  # the rows one reply may carry; the rest of the message fits in 1 MiB


class SparseTablesServicer:
    """Checks callers with the dense servicer's ``gate`` (``pstrain-ps`` shares one): a row push only
    with the pushing worker's credential, pulls and reads with a member's and within the pull limits."""

    def __init__(self) -> None:
        self._shard: SparseShard | None = None
        self._marks: VersionMarks | None = None
        self.gate = ShardGate()  # binds no identities until pstrain-ps installs the job's

    def attach(self, shard: SparseShard) -> None:
        """Called once the shard is built; until then every call is UNAVAILABLE."""
        self._marks = VersionMarks(shard)
        self._shard = shard

    async def _version(self, shard: SparseShard, min_version: int, wait_s: float) -> float:
        """Wait on the event loop until the shard reaches ``min_version``; the time left of ``wait_s``. A waiting row
        pull holds no thread: in one it would hold one of the loop's few default threads, which the pushes that
        complete the step need too (with a few more waiting workers than threads the step stalls)."""
        assert self._marks is not None
        started = time.monotonic()
        await self._marks.get(min_version, wait_s)
        return max(0.0, wait_s - (time.monotonic() - started))

    @property
    def shard(self) -> SparseShard:
        if self._shard is None:
            raise NotReady("this shard's sparse tables are not ready yet; retry shortly")
        return self._shard

    def _dim(self, shard: SparseShard, table: str) -> int:
        if table not in shard.tables:
            raise InvalidArgument(
                f"no sparse table {table!r}; this job has {', '.join(sorted(shard.tables)) or 'none'}"
            )
        return shard.tables[table].spec.dim

    def _check_shard(self, shard: SparseShard, shard_id: int) -> None:
        if shard_id != shard.shard_id:
            raise InvalidArgument(f"request for shard {shard_id} reached shard {shard.shard_id}")

    @translate
    async def PullRows(self, request: pb.PullRowsRequest, context: grpc.aio.ServicerContext) -> pb.PullRowsReply:
        shard = self.shard
        self._check_shard(shard, request.shard_id)
        ids: dict[str, torch.Tensor] = {}
        for block in request.blocks:
            if block.table in ids:
                raise InvalidArgument(f"table {block.table!r} appears twice in one pull")
            ids[block.table] = decode_block(block, self._dim(shard, block.table))[0]
        for name, table_ids in ids.items():  # refused now, not after the wait for the version
            shard.tables[name].check(table_ids, "pull", unique=True)
        reply_bytes = sum(int(t.numel()) * (self._dim(shard, name) * 4 + 8) for name, t in ids.items())  # row + id
        if reply_bytes > REPLY_ROW_BYTES:  # the reply must fit a message: refused before a row is made
            raise InvalidArgument(
                f"a pull of {sum(int(t.numel()) for t in ids.values())} rows makes a {reply_bytes}-byte reply, more "
                f"than a message holds ({REPLY_ROW_BYTES} bytes of rows): pull fewer rows per call"
            )
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:
            left_s = await self._version(shard, request.min_version, wait_s)
            version, rows = await asyncio.to_thread(shard.pull, request.min_version, ids, left_s)
        return pb.PullRowsReply(version=version, blocks=[encode_block(n, ids[n], rows[n]) for n in ids])

    @translate
    async def PushRows(self, request: pb.PushRowsRequest, context: grpc.aio.ServicerContext) -> pb.PushRowsReply:
        self.gate.check_push(context.invocation_metadata(), request.worker_id, request.device_count)
        shard = self.shard
        self._check_shard(shard, request.shard_id)
        rows: dict[str, RowGrads] | None = None
        if request.skip:
            if request.blocks:
                raise InvalidArgument("a push that skips its step carries no rows")
        else:
            rows = {}
            for block in request.blocks:
                if block.table in rows:
                    raise InvalidArgument(f"table {block.table!r} appears twice in one push")
                dim = self._dim(shard, block.table)
                ids, values, counts = decode_block(block, dim)
                n = int(ids.numel())
                if values is None:
                    values = torch.empty(0, dim) if n == 0 else None
                if counts is None and n == 0:
                    counts = torch.empty(0, dtype=torch.int32)
                if values is None or counts is None:
                    raise InvalidArgument(f"table {block.table!r}: a push block carries values and counts for its ids")
                rows[block.table] = (ids, values, counts)
        r = await asyncio.to_thread(shard.push, request.worker_id, request.step, rows, request.device_count)
        if r.completed and self._marks is not None:
            self._marks.moved()  # the pulls waiting for this version
        return pb.PushRowsReply(version=r.version, duplicate=r.duplicate, completed=r.completed, skipped=r.skipped)

    @translate
    async def ReadTable(
        self, request: pb.ReadTableRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RowBlock]:
        shard = self.shard
        self._check_shard(shard, request.shard_id)
        dim = self._dim(shard, request.table)
        if request.rows_per_block < 0:
            raise InvalidArgument(f"rows_per_block must be positive (0: a default), got {request.rows_per_block}")
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:
            left_s = await self._version(shard, request.min_version, wait_s)
            _, state = await asyncio.to_thread(shard.read_table, request.table, request.min_version, left_s)
        per = min(request.rows_per_block or ROWS_PER_BLOCK, max(1, REPLY_ROW_BYTES // (dim * 4 + 8)))  # fits a message
        n = int(state.ids.numel())
        for start in range(0, max(n, 1), per):
            yield encode_block(request.table, state.ids[start : start + per], state.rows[start : start + per])

    @translate
    async def RowsVersion(
        self, request: pb.RowsVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RowsVersionReply:
        if self.gate.keys is not None:
            self.gate.keys.verify(context.invocation_metadata())
        shard = self.shard
        self._check_shard(shard, request.shard_id)
        version, worker_step = shard.progress(request.worker_id)
        return pb.RowsVersionReply(version=version, worker_step=worker_step)


def add_sparse_tables(servicer: SparseTablesServicer, server: grpc.aio.Server) -> None:
    """Register the SparseTables service (for ``start_server``)."""
    pb_grpc.add_SparseTablesServicer_to_server(servicer, server)  # type: ignore[arg-type]
