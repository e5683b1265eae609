"""Client side of the ParameterServer contract, shaped like ps-lite's KVWorker.

``push`` slices a flat vector by the shard map and streams every slice to its shard at
once, returning a handle to wait on; ``pull`` waits for a version and streams every shard's
range straight into the caller's buffer. Used by workers and by the coordinator's export.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import DEFAULT_CHUNK_BYTES, TensorAssembler, encode_chunks
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import open_channel

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


@dataclass
class PushHandle:
    """Futures of one push to every shard; ``wait`` returns the shards' replies in shard order."""

    futures: list[Future[pb.PushReply]]

    def wait(self) -> list[pb.PushReply]:
        return [f.result() for f in self.futures]


class PsClient:
    def __init__(
        self,
        addresses: list[str],
        total: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        push_timeout_s: float = 120.0,
        pull_timeout_s: float = 600.0,
        retries: int = 3,
        security: TransportSecurity = INSECURE,
    ) -> None:
        self.ranges: list[ShardRange] = shard_ranges(total, len(addresses))
        self.total = total
        self._chunk_bytes = chunk_bytes
        self._push_timeout_s = push_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._retries = retries
        self._channels = [open_channel(a, security) for a in addresses]
        self._stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=2 * len(addresses), thread_name_prefix="ps-client")

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        """Send each shard its slice of ``flat`` (a contiguous float32 CPU vector), concurrently."""
        if flat.dtype != torch.float32 or flat.numel() != self.total:
            raise ValueError(f"push needs {self.total} float32 elements, got {flat.numel()} {flat.dtype}")
        return PushHandle(
            [
                self._pool.submit(self._push_one, r, flat[r.start : r.end], worker_id, step, device_count)
                for r in self.ranges
            ]
        )

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        """Fill ``out`` with every shard's parameters at ``min_version`` or newer; return the version."""
        if out.dtype != torch.float32 or out.numel() != self.total or not out.is_contiguous():
            raise ValueError(f"pull needs a contiguous float32 buffer of {self.total} elements")
        futures = [self._pool.submit(self._pull_one, r, min_version, out[r.start : r.end]) for r in self.ranges]
        versions = [f.result() for f in futures]
        if len(set(versions)) != 1:
            raise RuntimeError(f"shards returned different versions {versions}; the job is inconsistent")
        return versions[0]

    def status(self) -> list[pb.ShardStatus]:
        return [stub.GetShardStatus(pb.ShardStatusRequest(), timeout=30) for stub in self._stubs]

    def close(self, cancel: bool = False) -> None:
        """Release the channels; with ``cancel`` in-flight calls fail at once (CANCELLED)."""
        if cancel:
            for channel in self._channels:
                channel.close()
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        for channel in self._channels:
            channel.close()

    def _push_one(
        self, r: ShardRange, piece: torch.Tensor, worker_id: int, step: int, device_count: int
    ) -> pb.PushReply:
        header = pb.PushHeader(
            shard_id=r.shard_id,
            worker_id=worker_id,
            step=step,
            device_count=device_count,
            dtype=pb.FLOAT32,
            numel=r.numel,
        )

        def requests() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(header=header)
            for chunk in encode_chunks(piece, self._chunk_bytes):
                yield pb.PushRequest(chunk=chunk)

        return self._with_retries(lambda: self._stubs[r.shard_id].Push(requests(), timeout=self._push_timeout_s))

    def _pull_one(self, r: ShardRange, min_version: int, dest: torch.Tensor) -> int:
        def attempt() -> int:
            assembler = TensorAssembler(torch.float32, r.numel, out=dest)
            version = -1
            request = pb.PullRequest(shard_id=r.shard_id, min_version=min_version)
            for reply in self._stubs[r.shard_id].Pull(request, timeout=self._pull_timeout_s):
                version = reply.version
                assembler.add(reply.chunk)
            assembler.result()
            return version

        return self._with_retries(attempt)

    def _with_retries(self, call):  # type: ignore[no-untyped-def]
        """Retry UNAVAILABLE (a restarting shard); pushes are idempotent, pulls read-only."""
        delay = 0.2
        for attempt in range(self._retries + 1):
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self._retries:
                    raise
                log.warning("parameter server unavailable (%s), retrying in %.1fs", exc.details(), delay)
                time.sleep(delay)  # backoff between retries of a failed call, not a wait for a peer
                delay *= 2
        raise AssertionError("unreachable")
