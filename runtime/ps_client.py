"""The gRPC ``ParameterServerClient`` (see ``ps_api``), shaped like ps-lite's KVWorker.

``push`` slices a flat vector by the shard map and streams every slice to its shard at
once, returning a handle to wait on; ``pull`` waits for a version and streams every shard's
range straight into the caller's buffer. Used by workers and by the coordinator's export.
Push and Pull use the data plane's byte-level serializers (``protos.codec``): a push's
payload is copied once, out of the caller's vector into each message, and a pull's once, out
of each received message into the caller's buffer.

Colocated (issue 12): a client whose shard listens on this host asks it, with the first push
for a worker, for a pair of shared-memory regions (``runtime.shm_region``) and uses them if it can
map both and reads back the announced nonce; pushes then send only the header after copying the
piece into the push region, and pulls receive only the header and copy the piece out of the pull
region, each piece's as one unary call (``PushShared``, ``PullShared``; a shard without them,
UNIMPLEMENTED, is streamed to). Anything else (a remote shard, ``shared_memory=False``, a refusal) streams, as before.
A worker with one GPU gives the client a ``pinning``: each push region is page-locked once mapped, ``push_targets``
names the pieces' spans there, the GPU copies each piece into its span, and ``push_pull_pieces(placed=...)`` sends it
from there with no copy at all on the host.

Remote (issue 12): gRPC Python's own copies keep a gRPC stream near 0.4x raw TCP, so a client
moves payloads on bulk sockets (``runtime.bulk_client``, ``ps_server.bulk``) where the shard offers
them: the header and the reply on gRPC, one unary call per push or pull (``PushBulk``, ``PullBulk``), the raw
bytes written from the caller's vector and read into the caller's buffer by the kernel, no user-space copy.
``bulk=False`` (``transport.bulk_sockets: off``), a TLS channel or a shard that refuses streams over gRPC; a shard
whose bulk port cannot be reached is streamed to for a back-off, then tried again (``runtime.bulk_client``); a bulk
call the shard aborts (ABORTED) is streamed again, and a shard that predates the unary calls (UNIMPLEMENTED) gets
its tickets in the Push and Pull streams (the unary calls are tried again after ``bulk_client.RETRY_AFTER_S``).

Status codes become ``ps_api`` errors here, in one table; a code the table does not name is
raised as the ``grpc.RpcError`` it is. Nothing is retried here: the caller decides (see
``ps_api.with_retries``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import (
    DEFAULT_CHUNK_BYTES,
    CodecError,
    PullPart,
    TensorAssembler,
    decode_pull_reply,
    encode_push_chunks,
    encode_push_header,
    wire_dtype,
)
from pstrain.runtime.bulk_client import RETRY_AFTER_S, BulkClient, ClientSocket
from pstrain.runtime.host_pinning import HostPinning
from pstrain.runtime.ps_api import (
    Cancelled,
    InvalidRequest,
    PsClientError,
    PullHandle,
    PushHandle,
    ShardAck,
    StepConflict,
    Unavailable,
    UnknownWorker,
    WaitTimeout,
    agreed_version,
    check_pieces,
    check_pull_buffer,
    check_push_buffer,
    placed_sources,
    result_of,
    round_push,
)
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.shm_client import MappedPair, SharedMemory
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, full_service_name, open_channel

T = TypeVar("T")
log = logging.getLogger(__name__)

ERRORS: dict[grpc.StatusCode, type[PsClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: UnknownWorker,
    grpc.StatusCode.FAILED_PRECONDITION: StepConflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: WaitTimeout,
    grpc.StatusCode.CANCELLED: Cancelled,
}


_SERVICE = full_service_name("ParameterServer")
PIECE_PULLS = 32  # piece pulls in flight at once (each a blocking RPC in a thread); more wait their turn
# Push-and-pull calls a client thread waits through at once (``push_pull_pieces``); more go without a waiting thread.
PIECE_WAITS = 32


def _as_is(message: bytes) -> bytes:
    """Push requests leave ``_push_one`` already encoded."""
    return message


def _pull_reply(raw: bytes) -> PullPart | CodecError:
    """Parse a reply in gRPC's thread; a malformed one is raised by the reader, not lost in gRPC."""
    try:
        return decode_pull_reply(raw)
    except CodecError as exc:
        return exc


# A shared-memory call the shard refused without changing anything: it replaced or dropped the regions (ABORTED), or
# it predates PushShared/PullShared (UNIMPLEMENTED). The client then streams to that shard.
_SHM_REFUSED = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED)


# One piece's push-and-pull: (piece, its gradient, worker, step, devices, its destination, the ack, the pull).
_PushPull = tuple[ShardRange, torch.Tensor, int, int, int, torch.Tensor, "Future[ShardAck]", "Future[int]"]


def _check_push(flat: torch.Tensor, total: int) -> None:
    """``check_push_buffer``, and host memory, checked before any call starts: a tensor elsewhere (CUDA, ``meta``)
    otherwise failed inside gRPC's request iterator, after the shard had its header, as an UNKNOWN "Exception
    iterating requests!" that names neither the tensor nor its device."""
    check_push_buffer(flat, total)
    _check_on_host(flat, "push")


def _check_pull(out: torch.Tensor, total: int) -> None:
    """``check_pull_buffer``, and host memory: a destination elsewhere failed only once its pull began, so in
    ``push_pull_pieces`` after the gradient had been pushed (a retry of the step would then be a duplicate)."""
    check_pull_buffer(out, total)
    _check_on_host(out, "pull")


def _check_on_host(tensor: torch.Tensor, call: str) -> None:
    if tensor.device.type != "cpu":
        raise InvalidRequest(
            f"{call} needs its buffer in host (CPU) memory, got a tensor on {tensor.device}; "
            "copy it to the host first (tensor.cpu(), or a pinned host buffer)"
        )


def _settle(future: Future[T], error: BaseException) -> None:
    """Fail ``future`` unless it is settled already (a push-and-pull's futures are settled from several threads)."""
    if future.done():
        return
    with contextlib.suppress(InvalidStateError):  # settled meanwhile
        future.set_exception(error)


def _outcome_error(task: Future[Any]) -> BaseException | None:
    if task.cancelled():
        return Cancelled("the parameter-server client was closed before this call started")
    return task.exception()


def _fail_with(futures: list[Future[Any]], task: Future[Any]) -> None:
    """``task`` (which settles ``futures`` itself, or has a callback do it) ended: if it failed, so do they."""
    error = _outcome_error(task)
    if error is not None:
        for future in futures:
            _settle(future, error)


def _settle_with(into: Future[T], task: Future[T]) -> None:
    """``into`` gets ``task``'s outcome: its result, its error, or ``Cancelled``."""
    error = _outcome_error(task)
    if error is not None:
        _settle(into, error)
        return
    with contextlib.suppress(InvalidStateError):
        into.set_result(task.result())


def _aborted(exc: BaseException) -> bool:
    """The shard refused or dropped a bulk socket (StaleBulk), or predates PushBulk/PullBulk (UNIMPLEMENTED): the
    call changed nothing and may be streamed."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED)


class _ShardStub:
    """Push and Pull of one shard's channel, with the data plane's serializers."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Push = channel.stream_unary(
            f"/{_SERVICE}/Push", request_serializer=_as_is, response_deserializer=pb.PushReply.FromString
        )
        self.Pull = channel.unary_stream(
            f"/{_SERVICE}/Pull", request_serializer=pb.PullRequest.SerializeToString, response_deserializer=_pull_reply
        )
        self.GetShardStatus = channel.unary_unary(
            f"/{_SERVICE}/GetShardStatus",
            request_serializer=pb.ShardStatusRequest.SerializeToString,
            response_deserializer=pb.ShardStatus.FromString,
        )
        self.PullAt = channel.unary_stream(
            f"/{_SERVICE}/PullAt",
            request_serializer=pb.PullAtRequest.SerializeToString,
            response_deserializer=_pull_reply,
        )
        # Issue 12: a remote worker's header-only push and pull whose payload moves on a bulk socket, as unary calls;
        # a shard that predates them takes the ticket in Push and Pull (a bulk pull's replies are header-only).
        self.PullHeaderOnly = channel.unary_stream(
            f"/{_SERVICE}/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.PullReply.FromString,
        )
        self.PushBulk = channel.unary_unary(
            f"/{_SERVICE}/PushBulk",
            request_serializer=pb.PushHeader.SerializeToString,
            response_deserializer=pb.PushReply.FromString,
        )
        self.PullBulk = channel.unary_unary(
            f"/{_SERVICE}/PullBulk",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.PullReply.FromString,
        )
        # Issue 12: a colocated worker's header-only push and pull as unary calls (no stream, no request thread).
        self.PushShm = channel.unary_unary(
            f"/{_SERVICE}/PushShared",
            request_serializer=pb.PushHeader.SerializeToString,
            response_deserializer=pb.PushReply.FromString,
        )
        self.PullShm = channel.unary_unary(
            f"/{_SERVICE}/PullShared",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.PullReply.FromString,
        )
        self.OpenSharedMemory = channel.unary_unary(
            f"/{_SERVICE}/OpenSharedMemory",
            request_serializer=pb.ShmRequest.SerializeToString,
            response_deserializer=pb.ShmRegions.FromString,
        )
        self.OpenBulk = channel.unary_unary(
            f"/{_SERVICE}/OpenBulk",
            request_serializer=pb.BulkRequest.SerializeToString,
            response_deserializer=pb.BulkGrant.FromString,
        )
        self.CloseSharedMemory = channel.unary_unary(
            f"/{_SERVICE}/CloseSharedMemory",
            request_serializer=pb.ShmRequest.SerializeToString,
            response_deserializer=pb.Empty.FromString,
        )


class PsClient:
    """One channel per shard, a thread per shard call in flight; safe to share between threads."""

    def __init__(
        self,
        addresses: list[str],
        total: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        push_timeout_s: float = 120.0,
        pull_timeout_s: float = 600.0,
        security: TransportSecurity = INSECURE,
        shared_memory: bool = True,
        push_dtype: torch.dtype = torch.float32,
        bulk: bool = True,
        pinning: HostPinning | None = None,
    ) -> None:
        """``shared_memory``: use shared memory with shards on this host (``transport.shared_memory: auto``).
        ``push_dtype``: gradients leave as this (``transport.push_dtype``); each piece is rounded once, as it is
        encoded, by ``round_push`` (the in-memory client calls the same function). ``bulk``: move payloads on raw
        sockets where a shard offers them (``transport.bulk_sockets: auto``; see the module docstring). ``pinning``:
        page-lock each push region for a GPU's copies (``push_targets``; a worker with one GPU)."""
        self.ranges: list[ShardRange] = shard_ranges(total, len(addresses))
        self.total = total
        self._addresses = list(addresses)
        self._push_dtype = push_dtype
        self._wire_dtype = wire_dtype(push_dtype)
        self._chunk_bytes = chunk_bytes
        self._push_timeout_s = push_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._closed = threading.Event()
        self._cancelled = threading.Event()
        # Combined push-and-pull calls whose pull has not settled: their gRPC call outlives any pool task, so
        # ``close`` without cancel waits for these, not only for the pools.
        self._open_pulls = 0
        self._pulls_settled = threading.Condition()
        self._channels = [open_channel(a, security) for a in addresses]
        self._stubs = [_ShardStub(c) for c in self._channels]
        self.shared = SharedMemory(
            self._addresses,
            self.ranges,
            [s.OpenSharedMemory for s in self._stubs],
            [s.CloseSharedMemory for s in self._stubs],
            shared_memory,
            pinning,
        )
        self.bulk = BulkClient(self._addresses, [s.OpenBulk for s in self._stubs], bulk)
        # Shards that predate PushBulk/PullBulk (UNIMPLEMENTED): their bulk tickets ride the Push and Pull streams
        # until the time given here (monotonic), when the unary calls are tried again (the shard may be upgraded).
        self._bulk_on_streams: dict[int, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=2 * len(addresses), thread_name_prefix="ps-client")
        # Piece pulls wait on the shards for the step's update: a pool of their own, so they never hold up a push.
        self._pulls = ThreadPoolExecutor(max_workers=PIECE_PULLS, thread_name_prefix="ps-pull")
        # A piece whose shard's board answers its push with its new version: one thread from the push to the copy
        # out of the board, no hand-off and no thread of gRPC's on the step's path. That thread waits for the step's
        # slowest worker, so at most PIECE_WAITS do; the others go without one (``_push_pull_one``), and pieces that
        # workers push in different orders never wait on each other.
        self._waiting = ThreadPoolExecutor(max_workers=PIECE_WAITS, thread_name_prefix="ps-push-pull")
        self._waits = threading.BoundedSemaphore(PIECE_WAITS)

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        """Send each shard its slice of ``flat`` (a contiguous float32 CPU vector), concurrently."""
        _check_push(flat, self.total)
        return PushHandle(
            [self._submit(self._push_one, r, flat[r.start : r.end], worker_id, step, device_count) for r in self.ranges]
        )

    def skip_step(self, worker_id: int, step: int, device_count: int) -> PushHandle:
        return PushHandle([self._submit(self._push_one, r, None, worker_id, step, device_count) for r in self.ranges])

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        """Send each piece of ``flat`` to its shard, concurrently (the header names the piece)."""
        _check_push(flat, self.total)
        check_pieces(pieces, self.ranges)
        futures = [
            self._submit(self._push_one, p, flat[p.start : p.end], worker_id, step, device_count, True) for p in pieces
        ]
        return PushHandle(futures)

    def skip_pieces(self, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int) -> PushHandle:
        check_pieces(pieces, self.ranges)
        return PushHandle([self._submit(self._push_one, p, None, worker_id, step, device_count, True) for p in pieces])

    def push_targets(self, pieces: Sequence[ShardRange], worker_id: int) -> list[torch.Tensor | None]:
        """Per piece, its span of a colocated shard's page-locked push region, where a GPU may copy the piece's
        gradient for ``push_pull_pieces(placed=...)`` to send it from; None where there is none (no ``pinning``, a
        remote shard, a push dtype that rounds). Negotiates the regions on first use, as a push does."""
        check_pieces(pieces, self.ranges)
        if self._push_dtype != torch.float32:
            return [None] * len(pieces)
        return self.shared.push_targets(pieces, worker_id)

    def push_pull_pieces(
        self,
        flat: torch.Tensor,
        pieces: Sequence[ShardRange],
        worker_id: int,
        step: int,
        device_count: int,
        out: torch.Tensor,
        placed: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[PushHandle, PullHandle]:
        """``push_pieces``, then each piece's pull of version ``step + 1`` into ``out``, started once that piece is
        acknowledged. A piece whose shard is colocated and offers its board is pushed and pulled back in one call
        (``PushShared`` with ``pull_after``): its acknowledgement comes with the new version, and no thread waits
        for it (the call runs on gRPC's own; its reply hands the copy out of the board to the pull pool). That
        call's deadline is the pull's, since it waits for the step's slowest worker. Any other piece is pushed on
        the push pool and then pulled on the pull pool, as ``push_pieces`` and ``pull_pieces`` would.

        ``placed[i]``, where given, holds piece i's gradient instead of ``flat``: when it is the piece's
        ``push_targets`` span the shared-memory push copies nothing, and should the shard refuse its regions the
        piece is streamed from it (a region given up stays mapped until ``close``)."""
        _check_push(flat, self.total)
        _check_pull(out, self.total)
        check_pieces(pieces, self.ranges)
        sources = placed_sources(flat, pieces, placed)
        acks: list[Future[ShardAck]] = []
        pulls: list[Future[int]] = []
        with self._pulls_settled:  # atomic with ``close``'s look at the count: counted here, or refused below
            closed = self._closed.is_set()
            if not closed:
                self._open_pulls += len(pieces)
        for p, source in zip(pieces, sources, strict=True):
            acked: Future[ShardAck] = Future()
            pulled: Future[int] = Future()
            args = (p, source, worker_id, step, device_count, out[p.start : p.end], acked, pulled)
            if not closed:
                pulled.add_done_callback(self._pull_settled)
            self._start_push_pull(args, follow_up=not closed)
            acks.append(acked)
            pulls.append(pulled)
        return PushHandle(acks), PullHandle(pulls)

    def _pull_settled(self, _: Future[int]) -> None:
        with self._pulls_settled:
            self._open_pulls -= 1
            self._pulls_settled.notify_all()

    def pull_pieces(self, min_version: int, out: torch.Tensor, pieces: Sequence[ShardRange]) -> PullHandle:
        _check_pull(out, self.total)
        check_pieces(pieces, self.ranges)
        return PullHandle(
            [self._submit(self._pull_one, p, min_version, out[p.start : p.end], True, pool=self._pulls) for p in pieces]
        )

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        """Fill ``out`` with every shard's parameters at ``min_version`` or newer; return the version."""
        _check_pull(out, self.total)
        futures = [self._submit(self._pull_one, r, min_version, out[r.start : r.end]) for r in self.ranges]
        return agreed_version([result_of(f) for f in futures])

    def contributed(self, worker_id: int) -> int:
        futures = [self._submit(self._contributed_one, r, worker_id) for r in self.ranges]
        return min(result_of(f) for f in futures)

    def _contributed_one(self, r: ShardRange, worker_id: int) -> int:
        request = pb.ShardStatusRequest(worker_id=worker_id)
        status = self._stubs[r.shard_id].GetShardStatus(request, timeout=CONTROL_TIMEOUT_S)
        return int(status.worker_step) if status.HasField("worker_step") else -1  # a shard that cannot tell: none

    def pull_at(self, version: int, out: torch.Tensor) -> None:
        _check_pull(out, self.total)
        futures = [self._submit(self._pull_at_one, r, version, out[r.start : r.end]) for r in self.ranges]
        for future in futures:
            result_of(future)

    def _pull_at_one(self, r: ShardRange, version: int, dest: torch.Tensor) -> None:
        """Streamed in gRPC: a rejoin's one pull needs no shared-memory region or bulk socket."""
        assembler = TensorAssembler(torch.float32, r.numel, out=dest)
        request = pb.PullAtRequest(shard_id=r.shard_id, version=version)
        for reply in self._stubs[r.shard_id].PullAt(request, timeout=self._pull_timeout_s):
            if isinstance(reply, CodecError):
                raise reply
            assembler.add(reply.chunk)
        assembler.result()

    def close(self, cancel: bool = False) -> None:
        """Release the channels. Calls made from here on fail with ``Cancelled``; those in flight finish first (a
        combined push-and-pull call too, with the pull it started), or with ``cancel`` fail at once."""
        with self._pulls_settled:
            self._closed.set()
        if cancel:
            self._cancelled.set()
            for channel in self._channels:
                channel.close()  # in-flight RPCs end with CANCELLED
        else:
            with self._pulls_settled:  # each one is bounded by its deadline
                self._pulls_settled.wait_for(lambda: self._open_pulls == 0)
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        self._waiting.shutdown(wait=True, cancel_futures=cancel)
        self._pulls.shutdown(wait=True, cancel_futures=cancel)
        if not cancel:  # the shards unlink this client's regions now, not when they stop; no call uses them now
            self.shared.close()
        log.info("closing; payloads moved: %s", self.shared.counts)
        self.shared.unmap(unpin=not cancel)
        self.bulk.close()
        for channel in self._channels:
            channel.close()

    def _submit(
        self,
        fn: Callable[..., T],
        r: ShardRange,
        *args: object,
        pool: ThreadPoolExecutor | None = None,
        follow_up: bool = False,
    ) -> Future[T]:
        """``follow_up``: the next part of a call made before ``close``, which that close lets finish."""
        if self._closed.is_set() and not follow_up:
            raise Cancelled("the parameter-server client is closed")
        try:
            return (pool or self._pool).submit(self._translated, fn, r, *args)
        except RuntimeError as exc:  # the pool shut down between the check and the submit
            raise Cancelled("the parameter-server client is closed") from exc

    def _translated(self, fn: Callable[..., T], r: ShardRange, *args: object) -> T:
        """Run one shard call, turning its status code into a ``ps_api`` error."""
        try:
            return fn(r, *args)
        except grpc.RpcError as exc:
            raise self._error_of(r, exc) from exc
        except ValueError as exc:
            if not self._cancelled.is_set():
                raise
            # "Cannot invoke RPC on closed channel!": the call started after close(cancel=True)
            raise Cancelled("the parameter-server client was closed") from exc

    def _error_of(self, r: ShardRange, exc: grpc.RpcError) -> BaseException:
        """The ``ps_api`` error for a shard call's status code (the ``RpcError`` itself for a code not in the table)."""
        error = ERRORS.get(exc.code())
        if error is None:
            return exc
        return error(f"shard {r.shard_id} at {self._addresses[r.shard_id]}: {exc.details()}")

    def _push_header(
        self, r: ShardRange, worker_id: int, step: int, device_count: int, is_piece: bool
    ) -> pb.PushHeader:
        header = pb.PushHeader(
            shard_id=r.shard_id,
            worker_id=worker_id,
            step=step,
            device_count=device_count,
            dtype=self._wire_dtype,
            numel=r.numel,
        )
        if is_piece:
            header.piece_start = r.start
        return header

    def _push_one(
        self,
        r: ShardRange,
        piece: torch.Tensor | None,
        worker_id: int,
        step: int,
        device_count: int,
        is_piece: bool = False,
    ) -> ShardAck:
        """Stream one shard its slice (or, ``is_piece``, one of its pieces: ``r``); ``None`` skips the step."""
        if piece is not None:
            piece = round_push(piece, self._push_dtype)  # bfloat16: half the bytes from here on
        header = self._push_header(r, worker_id, step, device_count, is_piece)
        header.skip = piece is None
        regions = self.shared.for_push(r, worker_id) if piece is not None else None
        if regions is not None and piece is not None:
            self._place(regions, r, piece)
            header.shm_nonce = regions.nonce
            try:
                if is_piece:  # one unary call (PushShared); a whole shard's header-only push is a Push stream
                    reply = self._stubs[r.shard_id].PushShm(header, timeout=self._push_timeout_s)
                else:
                    reply = self._stubs[r.shard_id].Push(
                        iter((encode_push_header(header),)), timeout=self._push_timeout_s
                    )
            except grpc.RpcError as exc:
                if exc.code() not in _SHM_REFUSED:
                    raise
                self.shared.disable(r.shard_id)
                header.shm_nonce = b""
            else:
                self.shared.count(shared=r.numel * 4)
                return ShardAck(r.shard_id, reply.version, reply.duplicate, reply.completed, reply.skipped)

        bulk = self.bulk.checkout(r.shard_id, worker_id) if piece is not None else None
        if bulk is not None:
            ack = self._push_bulk(r, header, piece, bulk)  # type: ignore[arg-type]
            if ack is not None:
                return ack
            header.bulk_ticket = b""  # the shard dropped that socket: the stream below carries the payload

        def requests() -> Iterator[bytes]:
            yield encode_push_header(header)
            if piece is not None:
                yield from encode_push_chunks(piece, self._chunk_bytes)

        reply = self._stubs[r.shard_id].Push(requests(), timeout=self._push_timeout_s)
        self.shared.count(streamed=0 if piece is None else r.numel * piece.element_size())
        return ShardAck(r.shard_id, reply.version, reply.duplicate, reply.completed, reply.skipped)

    def _start_push_pull(self, args: _PushPull, follow_up: bool) -> None:
        """Hand one piece's push-and-pull to the push pool (``_push_pull_one``) or, where its shard's board answers
        it in one call and fewer than PIECE_WAITS calls are waited through, to a thread that waits through it
        (``_push_pull_waiting``); whatever fails before it settles both futures."""
        acked, pulled = args[-2], args[-1]
        regions = self.shared.for_pull(args[0].shard_id)
        waits = regions is not None and regions.board is not None and self._waits.acquire(blocking=False)
        try:
            if waits:
                started = self._submit(self._push_pull_waiting, *args, pool=self._waiting, follow_up=follow_up)
            else:
                started = self._submit(self._push_pull_one, *args, follow_up=follow_up)
        except Cancelled as exc:
            if waits:
                self._waits.release()
            _settle(acked, exc)
            _settle(pulled, exc)
            return
        if waits:  # the call releases its place once its reply is in; a call that never started, here
            started.add_done_callback(self._release_if_cancelled)
        started.add_done_callback(functools.partial(_fail_with, [acked, pulled]))

    def _release_if_cancelled(self, task: Future[None]) -> None:
        if task.cancelled():
            self._waits.release()

    def _push_pull_waiting(
        self,
        r: ShardRange,
        piece: torch.Tensor,
        worker_id: int,
        step: int,
        device_count: int,
        dest: torch.Tensor,
        acked: Future[ShardAck],
        pulled: Future[int],
    ) -> None:
        """A waiting thread: push one piece to its shard's board and copy its version ``step + 1`` out of it, in one
        blocking call (gRPC starts no thread of its own for it) and this thread throughout."""
        args: _PushPull = (r, piece, worker_id, step, device_count, dest, acked, pulled)
        try:
            regions = self.shared.for_push(r, worker_id)
            if regions is None or regions.board is None:  # the shard dropped its regions meanwhile
                self._push_pull_one(*args)
                return
            header = self._combined_header(r, piece, worker_id, step, device_count, regions)
            try:
                reply = self._stubs[r.shard_id].PushShm(header, timeout=self._pull_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() not in _SHM_REFUSED:
                    raise
                self.shared.disable(r.shard_id)  # refused before the push was taken: push and pull the other way
                self._push_pull_one(*args)
                return
        finally:
            self._waits.release()  # before the copy, which waits for nobody: the next step's pieces may wait
        acked.set_result(self._combined_ack(r, reply, waited=True))
        if not reply.HasField("pulled"):  # a shard that predates pull_after, or regions replaced meanwhile
            self._then(pulled, self._pull_one, r, step + 1, dest, True)
            return
        request = pb.PullRequest(shard_id=r.shard_id, min_version=step + 1, piece_start=r.start)
        pulled.set_result(self._land_shared(r, reply.pulled, request, dest, regions, True))

    def _push_pull_one(
        self,
        r: ShardRange,
        piece: torch.Tensor,
        worker_id: int,
        step: int,
        device_count: int,
        dest: torch.Tensor,
        acked: Future[ShardAck],
        pulled: Future[int],
    ) -> None:
        """On the push pool: push one piece and arrange its pull of ``step + 1``; returns without waiting for it."""
        regions = self.shared.for_push(r, worker_id)
        if regions is None or regions.board is None:
            acked.set_result(self._push_one(r, piece, worker_id, step, device_count, True))
            self._then(pulled, self._pull_one, r, step + 1, dest, True)
            return
        header = self._combined_header(r, piece, worker_id, step, device_count, regions)
        call = self._stubs[r.shard_id].PushShm.future(header, timeout=self._pull_timeout_s)
        args: _PushPull = (r, piece, worker_id, step, device_count, dest, acked, pulled)
        call.add_done_callback(functools.partial(self._pushed_and_published, args, regions))

    def _combined_header(
        self, r: ShardRange, piece: torch.Tensor, worker_id: int, step: int, device_count: int, regions: MappedPair
    ) -> pb.PushHeader:
        """Place the piece in its push region; the header of its push with ``pull_after``, whose deadline is the
        pull's, since it waits for the step's slowest worker."""
        header = self._push_header(r, worker_id, step, device_count, True)
        header.shm_nonce = regions.nonce
        header.pull_after = True
        self._place(regions, r, round_push(piece, self._push_dtype))
        return header

    def _combined_ack(self, r: ShardRange, reply: pb.PushReply, waited: bool = False) -> ShardAck:
        pulled = int(reply.HasField("pulled"))
        self.shared.count(shared=r.numel * 4, push_pulls=pulled, waited_push_pulls=pulled if waited else 0)
        return ShardAck(r.shard_id, reply.version, reply.duplicate, reply.completed, reply.skipped)

    def _pushed_and_published(self, args: _PushPull, regions: MappedPair, call: grpc.Future) -> None:
        """gRPC's callback thread, once the combined call has ended: settle the acknowledgement and hand the copy
        out of the board to the pull pool (nothing here may block)."""
        r, _, _, step, _, dest, acked, pulled = args
        try:
            reply = call.result()
        except grpc.RpcError as exc:
            if exc.code() in _SHM_REFUSED:  # refused before the push was taken: push and pull the other way
                self.shared.disable(r.shard_id)
                self._start_push_pull(args, follow_up=True)
                return
            error = self._error_of(r, exc)
            _settle(acked, error)
            _settle(pulled, error)
            return
        except BaseException as exc:  # noqa: BLE001 - e.g. the call was cancelled: whoever waits sees it
            _settle(acked, exc)
            _settle(pulled, exc)
            return
        acked.set_result(self._combined_ack(r, reply))
        if not reply.HasField("pulled"):  # a shard that predates pull_after, or regions replaced meanwhile
            self._then(pulled, self._pull_one, r, step + 1, dest, True)
            return
        request = pb.PullRequest(shard_id=r.shard_id, min_version=step + 1, piece_start=r.start)
        self._then(pulled, self._land_shared, r, reply.pulled, request, dest, regions, True)

    def _place(self, regions: MappedPair, r: ShardRange, piece: torch.Tensor) -> None:
        """Put a piece's gradient (as pushed: ``round_push``) in its span of the push region: the payload's one copy
        on this side, or none where a GPU copied it there (``push_targets``, passed back as ``placed``)."""
        span = regions.push.data[self.shared.span(r)]
        if piece.data_ptr() == span.data_ptr():
            self.shared.count(placed_pushes=1)
            return
        span.copy_(piece)

    def _then(self, into: Future[T], fn: Callable[..., T], r: ShardRange, *args: object) -> None:
        """Run ``fn(r, *args)`` on the pull pool and settle ``into`` with its outcome."""
        try:
            task = self._submit(fn, r, *args, pool=self._pulls, follow_up=True)
        except Cancelled as exc:
            _settle(into, exc)
            return
        task.add_done_callback(functools.partial(_settle_with, into))

    def _push_bulk(
        self, r: ShardRange, header: pb.PushHeader, piece: torch.Tensor, bulk: ClientSocket
    ) -> ShardAck | None:
        """The header on gRPC, the payload on ``bulk``; None if the shard aborted the call (stream it instead)."""
        header.bulk_ticket = bulk.ticket
        stub = self._stubs[r.shard_id]
        if self._on_streams(r.shard_id):
            call = stub.Push.future(iter((encode_push_header(header),)), timeout=self._push_timeout_s)
        else:
            call = stub.PushBulk.future(header, timeout=self._push_timeout_s)
        bulk.abort_on_failure(call)
        sent = bulk.send(piece, self._push_timeout_s)  # the payload's only copies are the kernel's
        try:
            reply = call.result()
        except BaseException as exc:
            self.bulk.discard(bulk)
            if _aborted(exc):  # the shard dropped the socket before reading all of it: nothing was counted
                self._older_shard(r, exc)
                return None
            raise
        if sent and not reply.duplicate:  # a duplicate's socket is closed by the shard (its payload maybe unread)
            self.bulk.checkin(r.shard_id, bulk)
        else:
            self.bulk.discard(bulk)
        self.shared.count(streamed=r.numel * piece.element_size())
        return ShardAck(r.shard_id, reply.version, reply.duplicate, reply.completed, reply.skipped)

    def _pull_bulk(self, r: ShardRange, request: pb.PullRequest, dest: torch.Tensor, bulk: ClientSocket) -> int | None:
        """The request and the header-only reply on gRPC, the parameters read into ``dest`` from ``bulk``; None if
        the shard aborted the call."""
        bulk_request = pb.PullRequest(bulk_ticket=bulk.ticket, bulk_numel=dest.numel())  # the shard checks the size
        bulk_request.MergeFrom(request)
        stub = self._stubs[r.shard_id]
        streams = self._on_streams(r.shard_id)
        call = (stub.PullHeaderOnly if streams else stub.PullBulk.future)(bulk_request, timeout=self._pull_timeout_s)
        bulk.abort_on_failure(call)
        received = bulk.receive(dest, self._pull_timeout_s)
        try:
            replies = list(call) if streams else [call.result()]
        except BaseException as exc:
            self.bulk.discard(bulk)
            if _aborted(exc):  # the shard dropped the socket: the stream overwrites whatever arrived
                self._older_shard(r, exc)
                return None
            raise
        if not received or len(replies) != 1 or replies[0].HasField("chunk") or replies[0].HasField("board_slot"):
            self.bulk.discard(bulk)
            raise CodecError("a bulk pull is answered with its payload on the socket and one header-only reply")
        self.bulk.checkin(r.shard_id, bulk)
        self.shared.count(streamed=r.numel * 4)
        return replies[0].version

    def _on_streams(self, shard_id: int) -> bool:
        return self._bulk_on_streams.get(shard_id, -math.inf) > time.monotonic()

    def _older_shard(self, r: ShardRange, exc: BaseException) -> None:
        """A shard that predates PushBulk/PullBulk (UNIMPLEMENTED): its bulk tickets go with the Push and Pull
        streams for ``RETRY_AFTER_S`` (the call that found out, whose socket may hold its payload, is streamed)."""
        if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            return
        if not self._on_streams(r.shard_id):
            self._bulk_on_streams[r.shard_id] = time.monotonic() + RETRY_AFTER_S
            log.info("shard %d at %s predates PushBulk and PullBulk: bulk tickets go with its Push and Pull streams "
                     "(the unary calls are tried again in %.0f s)", r.shard_id, self._addresses[r.shard_id],
                     RETRY_AFTER_S)  # fmt: skip

    def _pull_shared(
        self, r: ShardRange, request: pb.PullRequest, dest: torch.Tensor, regions: MappedPair, board: bool
    ) -> int | None:
        """One unary call: the shard names the piece's board slot (``board``) or copies it into the pull region;
        None if the shard refused the regions (the caller streams)."""
        shared = pb.PullRequest(shm_worker=regions.worker_id, shm_nonce=regions.nonce, board=board)
        shared.MergeFrom(request)
        try:
            reply = self._stubs[r.shard_id].PullShm(shared, timeout=self._pull_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() not in _SHM_REFUSED:
                raise
            self.shared.disable(r.shard_id)
            return None
        return self._land_shared(r, reply, request, dest, regions, board)

    def _land_shared(
        self,
        r: ShardRange,
        reply: pb.PullReply,
        request: pb.PullRequest,
        dest: torch.Tensor,
        regions: MappedPair,
        board: bool,
    ) -> int:
        """Copy the version a shared-memory pull's ``reply`` names into ``dest``: out of the board slot (pulled again
        through the pull region if its stamp moved) or out of the pull region."""
        if reply.HasField("chunk"):
            raise CodecError("a shared-memory pull is answered with one header-only reply")
        where = self.shared.span(r)
        if reply.HasField("board_slot"):
            if regions.board is None or not board:
                raise CodecError("the shard named a board slot for a pull that did not ask for one")
            if regions.board.copy_out(reply.board_slot, reply.version, where, dest):  # the payload's one copy
                self.shared.count(shared=r.numel * 4, board_pulls=1)
                return reply.version
            self.shared.count(board_retries=1)  # the half moved on under the copy: the shard copies it this time
            again = self._pull_shared(r, request, dest, regions, board=False)
            if again is None:  # the shard dropped the regions meanwhile
                return self._pull_one(r, request.min_version, dest, request.HasField("piece_start"))
            return again
        dest.copy_(regions.pull.data[where])  # the payload's one copy on this side
        self.shared.count(shared=r.numel * 4)
        return reply.version

    def _pull_one(self, r: ShardRange, min_version: int, dest: torch.Tensor, is_piece: bool = False) -> int:
        assembler = TensorAssembler(torch.float32, r.numel, out=dest)
        version = -1
        request = pb.PullRequest(shard_id=r.shard_id, min_version=min_version)
        if is_piece:
            request.piece_start = r.start
        regions = self.shared.for_pull(r.shard_id)
        if regions is not None:
            # A whole shard is on the board where the shard is one piece (the shard names no slot otherwise).
            ask_board = regions.board is not None and (is_piece or regions.board.pieces == 1)
            got = self._pull_shared(r, request, dest, regions, board=ask_board)
            if got is not None:
                return got
        bulk = self.bulk.checkout(r.shard_id, None) if dest.is_contiguous() else None
        if bulk is not None:
            got = self._pull_bulk(r, request, dest, bulk)
            if got is not None:
                return got
        for reply in self._stubs[r.shard_id].Pull(request, timeout=self._pull_timeout_s):
            if isinstance(reply, CodecError):
                raise reply
            version = reply.version
            assembler.add(reply.chunk)
        assembler.result()
        self.shared.count(streamed=r.numel * 4)
        return version
