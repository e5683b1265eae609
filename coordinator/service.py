"""gRPC adapter for the Job: translate messages, call the job, map errors to status codes.

The only place in the coordinator where protobuf messages become the core's dataclasses and back.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.coordinator.job import Directive, Job, JobStatusView
from pstrain.coordinator.ledger import Progress, StepReport
from pstrain.coordinator.probe import ProbeReport
from pstrain.planner.memory_estimate import Probe
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import CodecError, decode_named_tensors, encode_chunks
from pstrain.runtime.transport import abort_on_errors

translate = abort_on_errors(
    {
        InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnknownMember: grpc.StatusCode.NOT_FOUND,
        WrongState: grpc.StatusCode.FAILED_PRECONDITION,
        AlreadyRegistered: grpc.StatusCode.ALREADY_EXISTS,
        NoFreeSlot: grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

DEFAULT_CLUSTER_WAIT_S = 600.0


def _directive(d: Directive) -> pb.Directive:
    return pb.Directive(stop=d.stop, state=d.state.name, reason=d.reason, retryable=d.retryable)


def _probe_report(m: pb.ProbeReport) -> ProbeReport:
    return ProbeReport(m.worker_id, Probe(m.per_device_batch, m.device_peak_bytes, m.host_peak_bytes, m.limit_bytes))


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


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, job: Job) -> None:
        self.job = job

    @translate
    def RegisterParameterServer(
        self, request: pb.RegisterPsRequest, context: grpc.ServicerContext
    ) -> pb.RegisterPsReply:
        r = self.job.register_ps(request.shard_id, request.address, request.metrics_address)
        return pb.RegisterPsReply(job=self.job.spec, start=r.start, end=r.end, resume_step=self.job.resume_step)

    @translate
    def FetchInitialParameters(
        self, request: pb.InitialParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TensorChunk]:
        yield from encode_chunks(self.job.initial_parameters(request.shard_id), self.job.spec.chunk_bytes)

    @translate
    def ParameterServerReady(self, request: pb.PsReadyRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.job.ps_ready(request.shard_id)
        return pb.Empty()

    @translate
    def ReportCheckpoint(self, request: pb.CheckpointWritten, context: grpc.ServicerContext) -> pb.CheckpointAck:
        self.job.checkpoint_written(request.shard_id, request.step)
        return pb.CheckpointAck(committed_step=self.job.checkpoint_step)

    @translate
    def RegisterWorker(
        self, request: pb.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> pb.RegisterWorkerReply:
        worker_id = self.job.register_worker(
            request.address, list(request.devices), request.hostname, request.metrics_address
        )
        return pb.RegisterWorkerReply(worker_id=worker_id, job=self.job.spec)

    @translate
    def WaitForCluster(self, request: pb.WaitForClusterRequest, context: grpc.ServicerContext) -> pb.ClusterView:
        remaining = context.time_remaining()
        timeout = DEFAULT_CLUSTER_WAIT_S if remaining is None else remaining
        view = self.job.wait_for_cluster(timeout, request.worker_id)
        return pb.ClusterView(ps_addresses=view.ps_addresses, state=view.state.name, job=view.spec, probe=view.probe)

    @translate
    def ReportProbe(self, request: pb.ProbeReport, context: grpc.ServicerContext) -> pb.ProbeVerdict:
        outcome = self.job.report_probe(_probe_report(request))
        return pb.ProbeVerdict(
            done=outcome.done, job=outcome.spec, limit_bytes=outcome.limit_bytes, message=outcome.message
        )

    @translate
    def RequestDataShard(self, request: pb.DataShardRequest, context: grpc.ServicerContext) -> pb.DataShard:
        data_shard = self.job.request_data_shard(request.worker_id)
        return pb.DataShard(data_shard_id=data_shard.data_shard_id, epoch=data_shard.epoch, indices=data_shard.indices)

    @translate
    def CompleteDataShard(self, request: pb.CompleteDataShardRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.job.complete_data_shard(request.worker_id, request.data_shard_id)
        return pb.Empty()

    @translate
    def ReportStep(self, request: pb.StepReport, context: grpc.ServicerContext) -> pb.Directive:
        return _directive(self.job.report_step(_step_report(request)))

    @translate
    def UploadBuffers(self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.Empty:
        self.job.upload_buffers(decode_named_tensors(request_iterator))
        return pb.Empty()

    @translate
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.Directive:
        return _directive(self.job.heartbeat(request.role, request.id, request.rss_bytes))

    @translate
    def WatchProgress(
        self, request: pb.WatchProgressRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        for progress in self.job.watch(request.from_step, context.is_active):
            yield _progress_event(progress)

    @translate
    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return _job_status(self.job.status())
