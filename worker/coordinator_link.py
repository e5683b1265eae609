"""The worker's side of the Coordinator contract: data shards, step reports, buffers.

Heartbeats are the member skeleton's (``pstrain.runtime.member``), shared with the PS.
"""

from __future__ import annotations

import grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_named_tensors
from pstrain.runtime.transport import CONTROL_TIMEOUT_S


class CoordinatorLink:
    def __init__(self, channel: grpc.Channel, worker_id: int = -1) -> None:
        self._stub = pb_grpc.CoordinatorStub(channel)
        self.worker_id = worker_id

    def register(self, address: str, devices: list[str], hostname: str, metrics_address: str) -> pb.RegisterWorkerReply:
        request = pb.RegisterWorkerRequest(
            address=address, devices=devices, hostname=hostname, metrics_address=metrics_address
        )
        reply = self._stub.RegisterWorker(request, timeout=CONTROL_TIMEOUT_S)
        self.worker_id = reply.worker_id
        return reply

    def wait_for_cluster(self, timeout_s: float) -> pb.ClusterView:
        return self._stub.WaitForCluster(pb.WaitForClusterRequest(worker_id=self.worker_id), timeout=timeout_s)

    def report_probe(self, report: pb.ProbeReport) -> pb.ProbeVerdict:
        return self._stub.ReportProbe(report, timeout=CONTROL_TIMEOUT_S)

    # ShardSource
    def request(self) -> pb.DataShard:
        return self._stub.RequestDataShard(pb.DataShardRequest(worker_id=self.worker_id), timeout=CONTROL_TIMEOUT_S)

    def complete(self, data_shard_id: int) -> None:
        self._stub.CompleteDataShard(
            pb.CompleteDataShardRequest(worker_id=self.worker_id, data_shard_id=data_shard_id),
            timeout=CONTROL_TIMEOUT_S,
        )

    # StepReporter
    def report(self, report: pb.StepReport) -> pb.Directive:
        return self._stub.ReportStep(report, timeout=CONTROL_TIMEOUT_S)

    def upload_buffers(self, buffers: dict, chunk_bytes: int) -> None:  # type: ignore[type-arg]
        self._stub.UploadBuffers(encode_named_tensors(buffers, chunk_bytes), timeout=300)
