"""gRPC adapter exposing a worker's state to operators (no tensors)."""

from __future__ import annotations

import grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.transport import abort_on_errors
from pstrain.worker.trainer import TrainerProgress


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, devices: list[str]) -> None:
        self.worker_id = -1
        self.devices = devices
        self.progress = TrainerProgress()

    @abort_on_errors({})  # a request that does not parse is INVALID_ARGUMENT, counted as a refusal (no traceback)
    def GetWorkerStatus(self, request: pb.WorkerStatusRequest, context: grpc.ServicerContext) -> pb.WorkerStatus:
        p = self.progress
        return pb.WorkerStatus(
            worker_id=max(self.worker_id, 0),
            devices=self.devices,
            step=p.step,
            last_step_s=p.last_step_s,
            state=p.state,
        )
