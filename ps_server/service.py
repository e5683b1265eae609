"""gRPC adapter for a shard's data plane: read the messages, check who calls, map errors to status codes.

Served by an asyncio server (``start_server(..., aio=True)``) and registered with
``add_parameter_server``, which installs the data plane's byte-level serializers
(``protos.codec``) for Push and Pull. Every handler is ``async`` on the server's event loop and
thin: the caller's identity is checked here, first, so a caller that is not who it says learns
nothing and costs no thread hop, no lock and no payload byte; a pull's admission (``ShardGate.pull``,
bounded per shard and per peer) is handed to the data plane, which enters it before it waits or
looks up a piece. The pushes and pulls themselves, over gRPC chunks, bulk sockets or shared memory,
are ``ShardDataPlane``'s (``ps_server.data_plane``), which tests drive without a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import CodecError, PushPart, decode_push_request
from pstrain.ps_server import metrics
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.bulk import BulkRefused, BulkSocket, BulkSockets, StaleBulk
from pstrain.ps_server.data_plane import Admit, PullCall, PushCall, ShardDataPlane
from pstrain.ps_server.errors import (
    InvalidArgument,
    NotReady,
    PayloadTimeout,
    StepConflict,
    UnknownWorker,
    WaitTimeout,
)
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import ParameterShard, PushResult
from pstrain.ps_server.shm import NotColocated, RegionPair, SharedRegions, StaleRegion
from pstrain.runtime.admission import Overloaded
from pstrain.runtime.identity import PermissionDenied
from pstrain.runtime.shm_region import HEADER_BYTES, ShmError
from pstrain.runtime.transport import abort_on_errors, full_service_name

translate = abort_on_errors(
    {
        InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownWorker: grpc.StatusCode.NOT_FOUND,
        StepConflict: grpc.StatusCode.FAILED_PRECONDITION,
        NotReady: grpc.StatusCode.UNAVAILABLE,
        WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
        PayloadTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
        Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
        NotColocated: grpc.StatusCode.FAILED_PRECONDITION,
        StaleRegion: grpc.StatusCode.ABORTED,
        ShmError: grpc.StatusCode.RESOURCE_EXHAUSTED,  # no room for a worker's regions: it streams instead
        BulkRefused: grpc.StatusCode.FAILED_PRECONDITION,
        StaleBulk: grpc.StatusCode.ABORTED,
    }
)


class ParameterServerServicer:
    """The ParameterServer service: messages in and out, identity and admission, errors as status codes."""

    def __init__(self) -> None:
        self.plane = ShardDataPlane()
        self.gate = ShardGate()  # issue 8: who may push and pull, how many pulls wait (pstrain-ps installs keys)

    # ------------------------------------------------------------------ the plane, as pstrain-ps and tests see it

    def attach(self, shard: ParameterShard | PiecedShard, chunk_bytes: int) -> None:
        """Called once the shard holds its initial parameters; until then RPCs are UNAVAILABLE."""
        self.plane.attach(shard, chunk_bytes)

    @property
    def shard(self) -> PiecedShard:
        return self.plane.shard

    @property
    def regions(self) -> SharedRegions:
        return self.plane.regions

    @property
    def bulk(self) -> BulkSockets:
        return self.plane.bulk

    @bulk.setter
    def bulk(self, sockets: BulkSockets) -> None:  # pstrain-ps: the job's bulk port, or off
        self.plane.bulk = sockets

    @property
    def shared_memory(self) -> bool:
        return self.plane.shared_memory

    @shared_memory.setter
    def shared_memory(self, on: bool) -> None:  # transport.shared_memory, before ``attach``
        self.plane.shared_memory = on

    @property
    def push_timeout_s(self) -> float:
        return self.plane.push_timeout_s

    @push_timeout_s.setter
    def push_timeout_s(self, seconds: float) -> None:  # the job's transport.push_timeout_s
        self.plane.push_timeout_s = seconds

    def close_shared_memory(self) -> None:
        """Unlink every shared-memory region and close the bulk port (the server stops); later opens are refused."""
        self.plane.close()

    @property
    def pulls_waiting(self) -> int:
        return self.plane.pulls_waiting

    def wait_until_pulls_waiting(self, count: int, timeout_s: float) -> bool:
        return self.plane.wait_until_pulls_waiting(count, timeout_s)

    # ------------------------------------------------------------------ push

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
        return await self._push(h, request_iterator, context)

    @translate
    async def PushBulk(self, h: pb.PushHeader, context: grpc.aio.ServicerContext) -> pb.PushReply:
        """Issue 12: a remote worker's push whose payload follows on its bulk socket, as one unary call (a ``Push``
        stream of one header costs both ends more CPU per piece). ``Push``'s checks in its order, and before the
        socket is taken, a refusal of what belongs to another transport."""
        self.gate.check_push(context.invocation_metadata(), h.worker_id, h.device_count)
        if not h.bulk_ticket or h.shm_nonce or h.pull_after or h.skip:
            raise InvalidArgument(
                "PushBulk carries a bulk_ticket and nothing of the other transports; a skip or a streamed "
                "payload goes through Push, a shared-memory piece through PushShared"
            )
        return await self._push(h, None, context)

    async def _push(
        self, h: pb.PushHeader, payload: AsyncIterator[PushPart] | None, context: grpc.aio.ServicerContext
    ) -> pb.PushReply:
        # Issue 12: a bulk push's payload follows on that socket, which this push owns until it ends; the socket
        # is kept only if the push read exactly its payload and succeeded, not as a duplicate (a refusal or a
        # duplicate leaves it unread, or a duplicate found after the read was not counted; either way the client
        # closes its end too, as after a refusal, which fails the call).
        bulk = self.bulk.take(h.bulk_ticket, h.worker_id) if h.bulk_ticket else None
        ok = False
        try:
            result = await self.plane.push(_push_call(h), bulk, payload, context.time_remaining)
            ok = not result.duplicate
            return _push_reply(result)
        finally:
            if bulk is not None:
                self.bulk.release(bulk, keep=bulk.moved and ok)

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
        if h.bulk_ticket:
            raise InvalidArgument("PushShared carries a shared-memory piece; bulk payloads go through PushBulk")
        reply = _push_reply(await self.plane.push_shared(_push_call(h)))
        if h.pull_after:
            started = time.perf_counter()
            pull = PullCall(h.shard_id, h.step + 1, h.piece_start, h.worker_id, h.shm_nonce)
            try:
                version, slot = await self.plane.pull_shared(pull, self._admit(context), board=True)
            except StaleRegion:  # the regions were replaced during the wait: the push stands, the worker pulls
                return reply
            reply.pulled.version = version
            if slot is not None:
                reply.pulled.board_slot = slot
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
        return reply

    @translate
    async def SetWorkers(self, request: pb.SetWorkersRequest, context: grpc.aio.ServicerContext) -> pb.SetWorkersReply:
        """Issue 11 (``cluster.min_workers``): the contributors from a step on; only the coordinator may say so."""
        if self.gate.keys is not None:
            self.gate.keys.require(context.invocation_metadata(), "coordinator", 0)
        every, some = await self.plane.set_workers(request.from_version, list(request.worker_ids), request.scaled_lr)
        return pb.SetWorkersReply(included_all=every, included_any=some)

    # ------------------------------------------------------------------ pull

    @translate
    async def PullShared(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullReply:
        """Issue 12: a colocated worker's pull into its pull region as one unary call (``Pull`` with ``shm_worker``
        answers the same, as a stream of one header-only reply)."""
        self._addressed(request.shard_id, "pull")
        if not request.HasField("shm_worker") or request.bulk_ticket:
            raise InvalidArgument("PullShared names the caller's pull region (shm_worker, shm_nonce) and nothing else")
        started = time.perf_counter()
        self._require_worker(context, request.shm_worker)  # only the worker itself is answered through its regions
        version, slot = await self.plane.pull_shared(_pull_call(request), self._admit(context), board=request.board)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)
        return pb.PullReply(version=version, board_slot=slot)

    @translate
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self._addressed(request.shard_id, "pull")
        started = time.perf_counter()
        if request.HasField("shm_worker"):
            self._require_worker(context, request.shm_worker)
            version, _ = await self.plane.pull_shared(_pull_call(request), self._admit(context))
            yield pb.PullReply(version=version).SerializeToString()
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
            return
        if request.bulk_ticket:
            # Closed with this stream (a call cancelled while its reply is sent): its socket is released at once.
            async with contextlib.aclosing(self._pull_bulk(request, context)) as sent:
                async for reply in sent:
                    yield reply
            metrics.PULL_SECONDS.observe(time.perf_counter() - started)
            return
        replies = await self.plane.pull_encoded(_pull_call(request), self._admit(context))
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)

    @translate
    async def PullBulk(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Issue 12: a remote worker's pull whose parameters go out on its bulk socket, as one unary call (``Pull``
        with a ``bulk_ticket`` answers the same, as a stream of one header-only reply)."""
        self._addressed(request.shard_id, "pull")
        if not request.bulk_ticket or request.HasField("shm_worker") or request.board:
            raise InvalidArgument("PullBulk names the caller's bulk socket (bulk_ticket, bulk_numel) and no region")
        started = time.perf_counter()
        (reply,) = [reply async for reply in self._pull_bulk(request, context)]
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)
        return reply

    async def _pull_bulk(
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[bytes, None]:
        """The parameters on the caller's bulk socket, then the header-only reply, encoded.

        The socket is kept only if the call succeeded (as the client keeps its end): for a ``Pull`` stream, once
        the reply is sent (gRPC resumes the stream after writing it); a unary ``PullBulk`` cannot see its reply
        written, so a reply lost after the return leaves this end idle, counted in its worker's cap, until a
        handshake at the cap reaps the idle sockets whose peer is gone (``BulkSockets``)."""
        bulk = self._take_for_pull(request, context)
        ok = False
        try:
            admit, limit_s = self._admit(context), self.gate.pulls.limits.max_wait_s
            version = await self.plane.pull_bulk(_pull_call(request), bulk, admit, context.time_remaining, limit_s)
            yield pb.PullReply(version=version).SerializeToString()
            ok = True
        finally:
            self.bulk.release(bulk, keep=bulk.moved and ok)

    @translate
    async def PullAt(self, request: pb.PullAtRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """S2.5: the whole shard at exactly ``request.version``, streamed in gRPC (a replacement's one pull)."""
        self._addressed(request.shard_id, "pull")
        replies = await self.plane.pull_at(request.version, self._admit(context))
        for index in range(len(replies)):
            yield replies[index]
        metrics.BYTES_PULLED.inc(replies.numel * 4)

    def _admit(self, context: grpc.aio.ServicerContext) -> Admit:
        """The caller's admission as a waiting pull (issue 8: bounded per shard and per peer, with a deadline)."""
        return functools.partial(
            self.gate.pull, context.invocation_metadata(), context.peer(), context.time_remaining()
        )

    def _addressed(self, shard_id: int, what: str) -> None:
        if shard_id != self.shard.shard_id:
            raise InvalidArgument(f"{what} for shard {shard_id} reached shard {self.shard.shard_id}")

    def _require_worker(self, context: grpc.aio.ServicerContext, worker_id: int) -> None:
        if self.gate.keys is not None:  # issue 8: a peer without the worker's credential gets nothing of its own
            self.gate.keys.require(context.invocation_metadata(), "worker", worker_id)

    def _take_for_pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> BulkSocket:
        """The caller's bulk socket: a member's credential first (an outsider learns nothing about tickets), then
        only the worker that owns the socket gets it (a peer that has seen a ticket cannot get it closed)."""
        if self.gate.keys is not None:
            self.gate.keys.verify(context.invocation_metadata())
        owner = self.bulk.owner(request.bulk_ticket)
        self._require_worker(context, owner)
        return self.bulk.take(request.bulk_ticket, owner)

    # ------------------------------------------------------------------ transports

    @translate
    async def OpenBulk(self, request: pb.BulkRequest, context: grpc.aio.ServicerContext) -> pb.BulkGrant:
        """A port and nonce for the calling worker's bulk sockets; refused over TLS (they are plaintext). Only the
        port: the client connects to the host it reached this server at (the shard's advertised address). The
        nonce is the credential's incarnation's: a replaced worker's old process holds sockets of its own."""
        self._addressed(request.shard_id, "bulk sockets")
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
        opening = asyncio.ensure_future(asyncio.to_thread(regions.open, request.worker_id, context.peer()))
        try:
            pair = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the worker gave up (its deadline) and streams: the pair would be held for
            opening.add_done_callback(_drop_opened(regions))  # nothing, named in /dev/shm for the shard's life
            raise
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
        self._addressed(request.shard_id, "shared memory")
        self._require_worker(context, request.worker_id)  # a peer without the worker's credential never gets a handle
        workers = self.shard.workers
        if not 0 <= request.worker_id < workers:  # without credentials any id passes above: each pair holds memory
            raise UnknownWorker(f"unknown worker {request.worker_id}: this job has workers 0..{workers - 1}")
        return self.regions

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


def _push_call(h: pb.PushHeader) -> PushCall:
    piece = h.piece_start if h.HasField("piece_start") else None
    return PushCall(h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel, piece, h.skip, h.shm_nonce)


def _push_reply(result: PushResult) -> pb.PushReply:
    return pb.PushReply(
        version=result.version, duplicate=result.duplicate, completed=result.completed, skipped=result.skipped
    )


def _pull_call(request: pb.PullRequest) -> PullCall:
    return PullCall(
        request.shard_id,
        request.min_version,
        request.piece_start if request.HasField("piece_start") else None,
        request.shm_worker if request.HasField("shm_worker") else None,
        request.shm_nonce,
        request.bulk_numel,
    )


def _as_is(message: bytes) -> bytes:
    """Pull replies leave the servicer already encoded (``EncodedReplies``)."""
    return message


def add_parameter_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Register the ParameterServer service with the data plane's serializers (for ``start_server``).

    The generated ``add_ParameterServerServicer_to_server`` would parse and build protobuf
    objects; these handlers take Push messages apart in place and send Pull replies as the
    bytes ``EncodedReplies`` made. The wire format is the same. Registered through ``start_server``,
    a request that does not parse is refused as INVALID_ARGUMENT (``runtime.transport.tolerant``).
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
        "PushBulk": grpc.unary_unary_rpc_method_handler(
            servicer.PushBulk,
            request_deserializer=pb.PushHeader.FromString,
            response_serializer=pb.PushReply.SerializeToString,
        ),
        "PullBulk": grpc.unary_unary_rpc_method_handler(
            servicer.PullBulk, request_deserializer=pb.PullRequest.FromString, response_serializer=_as_is
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
    name = full_service_name("ParameterServer")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)  # looked up by gRPC's core, as the generated adders do


def _drop_opened(regions: SharedRegions) -> Callable[[asyncio.Future[RegionPair]], None]:
    def drop(opened: asyncio.Future[RegionPair]) -> None:
        if not opened.cancelled() and opened.exception() is None:
            regions.drop(opened.result())

    return drop
