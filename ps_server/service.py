"""gRPC adapter for a ParameterShard: translate messages, call the shard, map errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import CodecError, TensorAssembler, encode_chunks
from pstrain.ps_server import metrics
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.transport import abort_on_errors

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


class _StagingPool:
    """Reuses the buffers pushes are received into: a 100 MB allocation per push costs page faults."""

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


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(self) -> None:
        self._shard: ParameterShard | None = None
        self._pool: _StagingPool | None = None
        self._chunk_bytes = 0

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

    @translate
    def Push(self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext) -> pb.PushReply:
        shard = self.shard
        started = time.perf_counter()
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("a push stream must start with a PushHeader")
        h = first.header
        if shard.check_push(h.shard_id, h.worker_id, h.step, h.device_count, h.dtype, h.numel):
            return pb.PushReply(version=shard.version, duplicate=True)
        if h.skip:
            if next(request_iterator, None) is not None:
                raise InvalidArgument("a push that skips its step carries no payload")
            result = shard.push(h.worker_id, h.step, None, h.device_count, skip=True)
            return pb.PushReply(version=result.version, completed=result.completed, skipped=result.skipped)
        assert self._pool is not None
        buf = self._pool.acquire()
        try:
            assembler = TensorAssembler(torch.float32, h.numel, out=buf)
            for message in request_iterator:
                if message.WhichOneof("kind") != "chunk":
                    raise InvalidArgument("a push stream carries one PushHeader followed by chunks only")
                assembler.add(message.chunk)
            result = shard.push(h.worker_id, h.step, assembler.result(), h.device_count)
        finally:
            self._pool.release(buf)
        metrics.BYTES_PUSHED.inc(h.numel * 4)
        metrics.PUSH_SECONDS.observe(time.perf_counter() - started)
        if result.completed:
            metrics.UPDATE_SECONDS.observe(result.update_s)
        return pb.PushReply(
            version=result.version, duplicate=result.duplicate, completed=result.completed, skipped=result.skipped
        )

    @translate
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.PullReply]:
        shard = self.shard
        if request.shard_id != shard.shard_id:
            raise InvalidArgument(f"pull for shard {request.shard_id} reached shard {shard.shard_id}")
        started = time.perf_counter()
        remaining = context.time_remaining()
        wait_s = DEFAULT_PULL_WAIT_S if remaining is None else max(0.0, remaining)
        with shard.read(request.min_version, wait_s) as (version, params):
            for chunk in encode_chunks(params, self._chunk_bytes):
                yield pb.PullReply(version=version, chunk=chunk)
        metrics.BYTES_PULLED.inc(shard.numel * 4)
        metrics.PULL_SECONDS.observe(time.perf_counter() - started)

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
