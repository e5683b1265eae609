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
* A worker on this host may ask for shared-memory regions (``OpenSharedMemory``, ``ps_server.shm``);
  its pushes then carry only the header (the piece is in its push region) and its pulls are
  answered header-only (the piece is copied into its pull region). Same checks, same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import (
    CodecError,
    EncodedReplies,
    PushPart,
    TensorAssembler,
    decode_push_request,
    torch_dtype,
)
from pstrain.ps_server import metrics
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.errors import InvalidArgument, NotReady, PsError, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.pieces import PiecedShard, as_pieced
from pstrain.ps_server.shard import ParameterShard, PushResult
from pstrain.ps_server.shm import NotColocated, SharedRegions, StaleRegion
from pstrain.runtime.admission import Overloaded
from pstrain.runtime.identity import PermissionDenied
from pstrain.runtime.shm_region import HEADER_BYTES
from pstrain.runtime.transport import abort_on_errors, full_service_name

translate = abort_on_errors(
    {
        InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownWorker: grpc.StatusCode.NOT_FOUND,
        StepConflict: grpc.StatusCode.FAILED_PRECONDITION,
        NotReady: grpc.StatusCode.UNAVAILABLE,
        WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
        Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
        NotColocated: grpc.StatusCode.FAILED_PRECONDITION,
        StaleRegion: grpc.StatusCode.ABORTED,
    }
)

PUSHES_STAGED = 8  # pushes receiving at once, each into a shard-sized buffer; the rest wait unread
FOLLOW_POLL_S = 1.0  # how often the version follower looks whether its server has stopped


class _StagingPool:
    """Reuses the buffers pushes are received into (at most ``PUSHES_STAGED`` per size): a 100 MB allocation per
    push costs page faults. Keyed by size: a shard receives whole-shard pushes and pushes of each piece."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def acquire(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of the pushed dtype: a bfloat16 push (issue 12) is widened once, into the shard's accumulator."""
        with self._lock:
            free = self._free.get((numel, dtype))
            return free.pop() if free else torch.empty(numel, dtype=dtype)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)


class _Versions:
    """The newest published version of a shard (or of one of its pieces), as the event loop's pulls see it.

    One thread waits on the shard (``ParameterShard.read``, which holds the shard's lock only
    briefly) for each next version and hands it to the loop; pulls await it there. So the loop
    never blocks on the shard's lock (an update holds it), and waiting pulls hold no thread.
    A closed shard fails every pull with ``NotReady`` from then on.
    """

    def __init__(
        self,
        shard: ParameterShard | PiecedShard,
        chunk_bytes: int,
        loop: asyncio.AbstractEventLoop,
        encode: bool = True,
    ) -> None:
        self._shard = shard
        self._chunk_bytes = chunk_bytes
        self._encode = encode  # False: shared-memory pulls only need to know a version is out (no encoding)
        self._loop = loop
        self._latest: EncodedReplies | None = None
        self._closed: str | None = None
        self._changed = asyncio.Event()
        self._waiting = 0
        self._waiting_changed = threading.Condition()
        name = f"shard-{shard.shard_id}-{shard.start}-versions"
        threading.Thread(target=self._follow, name=name, daemon=True).start()

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
                    encoded = EncodedReplies(version, published if self._encode else _NOTHING, self._chunk_bytes)
                    if self._encode:
                        encoded.encode_all()
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


_NOTHING = torch.empty(0)  # what a version marker (``encode=False``) holds


class ParameterServerServicer:
    def __init__(self) -> None:
        self._shard: PiecedShard | None = None
        self._pool = _StagingPool()
        self._chunk_bytes = 0
        self._versions: dict[int | None, _Versions] = {}  # piece start (None: the whole shard) -> its follower
        self._versions_ready = threading.Event()
        self._staging_slots = asyncio.Semaphore(PUSHES_STAGED)  # binds to the server's loop on first use
        self.gate = ShardGate()  # issue 8: who may push and pull, how many pulls wait (pstrain-ps installs keys)
        self.shared_memory = True  # issue 12: offer colocated workers shared-memory regions (transport.shared_memory)
        self._regions: SharedRegions | None = None
        self._marks: dict[int | None, _Versions] = {}  # piece start -> version marks for shared-memory pulls

    def attach(self, shard: ParameterShard | PiecedShard, chunk_bytes: int) -> None:
        """Called once the shard holds its initial parameters; until then RPCs are UNAVAILABLE.

        A bare ``ParameterShard`` is served as a shard of one piece."""
        self._chunk_bytes = chunk_bytes
        shard = as_pieced(shard)
        self._shard = shard
        self._regions = SharedRegions(shard.start, shard.numel, self.shared_memory)
        metrics.VERSION.set_function(lambda: shard.version)
        metrics.SHARD_BYTES.set_function(lambda: shard.snapshot().bytes_held)
        metrics.PUSHES_WAITING.set_function(lambda: shard.snapshot().pushes_waiting)

    @property
    def shard(self) -> PiecedShard:
        if self._shard is None:
            raise NotReady("this shard has not received its initial parameters yet; retry shortly")
        return self._shard

    @property
    def regions(self) -> SharedRegions:
        if self._regions is None:
            raise NotReady("this shard has not received its initial parameters yet; retry shortly")
        return self._regions

    def close_shared_memory(self) -> None:
        """Unlink every shared-memory region (the server stops); later opens are refused."""
        if self._regions is not None:
            self._regions.close()

    @property
    def pulls_waiting(self) -> int:
        """Pulls waiting for a version that does not exist yet (for operators and tests)."""
        return sum(v.waiting for v in list(self._versions.values()))

    def wait_until_pulls_waiting(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` pulls wait for a version of one piece (or of the whole shard, whichever
        was pulled first); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if not self._versions_ready.wait(timeout_s):
            return False
        first = next(iter(self._versions.values()))
        return first.wait_until_waiting(count, max(0.0, deadline - time.monotonic()))

    @translate
    async def Push(self, request_iterator: AsyncIterator[PushPart], context: grpc.aio.ServicerContext) -> pb.PushReply:
        shard = self.shard
        started = time.perf_counter()
        first = await anext(request_iterator, None)
        if first is None or first.header is None:
            raise InvalidArgument("a push stream must start with a PushHeader")
        h = first.header
        piece = h.piece_start if h.HasField("piece_start") else None
        # The shard's calls go to a thread: they wait for its lock while an update holds it.
        check = functools.partial(shard.check_push, piece_start=piece)
        duplicate = await asyncio.to_thread(check, h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel)
        # Issue 8: only the worker itself may push for it, with its registered device count; before any payload.
        self.gate.check_push(context.invocation_metadata(), h.worker_id, h.device_count)
        if duplicate:
            version = shard.version if piece is None else shard.piece(piece, h.numel).version
            return pb.PushReply(version=version, duplicate=True)
        if h.skip:
            if await anext(request_iterator, None) is not None:
                raise InvalidArgument("a push that skips its step carries no payload")
            skip = functools.partial(shard.push, skip=True, piece_start=piece)
            result = await asyncio.to_thread(skip, h.worker_id, h.step, None, h.device_count)
            return pb.PushReply(version=result.version, completed=result.completed, skipped=result.skipped)
        async with self._staging_slots:
            buf = self._pool.acquire(h.numel, torch_dtype(h.dtype))  # h.dtype is the job's push dtype (checked)
            pushing: asyncio.Future[PushResult] | None = None
            try:
                take: Callable[[], torch.Tensor]
                if h.shm_nonce:  # the piece is in the worker's push region: copied out in the shard's thread
                    pair, regions = self.regions.pair(h.worker_id, h.shm_nonce), self.regions
                    where = regions.span(piece, h.numel)
                    if buf.dtype == torch.float32:  # read in place: the shard keeps nothing after the push
                        take = functools.partial(regions.view, pair, where)
                    else:
                        take = functools.partial(regions.take, pair, where, buf)
                    if await anext(request_iterator, None) is not None:
                        raise InvalidArgument("a shared-memory push carries its header only")
                else:
                    assembler = TensorAssembler(buf.dtype, h.numel, out=buf)
                    async for part in request_iterator:
                        if part.chunk is None:
                            raise InvalidArgument("a push stream carries one PushHeader followed by chunks only")
                        assembler.add(part.chunk)
                    take = assembler.result

                def call() -> PushResult:
                    return shard.push(h.worker_id, h.step, take(), h.device_count, piece_start=piece)

                pushing = asyncio.get_running_loop().run_in_executor(None, call)
                # Shielded: a cancelled RPC must not hand the buffer to another push while the shard reads it.
                result = await asyncio.shield(pushing)
            finally:
                if pushing is None or pushing.done():
                    self._pool.release(buf)
                else:
                    pushing.add_done_callback(lambda _: self._pool.release(buf))
        metrics.BYTES_PUSHED.inc(h.numel * buf.element_size())
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
        piece = request.piece_start if request.HasField("piece_start") else None
        started = time.perf_counter()
        if request.HasField("shm_worker"):
            yield await self._pull_shared(shard, piece, request, context)
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
            return
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:
            replies = await self._versions_of(shard, piece).get(request.min_version, wait_s)
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)

    async def _pull_shared(
        self, shard: PiecedShard, piece: int | None, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        """Copy the piece (at ``min_version`` or newer) into the worker's pull region; the header-only reply."""
        metadata = context.invocation_metadata()
        if self.gate.keys is not None:  # only the worker itself is answered through its regions
            self.gate.keys.require(metadata, "worker", request.shm_worker)
        pair = self.regions.pair(request.shm_worker, request.shm_nonce)
        source = self._source_of(shard, piece)
        where = self.regions.span(piece, source.numel)
        with self.gate.pull(metadata, context.peer(), context.time_remaining()) as wait_s:
            marks = self._marks.get(piece)
            if marks is None:
                marks = self._marks[piece] = _Versions(source, 1, asyncio.get_running_loop(), encode=False)
            await marks.get(request.min_version, wait_s)

        def put() -> int:
            with source.read(request.min_version, wait_s) as (version, published):
                self.regions.put(pair, where, published)
            return version

        version = await asyncio.to_thread(put)
        metrics.BYTES_PULLED.inc(source.numel * 4)
        return pb.PullReply(version=version).SerializeToString()

    @translate
    async def OpenSharedMemory(self, request: pb.ShmRequest, context: grpc.aio.ServicerContext) -> pb.ShmRegions:
        """A fresh pair of regions for the calling worker, if it is on this host and is who it says."""
        regions = self._check_shared(request, context)
        pair = await asyncio.to_thread(regions.open, request.worker_id, context.peer())
        return pb.ShmRegions(
            push_path=pair.push.path,
            pull_path=pair.pull.path,
            numel=regions.numel,
            header_bytes=HEADER_BYTES,
            nonce=pair.nonce,
        )

    @translate
    async def CloseSharedMemory(self, request: pb.ShmRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        regions = self._check_shared(request, context)
        await asyncio.to_thread(regions.release, request.worker_id)
        return pb.Empty()

    def _check_shared(self, request: pb.ShmRequest, context: grpc.aio.ServicerContext) -> SharedRegions:
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"shared memory for shard {request.shard_id} asked of shard {shard.shard_id}")
        if self.gate.keys is not None:  # issue 8: a peer without the worker's credential never gets a handle
            self.gate.keys.require(context.invocation_metadata(), "worker", request.worker_id)
        return self.regions

    def _source_of(self, shard: PiecedShard, piece: int | None) -> ParameterShard | PiecedShard:
        if piece is None:
            return shard
        found = next((p for p in shard.pieces if p.start == piece), None)
        if found is None:
            raise InvalidArgument(f"{piece} is not where a piece of shard {shard.shard_id} starts")
        return found

    def _versions_of(self, shard: PiecedShard, piece: int | None) -> _Versions:
        """Made by the first pull of the piece (or of the whole shard), on the event loop (the only thread that
        touches them after); ``InvalidArgument`` for a piece this shard does not have."""
        versions = self._versions.get(piece)
        if versions is None:
            source: ParameterShard | PiecedShard = shard
            if piece is not None:
                found = next((p for p in shard.pieces if p.start == piece), None)
                if found is None:
                    raise InvalidArgument(f"{piece} is not where a piece of shard {shard.shard_id} starts")
                source = found
            versions = self._versions[piece] = _Versions(source, self._chunk_bytes, asyncio.get_running_loop())
            self._versions_ready.set()
        return versions

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
        "OpenSharedMemory": grpc.unary_unary_rpc_method_handler(
            servicer.OpenSharedMemory,
            request_deserializer=pb.ShmRequest.FromString,
            response_serializer=pb.ShmRegions.SerializeToString,
        ),
        "CloseSharedMemory": grpc.unary_unary_rpc_method_handler(
            servicer.CloseSharedMemory,
            request_deserializer=pb.ShmRequest.FromString,
            response_serializer=pb.Empty.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(full_service_name("ParameterServer"), handlers),)
    )
