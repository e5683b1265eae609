"""The worker's side of the Coordinator contract: data shards, step reports, buffers.

Buffers (issue 11): the final ones go up for model.pt (``upload_buffers``, worker 0); at every
checkpoint step every slot's go up (``upload_slot_buffers``) and come back on resume
(``fetch_slot_buffers``); see ``worker/slot_buffers.py``.

Heartbeats are the member skeleton's (``pstrain.runtime.member``), shared with the PS.

A coordinator that dies mid-job is restarted and takes the job back from its journal; meanwhile
the worker's calls fail with UNAVAILABLE (or CANCELLED, see ``RETRIED``). Data-shard requests and
completions and step reports are therefore retried with backoff for up to ``patience_s``
(``fault.coordinator_timeout_s``): a report is idempotent on the coordinator, a completion
retried after its reply was lost is refused as not held (NOT_FOUND) and so known done, and each
data-shard request carries a number (``request_seq``) that a retry repeats, so a reply lost with
the old coordinator gets the same data shard again, never the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import decode_named_tensors, encode_named_tensors
from pstrain.runtime.admission import checked_tensor_stream
from pstrain.runtime.lifecycle import result_unless_stopped
from pstrain.runtime.model_refusal import MAX_REASON_CHARS
from pstrain.runtime.transport import CONTROL_TIMEOUT_S

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
"""The coordinator is away (restarting) or did not answer in time: the call is repeated. CANCELLED
too: the worker never cancels these calls itself, and a call that reaches a coordinator as it stops
(SIGTERM, ``systemctl restart``) is cancelled by the server instead of refused as UNAVAILABLE."""


class CoordinatorLink:
    def __init__(
        self,
        channel: grpc.Channel,
        worker_id: int = -1,
        patience_s: float = 0.0,
        stop: threading.Event | None = None,
    ) -> None:
        self._stub = pb_grpc.CoordinatorStub(channel)
        self.worker_id = worker_id
        self.patience_s = patience_s  # how long a call is retried while the coordinator is away; 0: never
        self.stop = stop or threading.Event()  # cuts a retry's backoff short
        self._seq = 0

    def _retrying(self, what: str, call: Callable[[], T], retried_ok: grpc.StatusCode | None = None) -> T | None:
        """``call`` again after a ``RETRIED`` code, with backoff, for up to ``patience_s``;
        a retry refused with ``retried_ok`` means an earlier try was taken (returns None)."""
        deadline = time.monotonic() + self.patience_s
        delay = 0.2
        retry = False
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if retry and retried_ok is not None and exc.code() == retried_ok:
                    return None  # an earlier try was taken; its reply was lost
                retry = True
                if exc.code() not in RETRIED or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s: coordinator unavailable (%s); retrying in %.1fs", what, exc.code().name, delay)
                if self.stop.wait(delay):
                    raise
                delay = min(2.0, delay * 2)

    def register(self, address: str, devices: list[str], hostname: str, metrics_address: str) -> pb.RegisterWorkerReply:
        request = pb.RegisterWorkerRequest(
            address=address, devices=devices, hostname=hostname, metrics_address=metrics_address
        )
        reply = self._stub.RegisterWorker(request, timeout=CONTROL_TIMEOUT_S)
        self.worker_id = reply.worker_id
        return reply

    def wait_for_cluster(self, timeout_s: float) -> pb.ClusterView:
        """Wait (one call, up to ``timeout_s``) until every PS shard serves; ``Stopped`` as soon as ``stop`` is set.

        The call may wait minutes for slow PS shards: a SIGTERM meanwhile cancels it and the worker exits 0."""
        call = self._stub.WaitForCluster.future(pb.WaitForClusterRequest(worker_id=self.worker_id), timeout=timeout_s)
        view: pb.ClusterView = result_unless_stopped(call, self.stop, "waiting for the PS shards")
        return view

    def report_probe(self, report: pb.ProbeReport) -> pb.ProbeVerdict:
        return self._stub.ReportProbe(report, timeout=CONTROL_TIMEOUT_S)

    # ShardSource
    def request(self) -> pb.DataShard:
        self._seq += 1
        request = pb.DataShardRequest(worker_id=self.worker_id, request_seq=self._seq)
        reply = self._retrying(
            "data shard request", lambda: self._stub.RequestDataShard(request, timeout=CONTROL_TIMEOUT_S)
        )
        assert reply is not None
        return reply

    def complete(self, data_shard_id: int) -> None:
        request = pb.CompleteDataShardRequest(worker_id=self.worker_id, data_shard_id=data_shard_id)
        self._retrying(
            "data shard completion",
            lambda: self._stub.CompleteDataShard(request, timeout=CONTROL_TIMEOUT_S),
            retried_ok=grpc.StatusCode.NOT_FOUND,  # not held any more: the first try completed it
        )

    # StepReporter
    def report(self, report: pb.StepReport) -> pb.Directive:
        reply = self._retrying("step report", lambda: self._stub.ReportStep(report, timeout=CONTROL_TIMEOUT_S))
        assert reply is not None
        return reply

    def refuse_model(self, reason: str) -> pb.Directive | None:
        """Tell the coordinator this worker cannot train the model: it fails the job, not retryable. One try, not
        gated on ``stop`` (the failed trainer has set it); None when the coordinator could not be told (the worker
        exits 3 all the same, and the job fails once its heartbeats stop)."""
        request = pb.ModelRefusal(worker_id=self.worker_id, reason=reason[:MAX_REASON_CHARS])
        try:
            return self._stub.RefuseModel(request, timeout=CONTROL_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.error("could not tell the coordinator the model is refused: %s: %s", exc.code().name, exc.details())
            return None

    def upload_buffers(self, buffers: dict, chunk_bytes: int) -> None:  # type: ignore[type-arg]
        self._stub.UploadBuffers(encode_named_tensors(buffers, chunk_bytes), timeout=300)

    def upload_slot_buffers(self, step: int, buffers: dict[str, torch.Tensor], chunk_bytes: int) -> None:
        """Issue 11: this slot's buffers after the update to checkpoint ``step`` (every replica's), retried."""

        def parts() -> Iterator[pb.SlotBuffersPart]:
            yield pb.SlotBuffersPart(header=pb.SlotBuffersHeader(worker_id=self.worker_id, step=step))
            for chunk in encode_named_tensors(buffers, chunk_bytes):
                yield pb.SlotBuffersPart(chunk=chunk)

        self._retrying("buffers upload", lambda: self._stub.UploadSlotBuffers(parts(), timeout=300))

    def fetch_slot_buffers(
        self, step: int, expected: Mapping[str, tuple[int, tuple[int, ...]]]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Issue 11: this slot's newest buffers at or before ``step`` and their step (-1: none); each
        announced tensor is checked against ``expected`` (name -> wire dtype, shape) before it is allocated."""

        def fetch() -> tuple[int, dict[str, torch.Tensor]]:
            parts = self._stub.FetchSlotBuffers(pb.SlotBuffersRequest(worker_id=self.worker_id, step=step), timeout=300)
            first = next(parts, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ValueError("FetchSlotBuffers: the reply does not start with its header")
            chunks = (part.chunk for part in parts)
            return first.header.step, decode_named_tensors(checked_tensor_stream(chunks, expected))

        found = self._retrying("buffers download", fetch)
        assert found is not None
        return found
