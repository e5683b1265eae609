"""gRPC adapter for a ParameterShard: translate messages, call the shard, map errors.

Served by an asyncio server (``start_server(..., aio=True)``) and registered with
``add_parameter_server``, which installs the data plane's byte-level serializers
(``protos.codec``) for Push and Pull. Both are ``async`` handlers on the server's event loop:

* Push copies each chunk's payload into a staging buffer as it arrives (the bytes were already
  on the loop: gRPC's asyncio layer receives them there) and calls the shard in a worker thread,
  since the shard's lock may be held by an update.
* Pull waits as a suspended coroutine, not a parked thread, so a shard serves any number of
  waiting workers. ``_Versions`` follows the shard's published versions with one thread per
  shard and serves every pull of a version from one encoding of it (``EncodedReplies``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import CodecError, EncodedReplies, PushPart, TensorAssembler, decode_push_request
from pstrain.ps_server import metrics
from pstrain.ps_server.errors import InvalidArgument, NotReady, PsError, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.shard import ParameterShard, PushResult
from pstrain.runtime.transport import abort_on_errors, full_service_name

translate = abort_on_errors(
    {
        InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownWorker: grpc.StatusCode.NOT_FOUND,
        StepConflict: grpc.StatusCode.FAILED_PRECONDITION,
        NotReady: grpc.StatusCode.UNAVAILABLE,
        WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

DEFAULT_PULL_WAIT_S = 300.0
PUSHES_STAGED = 8  # pushes receiving at once, each into a shard-sized buffer; the rest wait unread
FOLLOW_POLL_S = 1.0  # how often the version follower looks whether its server has stopped


class _StagingPool:
    """Reuses the buffers pushes are received into (at most ``PUSHES_STAGED``): a 100 MB allocation per push
    costs page faults."""

    def __init__(self, numel: int) -> None:
        self._numel = numel
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self) -> torch.Tensor:
        with self._lock:
            return self._free.pop() if self._free else torch.empty(self._numel, dtype=torch.float32)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class _Versions:
    """The shard's newest published version, as the event loop's pulls see it.

    One thread waits on the shard (``ParameterShard.read``, which holds the shard's lock only
    briefly) for each next version and hands it to the loop; pulls await it there. So the loop
    never blocks on the shard's lock (an update holds it), and waiting pulls hold no thread.
    A closed shard fails every pull with ``NotReady`` from then on.
    """

    def __init__(self, shard: ParameterShard, chunk_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self._shard = shard
        self._chunk_bytes = chunk_bytes
        self._loop = loop
        self._latest: EncodedReplies | None = None
        self._closed: str | None = None
        self._changed = asyncio.Event()
        self._waiting = 0
        self._waiting_changed = threading.Condition()
        threading.Thread(target=self._follow, name=f"shard-{shard.shard_id}-versions", daemon=True).start()

    @property
    def waiting(self) -> int:
        with self._waiting_changed:
            return self._waiting

    def wait_until_waiting(self, count: int, timeout_s: float) -> bool:
        with self._waiting_changed:
            return self._waiting_changed.wait_for(lambda: self._waiting >= count, timeout_s)

    async def get(self, min_version: int, timeout_s: float) -> EncodedReplies:
        """The encoded replies of ``min_version`` or newer, once the shard has published it."""
        deadline = self._loop.time() + timeout_s
        self._count_waiting(+1)
        try:
            while True:
                if self._closed is not None:
                    raise NotReady(self._closed)
                latest = self._latest
                if latest is not None and latest.version >= min_version:
                    return latest
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    at = "no version yet" if latest is None else f"version {latest.version}"
                    raise WaitTimeout(
                        f"shard {self._shard.shard_id} is at {at}; version {min_version} did not appear within "
                        f"{timeout_s:.1f}s (are all {self._shard.workers} workers pushing?)"
                    )
                changed = self._changed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            self._count_waiting(-1)

    def _count_waiting(self, delta: int) -> None:
        with self._waiting_changed:
            self._waiting += delta
            self._waiting_changed.notify_all()

    def _follow(self) -> None:
        """The one thread per shard that waits for versions (ends with the loop or the shard)."""
        want = 0
        while not self._loop.is_closed():
            try:
                with self._shard.read(want, FOLLOW_POLL_S) as (version, published):
                    # Encoded while the read lease keeps the shard from reusing this buffer.
                    encoded = EncodedReplies(version, published, self._chunk_bytes).encode_all()
            except WaitTimeout:
                continue
            except PsError as exc:  # the shard closed: NotReady
                self._post(None, str(exc))
                return
            if not self._post(encoded, None):
                return
            want = version + 1

    def _post(self, encoded: EncodedReplies | None, closed: str | None) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._publish, encoded, closed)
        except RuntimeError:  # the loop closed: the server has stopped
            return False
        return True

    def _publish(self, encoded: EncodedReplies | None, closed: str | None) -> None:
        if closed is not None:
            self._closed = closed
        else:
            assert encoded is not None
            self._latest = encoded
        self._changed.set()  # wakes the pulls waiting now; later ones wait on a fresh event
        self._changed = asyncio.Event()


class ParameterServerServicer:
    def __init__(self) -> None:
        self._shard: ParameterShard | None = None
        self._pool: _StagingPool | None = None
        self._chunk_bytes = 0
        self._versions: _Versions | None = None
        self._versions_ready = threading.Event()
        self._staging_slots = asyncio.Semaphore(PUSHES_STAGED)  # binds to the server's loop on first use

    def attach(self, shard: ParameterShard, chunk_bytes: int) -> None:
        """Called once the shard holds its initial parameters; until then RPCs are UNAVAILABLE."""
        self._pool = _StagingPool(shard.numel)
        self._chunk_bytes = chunk_bytes
        self._shard = shard
        metrics.VERSION.set_function(lambda: shard.version)
        metrics.SHARD_BYTES.set_function(lambda: shard.snapshot().bytes_held)
        metrics.PUSHES_WAITING.set_function(lambda: shard.snapshot().pushes_waiting)

    @property
    def shard(self) -> ParameterShard:
        if self._shard is None:
            raise NotReady("this shard has not received its initial parameters yet; retry shortly")
        return self._shard

    @property
    def pulls_waiting(self) -> int:
        """Pulls waiting for a version that does not exist yet (for operators and tests)."""
        return self._versions.waiting if self._versions is not None else 0

    def wait_until_pulls_waiting(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` pulls wait for a version; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if not self._versions_ready.wait(timeout_s):
            return False
        assert self._versions is not None
        return self._versions.wait_until_waiting(count, max(0.0, deadline - time.monotonic()))

    @translate
    async def Push(self, request_iterator: AsyncIterator[PushPart], context: grpc.aio.ServicerContext) -> pb.PushReply:
        shard = self.shard
        started = time.perf_counter()
        first = await anext(request_iterator, None)
        if first is None or first.header is None:
            raise InvalidArgument("a push stream must start with a PushHeader")
        h = first.header
        # The shard's calls go to a thread: they wait for its lock while an update holds it.
        if await asyncio.to_thread(shard.check_push, h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel):
            return pb.PushReply(version=shard.version, duplicate=True)
        if h.skip:
            if await anext(request_iterator, None) is not None:
                raise InvalidArgument("a push that skips its step carries no payload")
            result = await asyncio.to_thread(shard.push, h.worker_id, h.step, None, h.device_count, skip=True)
            return pb.PushReply(version=result.version, completed=result.completed, skipped=result.skipped)
        assert self._pool is not None
        async with self._staging_slots:
            buf = self._pool.acquire()
            pushing: asyncio.Future[PushResult] | None = None
            try:
                assembler = TensorAssembler(torch.float32, h.numel, out=buf)
                async for part in request_iterator:
                    if part.chunk is None:
                        raise InvalidArgument("a push stream carries one PushHeader followed by chunks only")
                    assembler.add(part.chunk)
                call = functools.partial(shard.push, h.worker_id, h.step, assembler.result(), h.device_count)
                pushing = asyncio.get_running_loop().run_in_executor(None, call)
                # Shielded: a cancelled RPC must not hand the buffer to another push while the shard reads it.
                result = await asyncio.shield(pushing)
            finally:
                if pushing is None or pushing.done():
                    self._pool.release(buf)
                else:
                    pushing.add_done_callback(lambda _: self._pool.release(buf))
        metrics.BYTES_PUSHED.inc(h.numel * 4)
        metrics.PUSH_SECONDS.observe(time.perf_counter() - started)
        if result.completed:
            metrics.UPDATE_SECONDS.observe(result.update_s)
        return pb.PushReply(
            version=result.version, duplicate=result.duplicate, completed=result.completed, skipped=result.skipped
        )

    @translate
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"pull for shard {request.shard_id} reached shard {shard.shard_id}")
        started = time.perf_counter()
        remaining = context.time_remaining()
        wait_s = DEFAULT_PULL_WAIT_S if remaining is None else max(0.0, remaining)
        replies = await self._versions_of(shard).get(request.min_version, wait_s)
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)

    def _versions_of(self, shard: ParameterShard) -> _Versions:
        """Made by the first pull, on the event loop (the only thread that touches it after)."""
        if self._versions is None:
            self._versions = _Versions(shard, self._chunk_bytes, asyncio.get_running_loop())
            self._versions_ready.set()
        return self._versions

    @translate
    def GetShardStatus(self, request: pb.ShardStatusRequest, context: grpc.ServicerContext) -> pb.ShardStatus:
        s = self.shard.snapshot()
        return pb.ShardStatus(
            shard_id=s.shard_id,
            start=s.start,
            end=s.end,
            version=s.version,
            pushes_waiting=s.pushes_waiting,
            workers_expected=s.workers_expected,
            bytes_held=s.bytes_held,
            optimizer=s.optimizer,
        )


def _as_is(message: bytes) -> bytes:
    """Pull replies leave the servicer already encoded (``EncodedReplies``)."""
    return message


def add_parameter_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Register the ParameterServer service with the data plane's serializers (for ``start_server``).

    The generated ``add_ParameterServerServicer_to_server`` would parse and build protobuf
    objects; these handlers take Push messages apart in place and send Pull replies as the
    bytes ``EncodedReplies`` made. The wire format is the same.
    """
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=decode_push_request, response_serializer=pb.PushReply.SerializeToString
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=pb.PullRequest.FromString, response_serializer=_as_is
        ),
        "GetShardStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetShardStatus,
            request_deserializer=pb.ShardStatusRequest.FromString,
            response_serializer=pb.ShardStatus.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(full_service_name("ParameterServer"), handlers),)
    )
