"""A shard's data plane: pushes taken in and pulls answered over every transport a worker may use.

The servicer (``service.py``) reads the messages, checks who calls and maps errors to status
codes; this holds the rest, on the server's event loop, and is driven without a network in tests:

* Push copies each chunk's payload into a staging buffer as it arrives (the bytes were already
  on the loop: gRPC's asyncio layer receives them there) and calls the shard in a worker thread,
  since the shard's lock may be held by an update. A bulk push's header sizes are checked on the loop; a bulk
  I/O thread then checks its step, reads its payload from the raw socket straight into the staging buffer
  (issue 12) and calls the shard: one thread hop.
* A worker on this host may have shared-memory regions (``ps_server.shm``); its pushes then carry
  only the header (the piece is in its push region) and its pulls are answered header-only (the
  piece is copied into its pull region, or named on the board). One thread hop per push, in
  which the shard checks the header and takes the piece.
* Pulls wait as suspended coroutines (``ps_server.versions``), not parked threads, so a shard
  serves any number of waiting workers; the admission the servicer hands in (``Admit``) bounds
  how many and how long.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import EncodedReplies, PushPart, TensorAssembler, torch_dtype
from pstrain.ps_server import metrics
from pstrain.ps_server.bulk import BulkSocket, BulkSockets
from pstrain.ps_server.errors import InvalidArgument, NotReady, PayloadTimeout
from pstrain.ps_server.pieces import PiecedShard, as_pieced
from pstrain.ps_server.shard import ParameterShard, PushResult
from pstrain.ps_server.shm import RegionPair, SharedRegions
from pstrain.ps_server.versions import StagingPool, VersionFollower, VersionMarks
from pstrain.ps_server.within import Within
from pstrain.runtime.bulk_socket import MIN_TIMEOUT_S

PUSHES_STAGED = 8  # pushes receiving at once, each into a shard-sized buffer; the rest wait unread
# A worker's client sends a shard at most two pieces at once in the common case (``runtime.ps_client``: a push pool of
# two threads per shard, pieces spread over the shards); fewer staging slots than that would slow its step.
PUSHES_PER_WORKER_MIN = 2
BULK_TIMEOUT_S = 600.0  # a bulk push's transfer, before pstrain-ps sets the job's transport.push_timeout_s
# Bulk payloads moving at once (each a blocking send, or a receive and then the shard's push); more wait their turn.
BULK_IO_THREADS = 16
# A bulk push holds its thread while the shard takes it, which may wait for the shard's lock (an update; a layerwise
# optimizer's norm exchange): staged pushes alone must never take every bulk thread, or pulls could not be sent.
assert PUSHES_STAGED < BULK_IO_THREADS
PULL_AT_THREADS = 2  # replacements reading a held version at once (rare: one per failed worker); more wait

Admit = Callable[[], AbstractContextManager[float]]
"""The servicer's admission of one waiting pull: entered for the wait, it gives the seconds the pull may wait."""

TimeLeft = Callable[[], float | None]
"""The call's time left (None: no deadline), read when a transfer starts."""


@dataclass(frozen=True)
class PushCall:
    """A push's header as the servicer read it off the wire (``PushHeader``)."""

    shard_id: int
    worker_id: int
    step: int
    device_count: int
    dtype: int  # ``pb.DType``: the job's push dtype (the shard checks it)
    numel: int
    piece: int | None = None  # where the piece starts; None: the whole shard
    skip: bool = False
    shm_nonce: bytes = b""


@dataclass(frozen=True)
class PullCall:
    """A pull as the servicer read it off the wire (``PullRequest``)."""

    shard_id: int
    min_version: int
    piece: int | None = None
    shm_worker: int | None = None
    shm_nonce: bytes = b""
    bulk_numel: int = 0


class ShardDataPlane:
    """One shard's pushes and pulls on the server's event loop; the caller has checked who calls.

    Holds what the transports share: the staging buffers and how many pushes receive at once, the
    version followers and marks the pulls wait on, the shared-memory regions and the bulk sockets.
    """

    def __init__(self) -> None:
        self._shard: PiecedShard | None = None
        self._pool = StagingPool()
        self.chunk_bytes = 0
        self._versions: dict[int | None, VersionFollower] = {}  # piece start (None: the whole shard) -> its follower
        self._versions_ready = threading.Event()
        self._staging_slots = asyncio.Semaphore(PUSHES_STAGED)  # binds to the server's loop on first use
        # Slots one worker's pushes may hold at once (``slots_per_worker``): a worker whose pushes stall cannot take
        # every slot from the others. Made on the loop by a worker's first push; worker ids are checked before.
        self._worker_slots: dict[int, asyncio.Semaphore] = {}
        self.shared_memory = True  # issue 12: offer colocated workers shared-memory regions (transport.shared_memory)
        self._regions: SharedRegions | None = None
        self._marks: dict[int | None, VersionMarks] = {}  # piece start (None: the whole shard) -> shm and bulk marks
        self.bulk = BulkSockets()  # issue 12: remote workers' payloads on raw sockets (``bulk.enabled = False``: off)
        # Bulk payloads move in threads of their own, never the loop's default executor (the checks and updates of
        # streamed and shared-memory pushes): a slow reader of pulls cannot starve those. Each move is bounded by
        # the job's timeouts; a bulk push's thread then waits for the shard to take it (``PUSHES_STAGED``).
        self._bulk_io = ThreadPoolExecutor(max_workers=BULK_IO_THREADS, thread_name_prefix="bulk-io")
        # A replacement's PullAt may wait for the live workers' pushes: never in the threads the pushes need.
        self._pull_at_io = ThreadPoolExecutor(max_workers=PULL_AT_THREADS, thread_name_prefix="pull-at")
        self.push_timeout_s = BULK_TIMEOUT_S  # pstrain-ps: the job's transport.push_timeout_s

    # ------------------------------------------------------------------ life

    def attach(self, shard: ParameterShard | PiecedShard, chunk_bytes: int) -> None:
        """Called once the shard holds its initial parameters; until then every call is ``NotReady``.

        A bare ``ParameterShard`` is served as a shard of one piece."""
        self.chunk_bytes = chunk_bytes
        shard = as_pieced(shard)
        self._shard = shard
        self._regions = SharedRegions(shard.start, shard.numel, self.shared_memory, len(shard.pieces))
        if self._regions.board is not None:
            shard.publish_on(self._regions.board)
        metrics.VERSION.set_function(lambda: shard.version)
        metrics.SHARD_BYTES.set_function(lambda: shard.snapshot().bytes_held)
        metrics.PUSHES_WAITING.set_function(lambda: shard.snapshot().pushes_waiting)
        metrics.PULLS_WAITING.set_function(lambda: self.pulls_waiting)

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

    def close(self) -> None:
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

    # ------------------------------------------------------------------ push

    async def push(
        self, h: PushCall, bulk: BulkSocket | None, payload: AsyncIterator[PushPart] | None, time_left: TimeLeft
    ) -> PushResult:
        """A push whose payload follows as chunks of ``payload``, on ``bulk``, or in the worker's push region
        (``payload`` None: a unary call, no chunks can follow)."""
        shard = self.shard
        piece = h.piece
        started = time.perf_counter()

        # The shard's calls go to a thread: they wait for its lock while an update holds it (a duplicate's
        # version, read under that lock, too: never on the loop).
        def duplicate_at() -> int | None:
            if not shard.check_push(
                h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel, piece_start=piece
            ):
                return None
            return shard.version if piece is None else shard.piece(piece, h.numel).version

        # A bulk push's step is checked by the bulk thread that then reads its payload (one thread hop in all, not
        # two; a duplicate's payload is left unread there as here, after it waited for a staging slot like any
        # push); what sizes its buffer is checked here, first.
        checked = bulk is None or h.skip
        if not checked:
            shard.check_header(h.shard_id, h.worker_id, h.device_count, h.dtype, h.numel, piece_start=piece)
        else:
            duplicate = await asyncio.to_thread(duplicate_at)
            if duplicate is not None:
                return PushResult(duplicate, duplicate=True, completed=False)
        if h.skip:
            if payload is not None and await anext(payload, None) is not None:
                raise InvalidArgument("a push that skips its step carries no payload")
            skip = functools.partial(shard.push, skip=True, piece_start=piece)
            skipping = asyncio.ensure_future(asyncio.to_thread(skip, h.worker_id, h.step, None, h.device_count))
            skipping.add_done_callback(self._moved_by(piece))
            return await skipping
        mine = self._slots_of(h.worker_id, shard.workers)
        await mine.acquire()
        try:
            await self._staging_slots.acquire()
        except BaseException:
            mine.release()
            raise

        def release_slots() -> None:
            self._staging_slots.release()
            mine.release()

        # Held until the push's thread is done (``_when_done``), not only until this call ends: a cancelled call's
        # thread still fills its buffer, and every thread a push holds is one fewer for the bulk pulls.
        try:
            buf = self._pool.acquire(h.numel, torch_dtype(h.dtype))  # h.dtype is the job's push dtype (checked)
        except BaseException:
            release_slots()
            raise
        # What arrives on the stream from here on arrives within the job's push timeout, or the push is refused and
        # its slot freed: a worker that opens a push and stops sending holds a slot that long at most.
        limit_s = bounded(time_left(), self.push_timeout_s)
        # In this task, not asyncio.wait_for's own: a cancel that came as the stream ended was lost there (before
        # Python 3.12), and a cancelled bulk push went on to wait for its payload, holding the worker's socket.
        received = Within(limit_s, functools.partial(_payload_timeout, limit_s, h.worker_id, self.push_timeout_s))
        pushing: asyncio.Future[PushResult] | None = None
        executor: ThreadPoolExecutor | None = None  # the loop's default
        adopted: list[torch.Tensor] = []  # the shard's old accumulator, if it kept ``buf`` as its new one
        lent = False  # the payload is read where it lies in the worker's push region (``ParameterShard.push``)
        try:
            take: Callable[[], torch.Tensor]
            if h.shm_nonce:  # the piece is in the worker's push region: copied out in the shard's thread
                pair, regions = self.regions.pair(h.worker_id, h.shm_nonce), self.regions
                where = regions.span(piece, h.numel)
                if buf.dtype == torch.float32:  # read in place: the shard keeps nothing after the push
                    take, lent = functools.partial(regions.view, pair, where), True
                else:
                    take = functools.partial(regions.take, pair, where, buf)
                if payload is not None and await received(anext(payload, None)) is not None:
                    raise InvalidArgument("a shared-memory push carries its header only")
            elif bulk is not None:  # issue 12: raw bytes on the bulk socket, read straight into the buffer
                if payload is not None and await received(anext(payload, None)) is not None:
                    raise InvalidArgument("a bulk push carries its header only")
                # Read by the bulk thread that then pushes.
                take = functools.partial(_received, bulk, buf, bounded(time_left(), self.push_timeout_s))
                executor = self._bulk_io
            else:
                if payload is None:
                    raise InvalidArgument("a push names its transport: chunks, a bulk socket or a push region")
                assembler = TensorAssembler(buf.dtype, h.numel, out=buf)
                await received(_assemble(payload, assembler))
                take = assembler.result

            def call() -> PushResult:
                if not checked:
                    duplicate = duplicate_at()
                    if duplicate is not None:
                        return PushResult(duplicate, duplicate=True, completed=False)
                grad = take()
                recycle = adopted.append if grad is buf else None
                return shard.push(
                    h.worker_id, h.step, grad, h.device_count, piece_start=piece, recycle=recycle, lent=lent
                )

            pushing = asyncio.get_running_loop().run_in_executor(executor, call)
            pushing.add_done_callback(self._moved_by(piece))
            # Shielded: a cancelled RPC must not hand the buffer to another push while the shard (or the
            # bulk socket) writes or reads it.
            result = await asyncio.shield(pushing)
        finally:
            _when_done(pushing, lambda: self._pool.release(adopted[0] if adopted else buf))
            _when_done(pushing, release_slots)
        if result.duplicate:
            return result
        metrics.BYTES_PUSHED.inc(h.numel * buf.element_size())
        _observe_push(started, result)
        return result

    def _slots_of(self, worker_id: int, workers: int) -> asyncio.Semaphore:
        slots = self._worker_slots.get(worker_id)
        if slots is None:
            slots = self._worker_slots[worker_id] = asyncio.Semaphore(slots_per_worker(workers))
        return slots

    async def push_shared(self, h: PushCall) -> PushResult:
        """A colocated worker's push of one piece whose payload is in its push region: one thread hop, in which the
        shard checks the header (a duplicate is acknowledged unread) and then the regions' nonce."""
        if not h.shm_nonce or h.skip or h.piece is None:
            raise InvalidArgument(
                "PushShared carries one piece's header naming the caller's push region (shm_nonce) and nothing else; "
                "skips and whole shards go through Push, bulk payloads through PushBulk"
            )
        shard, piece, regions = self.shard, h.piece, self.regions
        started = time.perf_counter()

        def call() -> PushResult:
            check = functools.partial(shard.check_push, piece_start=piece)
            if check(h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel):  # acknowledged unread
                return PushResult(shard.piece(piece, h.numel).version, duplicate=True, completed=False)
            pair = regions.pair(h.worker_id, h.shm_nonce)
            where = regions.span(piece, h.numel)
            if h.dtype == pb.FLOAT32:  # read in place: the shard keeps nothing after the push
                grad = regions.view(pair, where)  # lent for the call (``ParameterShard.push``)
                return shard.push(h.worker_id, h.step, grad, h.device_count, piece_start=piece, lent=True)
            buf = self._pool.acquire(h.numel, torch_dtype(h.dtype))  # bfloat16, widened in the region: narrowed back
            try:
                grad = regions.take(pair, where, buf)
                return shard.push(h.worker_id, h.step, grad, h.device_count, piece_start=piece)
            finally:
                self._pool.release(buf)

        await self._staging_slots.acquire()
        pushing: asyncio.Future[PushResult] | None = None
        try:
            pushing = asyncio.get_running_loop().run_in_executor(None, call)
            pushing.add_done_callback(self._moved_by(piece))
            # Shielded: a cancelled call leaves the shard reading the region (and the buffer) until it is done.
            result = await asyncio.shield(pushing)
        finally:
            _when_done(pushing, self._staging_slots.release)
        if not result.duplicate:
            metrics.BYTES_PUSHED.inc(h.numel * (4 if h.dtype == pb.FLOAT32 else 2))
        _observe_push(started, result)
        return result

    def _moved_by(self, piece: int | None) -> Callable[[asyncio.Future[PushResult]], None]:
        """A done-callback for a push in a thread: wake the pulls of what it moved on (even if the RPC was
        cancelled meanwhile). A whole-shard push may complete some pieces only: every piece is looked at."""

        def done(pushed: asyncio.Future[PushResult]) -> None:
            if pushed.cancelled() or pushed.exception() is not None:
                return
            if piece is None or pushed.result().completed:
                self._moved(piece)

        return done

    def _moved(self, piece: int | None) -> None:
        """A call that may have moved ``piece`` (None: any piece) to a new version has returned: wake its pulls and
        the whole shard's."""
        for start, marks in list(self._marks.items()):
            if piece is None or start is None or start == piece:
                marks.moved()

    async def set_workers(self, from_version: int, worker_ids: list[int], scaled_lr: float) -> tuple[bool, bool]:
        """Issue 11 (``cluster.min_workers``): the contributors from a step on."""
        call = functools.partial(self.shard.set_workers, from_version, worker_ids, scaled_lr)
        try:
            return await asyncio.to_thread(call)  # the pieces' locks may be held by an update
        finally:
            self._moved(None)  # a removal may have completed the step in flight

    # ------------------------------------------------------------------ pull

    async def pull_encoded(self, request: PullCall, admit: Admit) -> EncodedReplies:
        """The piece (or the whole shard) at ``min_version`` or newer, encoded once for every pull of it."""
        with admit() as wait_s:  # first: a caller refused learns nothing of the pieces and starts no follower
            return await self._versions_of(request.piece).get(request.min_version, wait_s)

    async def pull_at(self, version: int, admit: Admit) -> EncodedReplies:
        """S2.5: the whole shard at exactly ``version`` (a replacement's one pull)."""
        shard = self.shard
        with admit() as wait_s:

            def encode() -> EncodedReplies:
                with shard.read_at(version, wait_s) as params:
                    return EncodedReplies(version, params, self.chunk_bytes).encode_all()

            return await asyncio.get_running_loop().run_in_executor(self._pull_at_io, encode)

    async def pull_shared(self, request: PullCall, admit: Admit, board: bool = False) -> tuple[int, int | None]:
        """Copy the piece (at ``min_version`` or newer) into the worker's pull region: (its version, None). With
        ``board``, a piece whose version is on the published board is not copied: (version, its board slot); so is a
        whole shard of one piece."""
        if request.shm_worker is None:
            raise InvalidArgument("a shared-memory pull names the caller's pull region (shm_worker, shm_nonce)")
        shard, piece = self.shard, request.piece
        pair: RegionPair = self.regions.pair(request.shm_worker, request.shm_nonce)
        source = self._source_of(piece)
        where = self.regions.span(piece, source.numel)
        with admit() as wait_s:
            await self._marks_of(piece, source).get(request.min_version, wait_s)
        slot_piece = piece
        if slot_piece is None and len(shard.pieces) == 1:  # a whole shard of one piece is that piece on the board
            slot_piece = shard.pieces[0].start
        if board and slot_piece is not None:
            found = shard.board_slot(slot_piece, request.min_version)
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

    async def pull_bulk(
        self, request: PullCall, bulk: BulkSocket, admit: Admit, time_left: TimeLeft, limit_s: float
    ) -> int:
        """Send the piece (at ``min_version`` or newer) as raw bytes on the caller's bulk socket, straight from the
        published buffer; returns its version once every byte is written. The pull holds its admission until then,
        and the send is bounded by ``limit_s`` (the job's pull timeout) whatever the caller's deadline."""
        source = self._source_of(request.piece)
        if request.bulk_numel != source.numel:  # before a byte is sent: the socket is closed, nothing is left on it
            raise InvalidArgument(
                f"a bulk pull reads {request.bulk_numel} elements; this piece of shard {self.shard.shard_id} has "
                f"{source.numel}"
            )
        with admit() as wait_s:
            await self._marks_of(request.piece, source).get(request.min_version, wait_s)

            def send() -> int:
                with source.read(request.min_version, wait_s) as (version, published):
                    bulk.send(published, bounded(time_left(), limit_s))
                return version

            version = await asyncio.get_running_loop().run_in_executor(self._bulk_io, send)
        metrics.BYTES_PULLED.inc(source.numel * 4)
        return version

    def _marks_of(self, piece: int | None, source: ParameterShard | PiecedShard) -> VersionMarks:
        marks = self._marks.get(piece)
        if marks is None:
            marks = self._marks[piece] = VersionMarks(source)
        return marks

    def _source_of(self, piece: int | None) -> ParameterShard | PiecedShard:
        shard = self.shard
        if piece is None:
            return shard
        found = next((p for p in shard.pieces if p.start == piece), None)
        if found is None:
            raise InvalidArgument(f"{piece} is not where a piece of shard {shard.shard_id} starts")
        return found

    def _versions_of(self, piece: int | None) -> VersionFollower:
        """Made by the first pull of the piece (or of the whole shard), on the event loop (the only thread that
        touches them after); ``InvalidArgument`` for a piece this shard does not have."""
        versions = self._versions.get(piece)
        if versions is None:
            source = self._source_of(piece)
            versions = self._versions[piece] = VersionFollower(source, self.chunk_bytes, asyncio.get_running_loop())
            self._versions_ready.set()
        return versions


def slots_per_worker(workers: int) -> int:
    """The staging slots one worker's pushes may hold at once: its share of ``PUSHES_STAGED`` among the job's
    ``workers``, and never fewer than its client sends at once in the common case (``PUSHES_PER_WORKER_MIN``).

    A worker past it waits, unread, for one of its own pushes to finish, never for another worker's. Only the pushes
    whose payload the worker sends while holding the slot count (``push``); a ``PushShared`` holds one only while the
    shard takes a piece already in its region, which the worker cannot slow."""
    share = math.ceil(PUSHES_STAGED / max(1, workers))
    return min(PUSHES_STAGED, max(PUSHES_PER_WORKER_MIN, share))


async def _assemble(payload: AsyncIterator[PushPart], assembler: TensorAssembler) -> None:
    async for part in payload:
        if part.chunk is None:
            raise InvalidArgument("a push stream carries one PushHeader followed by chunks only")
        assembler.add(part.chunk)


def _payload_timeout(limit_s: float, worker_id: int, push_timeout_s: float) -> PayloadTimeout:
    """What a push whose payload stopped arriving is told (``Within``'s error once the limit passes)."""
    return PayloadTimeout(
        f"worker {worker_id}'s push payload did not arrive within {limit_s:.1f} s of its staging "
        f"slot (transport.push_timeout_s is {push_timeout_s:g} s, or the call's deadline came first); "
        "the slot is free again: send the whole payload, then close the stream"
    )


def _when_done(work: asyncio.Future[PushResult] | None, release: Callable[[], object]) -> None:
    """Call ``release`` once ``work`` (a push's thread, on the loop) is done, at once if it is or never started."""
    if work is None or work.done():
        release()
    else:
        work.add_done_callback(lambda _: release())


def _observe_push(started: float, result: PushResult) -> None:
    metrics.PUSH_SECONDS.observe(time.perf_counter() - started)
    if result.completed:
        metrics.UPDATE_SECONDS.observe(result.update_s)


def _received(bulk: BulkSocket, buf: torch.Tensor, timeout_s: float) -> torch.Tensor:
    bulk.receive(buf, timeout_s)
    return buf


def bounded(remaining_s: float | None, limit_s: float) -> float:
    """A bulk move's timeout: the call's time left (None: no deadline) within the job's limit; a deadline already
    past leaves the least positive timeout, so the move fails as a timeout."""
    return max(MIN_TIMEOUT_S, limit_s if remaining_s is None else min(remaining_s, limit_s))
