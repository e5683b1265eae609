"""A live localhost cluster shared by the operator tests (grpcurl, metrics, status RPCs)."""

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.transport import open_channel
from tests.helpers import metrics_lines, start_local, stop_local, wait_for, write_job


@dataclass
class LiveCluster:
    out: Path
    coordinator: str
    status: pb.JobStatus

    def members(self, role: str) -> list[pb.MemberStatus]:
        return [m for m in self.status.members if m.role == role]


@pytest.fixture(scope="module")
def live_cluster(tmp_path_factory):
    """2 PS shards, 2 workers x 2 CPU devices, training for as long as the module needs."""
    tmp = tmp_path_factory.mktemp("live")
    job = write_job(
        tmp / "job.yaml",
        job={"steps": 1_000_000, "seed": 0},
        cluster={"ps_shards": 2, "workers": 2, "devices_per_worker": 2},
    )
    marker = uuid.uuid4().hex
    proc = start_local(job, tmp / "out", marker)
    try:
        wait_for(lambda: metrics_lines(tmp / "out") >= 3 or proc.poll() is not None, 120, "training to start")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        address = f"127.0.0.1:{int((tmp / 'out' / 'coordinator.port').read_text())}"
        with open_channel(address) as channel:
            status = pb_grpc.CoordinatorStub(channel).GetJobStatus(pb.JobStatusRequest(), timeout=10)
        yield LiveCluster(tmp / "out", address, status)
    finally:
        stop_local(proc, marker)
