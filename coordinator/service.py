"""gRPC adapter for the Job: translate messages, call the job, map errors to status codes."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.coordinator.job import Directive, Job
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
    return pb.Directive(stop=d.stop, state=d.state.name, reason=d.reason)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, job: Job) -> None:
        self.job = job

    @translate
    def RegisterParameterServer(
        self, request: pb.RegisterPsRequest, context: grpc.ServicerContext
    ) -> pb.RegisterPsReply:
        r = self.job.register_ps(request.shard_id, request.address, request.metrics_address)
        return pb.RegisterPsReply(job=self.job.spec, start=r.start, end=r.end)

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
        addresses, spec, probe = self.job.wait_for_cluster(timeout, request.worker_id)
        return pb.ClusterView(ps_addresses=addresses, state=self.job.state.name, job=spec, probe=probe)

    @translate
    def ReportProbe(self, request: pb.ProbeReport, context: grpc.ServicerContext) -> pb.ProbeVerdict:
        outcome = self.job.report_probe(request)
        return pb.ProbeVerdict(
            done=outcome.done, job=outcome.spec, limit_bytes=outcome.limit_bytes, message=outcome.message
        )

    @translate
    def RequestDataShard(self, request: pb.DataShardRequest, context: grpc.ServicerContext) -> pb.DataShard:
        shard = self.job.request_data_shard(request.worker_id)
        return pb.DataShard(data_shard_id=shard.data_shard_id, epoch=shard.epoch, indices=shard.indices)

    @translate
    def CompleteDataShard(self, request: pb.CompleteDataShardRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.job.complete_data_shard(request.worker_id, request.data_shard_id)
        return pb.Empty()

    @translate
    def ReportStep(self, request: pb.StepReport, context: grpc.ServicerContext) -> pb.Directive:
        return _directive(self.job.report_step(request))

    @translate
    def UploadBuffers(self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.Empty:
        self.job.upload_buffers(decode_named_tensors(request_iterator))
        return pb.Empty()

    @translate
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.Directive:
        return _directive(self.job.heartbeat(request.role, request.id))

    @translate
    def WatchProgress(
        self, request: pb.WatchProgressRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        for record, state, message in self.job.watch(request.from_step, context.is_active):
            if record is None:
                yield pb.ProgressEvent(step=len(self.job.records), state=state.name, message=message)
            else:
                yield pb.ProgressEvent(
                    step=record.step,
                    loss=record.loss,
                    lr=record.lr,
                    global_batch=record.global_batch,
                    samples_per_s=record.samples_per_s,
                    state=state.name,
                    message=message,
                )

    @translate
    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return self.job.status()
