"""gRPC adapter for the Job: translate messages, call the job, map errors to status codes.

The only place in the coordinator where protobuf messages become the core's dataclasses and back.

Identity (issue 8): with a ``MemberRegistry`` every registration hands out a credential and every
call made for a member must carry that member's current one (``runtime/identity.py``); the
servicer checks it before the job sees the call. ``pstrain-coordinator`` always passes a registry;
without one (tests of the job over gRPC) calls are not bound to identities.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from pstrain.coordinator.buffer_store import check_names
from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.coordinator.initial_tables import initial_row_blocks
from pstrain.coordinator.job import Directive, Job, JobStatusView, SetPsWorkers
from pstrain.coordinator.ledger import Progress, StepReport
from pstrain.coordinator.membership import HolderAlive
from pstrain.coordinator.probe import ProbeReport
from pstrain.coordinator.report_checks import check_step_report
from pstrain.planner.memory_estimate import Probe
from pstrain.planner.profile_wire import profile_from_pb
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import CodecError, decode_named_tensors, encode_chunks, encode_named_tensors, wire_dtype
from pstrain.runtime.admission import Overloaded, checked_tensor_stream
from pstrain.runtime.identity import MemberRegistry, NotIssued, PermissionDenied
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.transport import abort_on_errors, open_channel

translate = abort_on_errors(
    {
        InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownMember: grpc.StatusCode.NOT_FOUND,
        WrongState: grpc.StatusCode.FAILED_PRECONDITION,
        AlreadyRegistered: grpc.StatusCode.ALREADY_EXISTS,
        NoFreeSlot: grpc.StatusCode.RESOURCE_EXHAUSTED,
        HolderAlive: grpc.StatusCode.UNAVAILABLE,  # a registration for a live member's slot: retry until it is silent
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
        NotIssued: grpc.StatusCode.NOT_FOUND,
        Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

DEFAULT_CLUSTER_WAIT_S = 600.0
REACHABLE_TIMEOUT_S = 2.0


def address_answers(security: TransportSecurity) -> Callable[[str], bool]:
    """Whether a worker still answers at its address (S2.5). Only UNAVAILABLE counts as gone: a crashed
    process refuses the connection at once; a slow answer (a loaded host) or a refusal is a live worker."""

    def answers(address: str) -> bool:
        channel = open_channel(address, security)
        try:
            pb_grpc.WorkerStub(channel).GetWorkerStatus(pb.WorkerStatusRequest(), timeout=REACHABLE_TIMEOUT_S)
            return True
        except grpc.RpcError as exc:
            return exc.code() != grpc.StatusCode.UNAVAILABLE
        finally:
            channel.close()

    return answers


SET_WORKERS_TIMEOUT_S = 30.0


def ps_worker_setter(security: TransportSecurity) -> SetPsWorkers:
    """``Job``'s ``set_ps_workers`` (cluster.min_workers): SetWorkers on every PS shard at once; replies in shard order.

    At once, not one after another: a removal may complete the step in flight, and with LARS/LAMB a shard holding
    part of a split parameter then waits in SetWorkers for the other holder's norms, which that holder computes
    only in its own SetWorkers (one shard at a time, the first call waited for the second until it timed out)."""

    def set_workers(addresses: list[str], from_step: int, ids: list[int], scaled_lr: float) -> list[tuple[bool, bool]]:
        request = pb.SetWorkersRequest(from_version=from_step, worker_ids=ids, scaled_lr=scaled_lr)

        def one(address: str) -> tuple[bool, bool]:
            channel = open_channel(address, security)
            try:
                reply = pb_grpc.ParameterServerStub(channel).SetWorkers(request, timeout=SET_WORKERS_TIMEOUT_S)
            finally:
                channel.close()
            return reply.included_all, reply.included_any

        with ThreadPoolExecutor(max_workers=max(1, len(addresses)), thread_name_prefix="set-workers") as pool:
            return list(pool.map(one, addresses))

    return set_workers


def _directive(d: Directive) -> pb.Directive:
    return pb.Directive(stop=d.stop, state=d.state.name, reason=d.reason, retryable=d.retryable)


def _probe_report(m: pb.ProbeReport) -> ProbeReport:
    profile = profile_from_pb(m.profile) if m.HasField("profile") else None  # issue 10: the master's own profile
    return ProbeReport(
        m.worker_id, Probe(m.per_device_batch, m.device_peak_bytes, m.host_peak_bytes, m.limit_bytes, profile)
    )


def _step_report(m: pb.StepReport) -> StepReport:
    return StepReport(
        worker_id=m.worker_id, step=m.step, loss=m.loss, samples=m.samples, step_s=m.step_s, nonfinite=m.nonfinite
    )


def _progress_event(p: Progress) -> pb.ProgressEvent:
    if p.record is None:
        return pb.ProgressEvent(step=p.completed, state=p.state.name, message=p.message)
    return pb.ProgressEvent(
        step=p.record.step,
        loss=p.record.loss,
        lr=p.record.lr,
        global_batch=p.record.global_batch,
        samples_per_s=p.record.samples_per_s,
        state=p.state.name,
        message=p.message,
    )


def _job_status(s: JobStatusView) -> pb.JobStatus:
    return pb.JobStatus(
        job_id=s.job_id,
        state=s.state.name,
        step=s.step,
        steps=s.steps,
        per_device_batch=s.per_device_batch,
        global_batch=s.global_batch,
        lr=s.lr,
        members=[
            pb.MemberStatus(
                role=m.role,
                id=m.id,
                address=m.address,
                alive=m.alive,
                last_seen_s_ago=m.last_seen_s_ago,
                metrics_address=m.metrics_address,
            )
            for m in s.members
        ],
        data_shards_todo=s.data_shards.todo,
        data_shards_doing=s.data_shards.doing,
        data_shards_done=s.data_shards.done,
        message=s.message,
        metrics_address=s.metrics_address,
        global_lr=s.global_lr,
        worker_device_memory_bytes=s.worker_device_memory_bytes,
        worker_host_memory_bytes=s.worker_host_memory_bytes,
        skipped_steps=s.skipped_steps,
        ps_memory_forecast_bytes=s.ps_memory_forecast_bytes,
        ps_memory_trend=s.ps_memory_trend,
        checkpoint_step=s.checkpoint_step,
    )


def _chunk_of(part: pb.SlotBuffersPart) -> pb.TensorChunk:
    if part.WhichOneof("kind") != "chunk":
        raise InvalidRequest("UploadSlotBuffers: only the first message is a header")
    return part.chunk


STATUS_FRESH_S = 0.2


class StatusCache:
    """GetJobStatus answers from one build for up to ``fresh_s`` while the job's state and step stay the same.

    Why (issue 8): a status poller at 1,000 calls/s would otherwise take the job's lock and build the whole view
    1,000 times a second, and the workers' step reports wait on that lock. A change of state or step, or a call
    after ``fresh_s`` of quiet, builds afresh; the rest (a member's ``last_seen_s_ago``) may be ``fresh_s`` old.
    """

    def __init__(self, job: Job, fresh_s: float = STATUS_FRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._job = job
        self._fresh_s = fresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[tuple[object, ...], float, pb.JobStatus] | None = None

    def get(self) -> pb.JobStatus:
        job = self._job
        key = (job.state, job.message, job.ledger.completed)  # read without the job's lock: a torn read rebuilds
        now = self._clock()
        with self._lock:
            cached = self._cached
        if cached is not None and cached[0] == key and now - cached[1] < self._fresh_s:
            return cached[2]
        status = _job_status(job.status())
        with self._lock:
            self._cached = (key, now, status)
        return status


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, job: Job, registry: MemberRegistry | None = None) -> None:
        self.job = job
        self.registry = registry
        self.status = StatusCache(job)

    def _require(self, context: grpc.ServicerContext, role: str, member_id: int) -> None:
        """The call carries the current credential of ``role`` ``member_id`` (issue 8)."""
        if self.registry is not None:
            self.registry.require(context.invocation_metadata(), role, member_id)

    def _proven(self, context: grpc.ServicerContext, role: str) -> int | None:
        """The id of the ``role`` member whose *current* credential this registration carries, if any: proof that
        the caller is that member's own process registering again, which may take its live slot at once. A
        registration naming an address proves nothing (anyone with the bearer token can name any); a missing,
        forged or superseded credential is no proof, not an error: a restarted process has none."""
        if self.registry is None:
            return None
        try:
            return self.registry.require_any(context.invocation_metadata(), role).member_id
        except (PermissionDenied, NotIssued):
            return None

    def _credential(self, role: str, member_id: int) -> str:
        if self.registry is None:
            return ""
        credential = self.registry.issue(role, member_id)
        self.job.credential_issued(role, member_id, credential.incarnation)  # journaled: a restart accepts it again
        return credential.encode()

    @translate
    def RegisterParameterServer(
        self, request: pb.RegisterPsRequest, context: grpc.ServicerContext
    ) -> pb.RegisterPsReply:
        proven = self._proven(context, "ps") == request.shard_id
        r = self.job.register_ps(request.shard_id, request.address, request.metrics_address, proven)
        return pb.RegisterPsReply(
            job=self.job.spec,
            start=r.start,
            end=r.end,
            resume_step=self.job.resume_step,
            member_credential=self._credential("ps", request.shard_id),
            job_key=self.registry.keys.public_key if self.registry is not None else b"",  # verifies, cannot mint
        )

    @translate
    def FetchInitialParameters(
        self, request: pb.InitialParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TensorChunk]:
        self._require(context, "ps", request.shard_id)
        yield from encode_chunks(self.job.initial_parameters(request.shard_id), self.job.spec.chunk_bytes)

    @translate
    def FetchInitialRows(
        self, request: pb.InitialParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RowBlock]:
        """Issue 9: the rows of ``model.init_checkpoint``'s tables that shard ``shard_id`` owns (none without one)."""
        self._require(context, "ps", request.shard_id)
        if not 0 <= request.shard_id < self.job.spec.ps_shards:
            raise InvalidRequest(f"unknown PS shard {request.shard_id}: this job has {self.job.spec.ps_shards}")
        yield from initial_row_blocks(self.job.model.tables, request.shard_id, self.job.spec.ps_shards)

    @translate
    def ParameterServerReady(self, request: pb.PsReadyRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._require(context, "ps", request.shard_id)
        self.job.ps_ready(request.shard_id)
        return pb.Empty()

    @translate
    def ReportCheckpoint(self, request: pb.CheckpointWritten, context: grpc.ServicerContext) -> pb.CheckpointAck:
        self._require(context, "ps", request.shard_id)
        self.job.checkpoint_written(request.shard_id, request.step)
        return pb.CheckpointAck(committed_step=self.job.checkpoint_step)

    @translate
    def RegisterWorker(
        self, request: pb.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> pb.RegisterWorkerReply:
        worker_id = self.job.register_worker(
            request.address,
            list(request.devices),
            request.hostname,
            request.metrics_address,
            proven=self._proven(context, "worker"),
        )
        slot = self.job.worker_slot(worker_id)
        return pb.RegisterWorkerReply(
            worker_id=worker_id,
            job=self.job.spec,
            replacement=slot.replacement,
            devices=slot.devices,
            device_memory_bytes=slot.device_memory_bytes,
            host_memory_bytes=slot.host_memory_bytes,
            start_step=slot.start_step,
            member_credential=self._credential("worker", worker_id),
        )

    @translate
    def RejoinAt(self, request: pb.RejoinRequest, context: grpc.ServicerContext) -> pb.Directive:
        self._require(context, "worker", request.worker_id)
        return _directive(self.job.rejoin_at(request.worker_id, request.step, request.inconsistent))

    @translate
    def WaitForCluster(self, request: pb.WaitForClusterRequest, context: grpc.ServicerContext) -> pb.ClusterView:
        if request.worker_id >= 0:
            self._require(context, "worker", request.worker_id)
        remaining = context.time_remaining()
        timeout = DEFAULT_CLUSTER_WAIT_S if remaining is None else remaining
        view = self.job.wait_for_cluster(timeout, request.worker_id, context.is_active)
        return pb.ClusterView(ps_addresses=view.ps_addresses, state=view.state.name, job=view.spec, probe=view.probe)

    @translate
    def ReportProbe(self, request: pb.ProbeReport, context: grpc.ServicerContext) -> pb.ProbeVerdict:
        self._require(context, "worker", request.worker_id)
        outcome = self.job.report_probe(_probe_report(request))
        return pb.ProbeVerdict(
            done=outcome.done, job=outcome.spec, limit_bytes=outcome.limit_bytes, message=outcome.message
        )

    @translate
    def RequestDataShard(self, request: pb.DataShardRequest, context: grpc.ServicerContext) -> pb.DataShard:
        self._require(context, "worker", request.worker_id)
        data_shard = self.job.request_data_shard(request.worker_id, request.request_seq)
        return pb.DataShard(data_shard_id=data_shard.data_shard_id, epoch=data_shard.epoch, indices=data_shard.indices)

    @translate
    def CompleteDataShard(self, request: pb.CompleteDataShardRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._require(context, "worker", request.worker_id)
        self.job.complete_data_shard(request.worker_id, request.data_shard_id)
        return pb.Empty()

    @translate
    def ReportStep(self, request: pb.StepReport, context: grpc.ServicerContext) -> pb.Directive:
        self._require(context, "worker", request.worker_id)
        report = _step_report(request)
        check_step_report(report, self.job.plan.per_device_batch * self.job.plan.devices_per_worker)
        return _directive(self.job.report_step(report))

    @translate
    def RefuseModel(self, request: pb.ModelRefusal, context: grpc.ServicerContext) -> pb.Directive:
        self._require(context, "worker", request.worker_id)
        return _directive(self.job.refuse_model(request.worker_id, request.reason))

    @translate
    def UploadBuffers(self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.Empty:
        if self.registry is not None:
            self.registry.require_any(context.invocation_metadata(), "worker")
        # Every announced name, dtype and shape is checked against the model before anything is allocated; once
        # read, the set is checked whole before it is kept: a partial one would export a model.pt that mixes worker
        # 0's trained statistics with initial ones (or, empty, end the export's wait for them).
        expected = {n: (wire_dtype(b.dtype), tuple(b.shape)) for n, b in self.job.model.model.named_buffers()}
        buffers = decode_named_tensors(checked_tensor_stream(request_iterator, expected))
        check_names("the uploaded final buffers", buffers, expected)
        self.job.upload_buffers(buffers)
        return pb.Empty()

    @translate
    def UploadSlotBuffers(
        self, request_iterator: Iterator[pb.SlotBuffersPart], context: grpc.ServicerContext
    ) -> pb.Empty:
        """Issue 11: a worker slot's buffers at a checkpoint step; checked against the model before allocation."""
        header = next(request_iterator, None)
        if header is None or header.WhichOneof("kind") != "header":
            raise InvalidRequest("UploadSlotBuffers: the first message must be the header")
        self._require(context, "worker", header.header.worker_id)
        if not self.job.buffers_wanted(header.header.worker_id, header.header.step):  # before any payload is read
            return pb.Empty()  # committed already: the payload is not needed
        chunks = (_chunk_of(part) for part in request_iterator)
        buffers = decode_named_tensors(checked_tensor_stream(chunks, self.job.buffers.expected()))
        self.job.checkpoint_buffers(header.header.worker_id, header.header.step, buffers)
        return pb.Empty()

    @translate
    def FetchSlotBuffers(
        self, request: pb.SlotBuffersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.SlotBuffersPart]:
        """Issue 11: the slot's newest buffers at or before ``step``; a header of step -1 when there are none."""
        self._require(context, "worker", request.worker_id)
        found = self.job.slot_buffers(request.worker_id, request.step)
        step, buffers = found if found is not None else (-1, {})
        yield pb.SlotBuffersPart(header=pb.SlotBuffersHeader(worker_id=request.worker_id, step=step))
        for chunk in encode_named_tensors(buffers, self.job.spec.chunk_bytes):
            yield pb.SlotBuffersPart(chunk=chunk)

    @translate
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.Directive:
        if request.role in ("ps", "worker"):  # another role is the job's to refuse (INVALID_ARGUMENT)
            self._require(context, request.role, request.id)
        return _directive(self.job.heartbeat(request.role, request.id, request.rss_bytes))

    @translate
    def WatchProgress(
        self, request: pb.WatchProgressRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        for progress in self.job.watch(request.from_step, context.is_active):
            yield _progress_event(progress)

    @translate
    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return self.status.get()
