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
  A piece's push and pull are then unary calls (``PushShared``, ``PullShared``: no stream, one
  thread hop per push, no follower thread: ``_Marks``), the cheapest gRPC calls there are; where the
  shard publishes on its board, one call does both (``PushShared`` with ``pull_after``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

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
from pstrain.ps_server.bulk import BulkRefused, BulkSocket, BulkSockets, StaleBulk
from pstrain.ps_server.errors import InvalidArgument, NotReady, PsError, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.pieces import PiecedShard, as_pieced
from pstrain.ps_server.shard import ParameterShard, PushResult
from pstrain.ps_server.shm import NotColocated, SharedRegions, StaleRegion
from pstrain.runtime.admission import Overloaded
from pstrain.runtime.bulk_socket import MIN_TIMEOUT_S
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
        BulkRefused: grpc.StatusCode.FAILED_PRECONDITION,
        StaleBulk: grpc.StatusCode.ABORTED,
    }
)

PUSHES_STAGED = 8  # pushes receiving at once, each into a shard-sized buffer; the rest wait unread
FOLLOW_POLL_S = 1.0  # how often the version follower looks whether its server has stopped
BULK_TIMEOUT_S = 600.0  # a bulk push's transfer, before pstrain-ps sets the job's transport.push_timeout_s
BULK_IO_THREADS = 16  # bulk payloads moving at once (each a blocking send or receive); more wait their turn
PULL_AT_THREADS = 2  # replacements reading a held version at once (rare: one per failed worker); more wait


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

    The thread follows on demand (issue 12): once a version is out and no pull waits or has asked
    since, it idles until the next pull instead of reading (for a whole shard: joining its pieces)
    and encoding every later version for nobody. A pull that finds it idle waits for a version read
    after it asked, so it gets the shard's newest, as it would from a busy follower. In steady
    training every step's pulls keep it busy; what idles is, say, the whole-shard follower the
    workers' first pull made, which would otherwise copy the shard twice per step for the whole run.
    """

    def __init__(
        self,
        shard: ParameterShard | PiecedShard,
        chunk_bytes: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._shard = shard
        self._chunk_bytes = chunk_bytes
        self._loop = loop
        self._latest: EncodedReplies | None = None
        self._closed: str | None = None
        self._changed = asyncio.Event()
        self._waiting = 0
        self._waiting_changed = threading.Condition()
        self._demand = threading.Event()  # a pull asked since the follower last read a version
        self._idle = False  # the follower waits for demand: ``_latest`` may be older than the shard
        self._posts = 0  # versions handed to the loop (loop side)
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
        self._demand.set()
        fresh_after = self._posts if self._idle else -1  # idle: only a version read from now on is the newest
        self._count_waiting(+1)
        try:
            while True:
                if self._closed is not None:
                    raise NotReady(self._closed)
                latest = self._latest
                if latest is not None and latest.version >= min_version and self._posts > fresh_after:
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
            if want and not self._demand.is_set() and not self.waiting:
                self._idle = True
                if not self._demand.wait(FOLLOW_POLL_S):
                    continue  # looks again whether the server has stopped
                self._idle, want = False, 0  # the newest version, whichever it is
            self._demand.clear()
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
            self._posts += 1
        self._changed.set()  # wakes the pulls waiting now; later ones wait on a fresh event
        self._changed = asyncio.Event()


class _Marks:
    """When a piece (or the whole shard) reaches a version, as shared-memory and bulk pulls wait for it (issue 12).

    Those pulls need no encoding, so no follower thread either: they wait on the loop for an event the servicer sets
    after every call that may move the shard on (a push that completed a piece, ``SetWorkers``), and read the
    version without the shard's lock (``version_now``). A waiting pull also looks every ``FOLLOW_POLL_S``, so a
    version reached some other way is seen within that time. No thread wakes per version and per piece, and a pull
    that finds its version already there does not wait at all.
    """

    def __init__(self, source: ParameterShard | PiecedShard) -> None:
        self._source = source
        self._changed = asyncio.Event()

    async def get(self, min_version: int, timeout_s: float) -> None:
        """Return once the source is at ``min_version`` or newer (``NotReady`` once closed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (version := self._source.version_now) < min_version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WaitTimeout(
                    f"shard {self._source.shard_id} is at version {version}; version {min_version} did not appear "
                    f"within {timeout_s:.1f}s (are all {self._source.workers} workers pushing?)"
                )
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, FOLLOW_POLL_S))

    def moved(self) -> None:
        """The source may be at a newer version (on the loop): the waiting pulls look again."""
        self._changed.set()
        self._changed = asyncio.Event()


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
        self._marks: dict[int | None, _Marks] = {}  # piece start (None: the whole shard) -> shm and bulk pulls' marks
        self.bulk = BulkSockets()  # issue 12: remote workers' payloads on raw sockets (``bulk.enabled = False``: off)
        # Bulk payloads move in threads of their own, never the loop's default executor (the pushes' checks and
        # updates): a slow reader of pulls cannot starve pushes. Each move is bounded by the job's timeouts.
        self._bulk_io = ThreadPoolExecutor(max_workers=BULK_IO_THREADS, thread_name_prefix="bulk-io")
        # A replacement's PullAt may wait for the live workers' pushes: never in the threads the pushes need.
        self._pull_at_io = ThreadPoolExecutor(max_workers=PULL_AT_THREADS, thread_name_prefix="pull-at")
        self.push_timeout_s = BULK_TIMEOUT_S  # pstrain-ps: the job's transport.push_timeout_s

    def attach(self, shard: ParameterShard | PiecedShard, chunk_bytes: int) -> None:
        """Called once the shard holds its initial parameters; until then RPCs are UNAVAILABLE.

        A bare ``ParameterShard`` is served as a shard of one piece."""
        self._chunk_bytes = chunk_bytes
        shard = as_pieced(shard)
        self._shard = shard
        self._regions = SharedRegions(shard.start, shard.numel, self.shared_memory, len(shard.pieces))
        if self._regions.board is not None:
            shard.publish_on(self._regions.board)
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
        """Unlink every shared-memory region and close the bulk port (the server stops); later opens are refused."""
        self.bulk.close()
        self._bulk_io.shutdown(wait=False, cancel_futures=True)
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
        first = await anext(request_iterator, None)
        if first is None or first.header is None:
            raise InvalidArgument("a push stream must start with a PushHeader")
        h = first.header
        # Issue 8: who pushes comes first: a caller that is not worker ``h.worker_id`` (or claims more devices than
        # the job's) is refused here, on the loop, before a thread hop, the shard's lock, a bulk socket or a payload
        # byte; refusing costs one MAC, and an unauthenticated caller learns nothing about the rest of its push.
        self.gate.check_push(context.invocation_metadata(), h.worker_id, h.device_count)
        if h.pull_after:
            raise InvalidArgument("pull_after is for PushShared (a colocated worker's piece); a Push stream cannot")
        # Issue 12: a bulk push's payload follows on that socket, which this push owns until it ends; the socket
        # is kept only if the push read exactly its payload and succeeded (a refusal or a duplicate leaves it
        # unread; a refusal after the read fails the call, and the client then closes its end too).
        bulk = self.bulk.take(h.bulk_ticket, h.worker_id) if h.bulk_ticket else None
        ok = False
        try:
            reply = await self._push(h, bulk, request_iterator, context)
            ok = True
            return reply
        finally:
            if bulk is not None:
                self.bulk.release(bulk, keep=bulk.moved and ok)

    async def _push(
        self,
        h: pb.PushHeader,
        bulk: BulkSocket | None,
        request_iterator: AsyncIterator[PushPart],
        context: grpc.aio.ServicerContext,
    ) -> pb.PushReply:
        shard = self.shard
        started = time.perf_counter()
        piece = h.piece_start if h.HasField("piece_start") else None
        # The shard's calls go to a thread: they wait for its lock while an update holds it.
        check = functools.partial(shard.check_push, piece_start=piece)
        duplicate = await asyncio.to_thread(check, h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel)
        if duplicate:
            version = shard.version if piece is None else shard.piece(piece, h.numel).version
            return pb.PushReply(version=version, duplicate=True)
        if h.skip:
            if await anext(request_iterator, None) is not None:
                raise InvalidArgument("a push that skips its step carries no payload")
            skip = functools.partial(shard.push, skip=True, piece_start=piece)
            skipping = asyncio.ensure_future(asyncio.to_thread(skip, h.worker_id, h.step, None, h.device_count))
            skipping.add_done_callback(self._moved_by(piece))
            result = await skipping
            return pb.PushReply(version=result.version, completed=result.completed, skipped=result.skipped)
        async with self._staging_slots:
            buf = self._pool.acquire(h.numel, torch_dtype(h.dtype))  # h.dtype is the job's push dtype (checked)
            pushing: asyncio.Future[PushResult] | None = None
            receiving: asyncio.Future[torch.Tensor] | None = None
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
                elif bulk is not None:  # issue 12: raw bytes on the bulk socket, read straight into the buffer
                    if await anext(request_iterator, None) is not None:
                        raise InvalidArgument("a bulk push carries its header only")
                    # Read in a bulk thread, shielded: a cancelled push keeps its buffer until the read has ended.
                    timeout_s = _bounded(context.time_remaining(), self.push_timeout_s)
                    receiving = asyncio.get_running_loop().run_in_executor(
                        self._bulk_io, _received, bulk, buf, timeout_s
                    )
                    await asyncio.shield(receiving)
                    take = receiving.result
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
                pushing.add_done_callback(self._moved_by(piece))
                # Shielded: a cancelled RPC must not hand the buffer to another push while the shard reads it.
                result = await asyncio.shield(pushing)
            finally:
                running = next((f for f in (receiving, pushing) if f is not None and not f.done()), None)
                if running is None:
                    self._pool.release(buf)
                else:
                    running.add_done_callback(lambda _: self._pool.release(buf))
        metrics.BYTES_PUSHED.inc(h.numel * buf.element_size())
        metrics.PUSH_SECONDS.observe(time.perf_counter() - started)
        if result.completed:
            metrics.UPDATE_SECONDS.observe(result.update_s)
        return pb.PushReply(
            version=result.version, duplicate=result.duplicate, completed=result.completed, skipped=result.skipped
        )

    @translate
    async def PushShared(self, h: pb.PushHeader, context: grpc.aio.ServicerContext) -> pb.PushReply:
        """Issue 12: a colocated worker's push of one piece whose payload is in its push region: one unary call and
        one thread hop, in which the shard checks the header and takes the piece. Same checks as ``Push``, in the
        same order: the caller's identity (on the loop), the shard's header checks (a duplicate is acknowledged
        unread), then the regions' nonce.

        With ``pull_after`` the call then waits for the piece's next version, as ``PullShared`` with ``board`` of
        ``step + 1`` would, and answers it in ``pulled``: a worker's push and pull of a piece are one call, not two
        (each call costs both ends a few hundred microseconds of CPU on a host whose cores train). The push is
        taken before the wait, so a call that fails while waiting has still pushed (a repeat is a duplicate); if
        the worker's regions are replaced during the wait, the reply has no ``pulled`` and the worker pulls."""
        self.gate.check_push(context.invocation_metadata(), h.worker_id, h.device_count)
        if not h.shm_nonce or h.bulk_ticket or h.skip or not h.HasField("piece_start"):
            raise InvalidArgument(
                "PushShared carries one piece's header naming the caller's push region (shm_nonce) and nothing else; "
                "skips, whole shards and bulk payloads go through Push"
            )
        shard = self.shard
        started = time.perf_counter()
        piece = h.piece_start
        regions = self.regions

        def call() -> PushResult:
            check = functools.partial(shard.check_push, piece_start=piece)
            if check(h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel):  # acknowledged unread
                return PushResult(shard.piece(piece, h.numel).version, duplicate=True, completed=False)
            pair = regions.pair(h.worker_id, h.shm_nonce)
            where = regions.span(piece, h.numel)
            if h.dtype == pb.FLOAT32:  # read in place: the shard keeps nothing after the push
                return shard.push(h.worker_id, h.step, regions.view(pair, where), h.device_count, piece_start=piece)
            buf = self._pool.acquire(h.numel, torch_dtype(h.dtype))  # bfloat16, widened in the region: narrowed back
            try:
                grad = regions.take(pair, where, buf)
                return shard.push(h.worker_id, h.step, grad, h.device_count, piece_start=piece)
            finally:
                self._pool.release(buf)

        async with self._staging_slots:
            pushing = asyncio.get_running_loop().run_in_executor(None, call)
            pushing.add_done_callback(self._moved_by(piece))
            # Shielded: a cancelled call leaves the shard reading the region (and the buffer) until it is done.
            result = await asyncio.shield(pushing)
        if not result.duplicate:
            metrics.BYTES_PUSHED.inc(h.numel * (4 if h.dtype == pb.FLOAT32 else 2))
        metrics.PUSH_SECONDS.observe(time.perf_counter() - started)
        if result.completed:
            metrics.UPDATE_SECONDS.observe(result.update_s)
        reply = pb.PushReply(
            version=result.version, duplicate=result.duplicate, completed=result.completed, skipped=result.skipped
        )
        if h.pull_after:
            started = time.perf_counter()
            pull = pb.PullRequest(
                shard_id=h.shard_id,
                min_version=h.step + 1,
                piece_start=piece,
                shm_worker=h.worker_id,
                shm_nonce=h.shm_nonce,
                board=True,
            )
            try:
                version, slot = await self._pull_shared(shard, piece, pull, context, board=True)
            except StaleRegion:  # the regions were replaced during the wait: the push stands, the worker pulls
                return reply
            reply.pulled.version = version
            if slot is not None:
                reply.pulled.board_slot = slot
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
        return reply

    def _moved_by(self, piece: int | None) -> Callable[[asyncio.Future[PushResult]], None]:
        """A done-callback for a push in a thread: wake the pulls of what it moved on (even if the RPC was
        cancelled meanwhile). A whole-shard push may complete some pieces only: every piece is looked at."""

        def done(pushed: asyncio.Future[PushResult]) -> None:
            if pushed.cancelled() or pushed.exception() is not None:
                return
            if piece is None or pushed.result().completed:
                self._moved(piece)

        return done

    @translate
    async def PullShared(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullReply:
        """Issue 12: a colocated worker's pull into its pull region as one unary call (``Pull`` with ``shm_worker``
        answers the same, as a stream of one header-only reply)."""
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"pull for shard {request.shard_id} reached shard {shard.shard_id}")
        if not request.HasField("shm_worker") or request.bulk_ticket:
            raise InvalidArgument("PullShared names the caller's pull region (shm_worker, shm_nonce) and nothing else")
        started = time.perf_counter()
        piece = request.piece_start if request.HasField("piece_start") else None
        version, slot = await self._pull_shared(shard, piece, request, context, board=request.board)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)
        return pb.PullReply(version=version, board_slot=slot)

    @translate
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"pull for shard {request.shard_id} reached shard {shard.shard_id}")
        piece = request.piece_start if request.HasField("piece_start") else None
        started = time.perf_counter()
        if request.HasField("shm_worker"):
            version, _ = await self._pull_shared(shard, piece, request, context)
            yield pb.PullReply(version=version).SerializeToString()
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
            return
        if request.bulk_ticket:
            bulk = self._take_for_pull(request, context)
            ok = False
            try:  # the socket is kept only if the call succeeded, reply included (as the client keeps its end)
                yield await self._pull_bulk(shard, piece, request, bulk, context)
                ok = True
            finally:
                self.bulk.release(bulk, keep=bulk.moved and ok)
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
            return
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:
            replies = await self._versions_of(shard, piece).get(request.min_version, wait_s)
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)

    @translate
    async def PullAt(self, request: pb.PullAtRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """S2.5: the whole shard at exactly ``request.version``, streamed in gRPC (a replacement's one pull)."""
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"pull for shard {request.shard_id} reached shard {shard.shard_id}")
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:

            def encode() -> EncodedReplies:
                with shard.read_at(request.version, wait_s) as params:
                    return EncodedReplies(request.version, params, self._chunk_bytes).encode_all()

            replies = await asyncio.get_running_loop().run_in_executor(self._pull_at_io, encode)
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)

    async def _pull_shared(
        self,
        shard: PiecedShard,
        piece: int | None,
        request: pb.PullRequest,
        context: grpc.aio.ServicerContext,
        board: bool = False,
    ) -> tuple[int, int | None]:
        """Copy the piece (at ``min_version`` or newer) into the worker's pull region: (its version, None). With
        ``board``, a piece whose version is on the published board is not copied: (version, its board slot)."""
        metadata = context.invocation_metadata()
        if self.gate.keys is not None:  # only the worker itself is answered through its regions
            self.gate.keys.require(metadata, "worker", request.shm_worker)
        pair = self.regions.pair(request.shm_worker, request.shm_nonce)
        source = self._source_of(shard, piece)
        where = self.regions.span(piece, source.numel)
        with self.gate.pull(metadata, context.peer(), context.time_remaining()) as wait_s:
            await self._marks_of(piece, source).get(request.min_version, wait_s)
        if board and piece is not None:
            found = shard.board_slot(piece, request.min_version)
            if found is not None:  # the worker copies it out of the board itself (and checks the stamp)
                metrics.BYTES_PULLED.inc(source.numel * 4)
                return found

        def put() -> int:
            with source.read(request.min_version, wait_s) as (version, published):
                self.regions.put(pair, where, published)
            return version

        version = await asyncio.to_thread(put)
        metrics.BYTES_PULLED.inc(source.numel * 4)
        return version, None

    def _marks_of(self, piece: int | None, source: ParameterShard | PiecedShard) -> _Marks:
        marks = self._marks.get(piece)
        if marks is None:
            marks = self._marks[piece] = _Marks(source)
        return marks

    def _moved(self, piece: int | None) -> None:
        """A call that may have moved ``piece`` (None: any piece) to a new version has returned: wake its pulls and
        the whole shard's."""
        for start, marks in list(self._marks.items()):
            if piece is None or start is None or start == piece:
                marks.moved()

    def _take_for_pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> BulkSocket:
        """The caller's bulk socket: a member's credential first (an outsider learns nothing about tickets), then
        only the worker that owns the socket gets it (a peer that has seen a ticket cannot get it closed)."""
        metadata = context.invocation_metadata()
        if self.gate.keys is not None:
            self.gate.keys.verify(metadata)
        owner = self.bulk.owner(request.bulk_ticket)
        if self.gate.keys is not None:
            self.gate.keys.require(metadata, "worker", owner)
        return self.bulk.take(request.bulk_ticket, owner)

    async def _pull_bulk(
        self,
        shard: PiecedShard,
        piece: int | None,
        request: pb.PullRequest,
        bulk: BulkSocket,
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        """Send the piece (at ``min_version`` or newer) as raw bytes on the caller's bulk socket, straight from the
        published buffer; the header-only reply follows once every byte is written. The pull holds its admission
        (``gate.pull``) until then, and the send is bounded by the job's pull timeout whatever the caller's."""
        source = self._source_of(shard, piece)
        if request.bulk_numel != source.numel:  # before a byte is sent: the socket is closed, nothing is left on it
            raise InvalidArgument(
                f"a bulk pull reads {request.bulk_numel} elements; this piece of shard {shard.shard_id} has "
                f"{source.numel}"
            )
        with self.gate.pull(context.invocation_metadata(), context.peer(), context.time_remaining()) as wait_s:
            await self._marks_of(piece, source).get(request.min_version, wait_s)

            def send() -> int:
                with source.read(request.min_version, wait_s) as (version, published):
                    bulk.send(published, _bounded(context.time_remaining(), self.gate.pulls.limits.max_wait_s))
                return version

            version = await asyncio.get_running_loop().run_in_executor(self._bulk_io, send)
        metrics.BYTES_PULLED.inc(source.numel * 4)
        return pb.PullReply(version=version).SerializeToString()

    @translate
    async def OpenBulk(self, request: pb.BulkRequest, context: grpc.aio.ServicerContext) -> pb.BulkGrant:
        """A port and nonce for the calling worker's bulk sockets; refused over TLS (they are plaintext). Only the
        port: the client connects to the host it reached this server at (the shard's advertised address). The
        nonce is the credential's incarnation's: a replaced worker's old process holds sockets of its own."""
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"bulk sockets for shard {request.shard_id} asked of shard {shard.shard_id}")
        incarnation = 0
        if self.gate.keys is not None:  # a peer without the worker's credential never gets a nonce
            incarnation = self.gate.keys.require(context.invocation_metadata(), "worker", request.worker_id).incarnation
        if context.auth_context().get("transport_security_type") != [b"insecure"]:
            raise BulkRefused("bulk sockets are plaintext: a TLS channel streams its tensors over gRPC")
        port, nonce = await asyncio.to_thread(self.bulk.grant, request.worker_id, incarnation)
        return pb.BulkGrant(port=port, nonce=nonce)

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
            board_path=regions.board.path if regions.board is not None else "",
            board_pieces=regions.board.pieces if regions.board is not None else 0,
            board_nonce=regions.board.nonce if regions.board is not None else b"",
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
    async def SetWorkers(self, request: pb.SetWorkersRequest, context: grpc.aio.ServicerContext) -> pb.SetWorkersReply:
        """Issue 11 (``cluster.min_workers``): the contributors from a step on; only the coordinator may say so."""
        if self.gate.keys is not None:
            self.gate.keys.require(context.invocation_metadata(), "coordinator", 0)
        shard = self.shard
        call = functools.partial(shard.set_workers, request.from_version, list(request.worker_ids), request.scaled_lr)
        try:
            every, some = await asyncio.to_thread(call)  # the pieces' locks may be held by an update
        finally:
            self._moved(None)  # a removal may have completed the step in flight
        return pb.SetWorkersReply(included_all=every, included_any=some)

    @translate
    def GetShardStatus(self, request: pb.ShardStatusRequest, context: grpc.ServicerContext) -> pb.ShardStatus:
        shard = self.shard
        s = shard.snapshot()
        if request.HasField("worker_id") and not 0 <= request.worker_id < shard.workers:
            raise UnknownWorker(f"unknown worker {request.worker_id}: this job has workers 0..{shard.workers - 1}")
        return pb.ShardStatus(
            shard_id=s.shard_id,
            start=s.start,
            end=s.end,
            version=s.version,
            pushes_waiting=s.pushes_waiting,
            workers_expected=s.workers_expected,
            bytes_held=s.bytes_held,
            optimizer=s.optimizer,
            worker_step=shard.last_step_of(request.worker_id) if request.HasField("worker_id") else None,
        )


def _as_is(message: bytes) -> bytes:
    """Pull replies leave the servicer already encoded (``EncodedReplies``)."""
    return message


def _received(bulk: BulkSocket, buf: torch.Tensor, timeout_s: float) -> torch.Tensor:
    bulk.receive(buf, timeout_s)
    return buf


def _bounded(remaining_s: float | None, limit_s: float) -> float:
    """A bulk move's timeout: the call's time left (None: no deadline) within the job's limit; a deadline already
    past leaves the least positive timeout, so the move fails as a timeout."""
    return max(MIN_TIMEOUT_S, limit_s if remaining_s is None else min(remaining_s, limit_s))


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
        "PullAt": grpc.unary_stream_rpc_method_handler(
            servicer.PullAt, request_deserializer=pb.PullAtRequest.FromString, response_serializer=_as_is
        ),
        "PushShared": grpc.unary_unary_rpc_method_handler(
            servicer.PushShared,
            request_deserializer=pb.PushHeader.FromString,
            response_serializer=pb.PushReply.SerializeToString,
        ),
        "PullShared": grpc.unary_unary_rpc_method_handler(
            servicer.PullShared,
            request_deserializer=pb.PullRequest.FromString,
            response_serializer=pb.PullReply.SerializeToString,
        ),
        "SetWorkers": grpc.unary_unary_rpc_method_handler(
            servicer.SetWorkers,
            request_deserializer=pb.SetWorkersRequest.FromString,
            response_serializer=pb.SetWorkersReply.SerializeToString,
        ),
        "GetShardStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetShardStatus,
            request_deserializer=pb.ShardStatusRequest.FromString,
            response_serializer=pb.ShardStatus.SerializeToString,
        ),
        "OpenBulk": grpc.unary_unary_rpc_method_handler(
            servicer.OpenBulk,
            request_deserializer=pb.BulkRequest.FromString,
            response_serializer=pb.BulkGrant.SerializeToString,
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
