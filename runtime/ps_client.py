"""The gRPC ``ParameterServerClient`` (see ``ps_api``), shaped like ps-lite's KVWorker.

``push`` slices a flat vector by the shard map and streams every slice to its shard at
once, returning a handle to wait on; ``pull`` waits for a version and streams every shard's
range straight into the caller's buffer. Used by workers and by the coordinator's export.
Push and Pull use the data plane's byte-level serializers (``protos.codec``): a push's
payload is copied once, out of the caller's vector into each message, and a pull's once, out
of each received message into the caller's buffer.

Status codes become ``ps_api`` errors here, in one table; a code the table does not name is
raised as the ``grpc.RpcError`` it is. Nothing is retried here: the caller decides (see
``ps_api.with_retries``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

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
)
from pstrain.runtime.ps_api import (
    Cancelled,
    InvalidRequest,
    PsClientError,
    PushHandle,
    ShardAck,
    StepConflict,
    Unavailable,
    UnknownWorker,
    WaitTimeout,
    agreed_version,
    check_pull_buffer,
    check_push_buffer,
    result_of,
)
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import full_service_name, open_channel

T = TypeVar("T")

ERRORS: dict[grpc.StatusCode, type[PsClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: UnknownWorker,
    grpc.StatusCode.FAILED_PRECONDITION: StepConflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: WaitTimeout,
    grpc.StatusCode.CANCELLED: Cancelled,
}


_SERVICE = full_service_name("ParameterServer")


def _as_is(message: bytes) -> bytes:
    """Push requests leave ``_push_one`` already encoded."""
    return message


def _pull_reply(raw: bytes) -> PullPart | CodecError:
    """Parse a reply in gRPC's thread; a malformed one is raised by the reader, not lost in gRPC."""
    try:
        return decode_pull_reply(raw)
    except CodecError as exc:
        return exc


class _ShardStub:
    """Push and Pull of one shard's channel, with the data plane's serializers."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Push = channel.stream_unary(
            f"/{_SERVICE}/Push", request_serializer=_as_is, response_deserializer=pb.PushReply.FromString
        )
        self.Pull = channel.unary_stream(
            f"/{_SERVICE}/Pull", request_serializer=pb.PullRequest.SerializeToString, response_deserializer=_pull_reply
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
    ) -> None:
        self.ranges: list[ShardRange] = shard_ranges(total, len(addresses))
        self.total = total
        self._addresses = list(addresses)
        self._chunk_bytes = chunk_bytes
        self._push_timeout_s = push_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._closed = threading.Event()
        self._cancelled = threading.Event()
        self._channels = [open_channel(a, security) for a in addresses]
        self._stubs = [_ShardStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=2 * len(addresses), thread_name_prefix="ps-client")

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        """Send each shard its slice of ``flat`` (a contiguous float32 CPU vector), concurrently."""
        check_push_buffer(flat, self.total)
        return PushHandle(
            [self._submit(self._push_one, r, flat[r.start : r.end], worker_id, step, device_count) for r in self.ranges]
        )

    def skip_step(self, worker_id: int, step: int, device_count: int) -> PushHandle:
        return PushHandle([self._submit(self._push_one, r, None, worker_id, step, device_count) for r in self.ranges])

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        """Fill ``out`` with every shard's parameters at ``min_version`` or newer; return the version."""
        check_pull_buffer(out, self.total)
        futures = [self._submit(self._pull_one, r, min_version, out[r.start : r.end]) for r in self.ranges]
        return agreed_version([result_of(f) for f in futures])

    def close(self, cancel: bool = False) -> None:
        """Release the channels; with ``cancel`` in-flight calls fail at once with ``Cancelled``."""
        self._closed.set()
        if cancel:
            self._cancelled.set()
            for channel in self._channels:
                channel.close()  # in-flight RPCs end with CANCELLED
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        for channel in self._channels:
            channel.close()

    def _submit(self, fn: Callable[..., T], r: ShardRange, *args: object) -> Future[T]:
        if self._closed.is_set():
            raise Cancelled("the parameter-server client is closed")
        try:
            return self._pool.submit(self._translated, fn, r, *args)
        except RuntimeError as exc:  # the pool shut down between the check and the submit
            raise Cancelled("the parameter-server client is closed") from exc

    def _translated(self, fn: Callable[..., T], r: ShardRange, *args: object) -> T:
        """Run one shard call, turning its status code into a ``ps_api`` error."""
        try:
            return fn(r, *args)
        except grpc.RpcError as exc:
            error = ERRORS.get(exc.code())
            if error is None:
                raise
            raise error(f"shard {r.shard_id} at {self._addresses[r.shard_id]}: {exc.details()}") from exc
        except ValueError as exc:
            if not self._cancelled.is_set():
                raise
            # "Cannot invoke RPC on closed channel!": the call started after close(cancel=True)
            raise Cancelled("the parameter-server client was closed") from exc

    def _push_one(
        self, r: ShardRange, piece: torch.Tensor | None, worker_id: int, step: int, device_count: int
    ) -> ShardAck:
        """Stream one shard its piece; ``None`` sends a header-only push that skips the step."""
        header = pb.PushHeader(
            shard_id=r.shard_id,
            worker_id=worker_id,
            step=step,
            device_count=device_count,
            dtype=pb.FLOAT32,
            numel=r.numel,
            skip=piece is None,
        )

        def requests() -> Iterator[bytes]:
            yield encode_push_header(header)
            if piece is not None:
                yield from encode_push_chunks(piece, self._chunk_bytes)

        reply = self._stubs[r.shard_id].Push(requests(), timeout=self._push_timeout_s)
        return ShardAck(r.shard_id, reply.version, reply.duplicate, reply.completed, reply.skipped)

    def _pull_one(self, r: ShardRange, min_version: int, dest: torch.Tensor) -> int:
        assembler = TensorAssembler(torch.float32, r.numel, out=dest)
        version = -1
        request = pb.PullRequest(shard_id=r.shard_id, min_version=min_version)
        for reply in self._stubs[r.shard_id].Pull(request, timeout=self._pull_timeout_s):
            if isinstance(reply, CodecError):
                raise reply
            version = reply.version
            assembler.add(reply.chunk)
        assembler.result()
        return version
