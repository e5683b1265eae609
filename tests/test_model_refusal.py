"""A model the worker cannot train fails the job, not retryable, instead of a restart loop.

The coordinator side as a plain Job and over real gRPC (``RefuseModel``); then ``pstrain local`` end to end with a
model whose forward reads a child module's weight without calling it (``ReadsChildWeight``): before, the worker
exited 1 with a traceback, so ``pstrain local`` and systemd restarted it into the same error.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pstrain.coordinator.errors import InvalidRequest, UnknownMember
from pstrain.coordinator.job import JobState
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.model_refusal import MAX_REASON_CHARS
from tests.helpers import pids_with_marker, run_local, write_job
from tests.test_job import make_job, served, start

REASON = "parameter 'head.inner.weight' was used by forward before its new version was loaded"


def test_a_refused_model_fails_the_job_not_retryable_naming_the_worker(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    directive = job.refuse_model(1, REASON)
    assert directive.stop and directive.state == JobState.FAILED and not directive.retryable
    assert job.state == JobState.FAILED and job.message == f"worker 1 cannot train this model: {REASON}"
    assert job.heartbeat("worker", 0).stop and not job.heartbeat("worker", 0).retryable
    job.close()


def test_a_refusal_without_a_reason_or_from_nobody_changes_nothing(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    with pytest.raises(InvalidRequest, match="reason is empty"):
        job.refuse_model(0, "  ")
    with pytest.raises(InvalidRequest, match=f"at most {MAX_REASON_CHARS}"):
        job.refuse_model(0, "x" * (MAX_REASON_CHARS + 1))
    with pytest.raises(UnknownMember):
        job.refuse_model(7, REASON)
    assert job.state == JobState.RUNNING and not job.heartbeat("worker", 0).stop
    job.close()


def test_the_servicer_fails_the_job_and_refuses_bad_refusals_with_their_codes(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    with served(job) as stub:
        start(job)
        for request, code in [
            (pb.ModelRefusal(worker_id=0, reason=""), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ModelRefusal(worker_id=9, reason=REASON), grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.RefuseModel(request, timeout=10)
            assert info.value.code() == code, info.value.details()
        assert stub.GetJobStatus(pb.JobStatusRequest(), timeout=10).state == pb.RUNNING
        directive = stub.RefuseModel(pb.ModelRefusal(worker_id=0, reason=REASON), timeout=10)
        assert directive.stop and directive.state == pb.FAILED and not directive.retryable
        status = stub.GetJobStatus(pb.JobStatusRequest(), timeout=10)
        assert status.state == pb.FAILED and REASON in status.message


# ------------------------------------------------------------------ end to end: pstrain local


class ReadsChildWeight(nn.Module):
    """``head`` has no parameters of its own and reads ``head.inner``'s without calling it. Wide enough that
    ``inner`` is a bucket of its own at the smallest ``transport.bucket_bytes``, so its bucket is loaded late."""

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.a = nn.Linear(5, hidden)
        self.head = nn.Module()
        self.head.inner = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.a(x)), self.head.inner.weight, self.head.inner.bias)


def test_pstrain_local_fails_a_model_it_cannot_train_once_with_exit_3(tmp_path):
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml",
        model={"factory": "tests.test_model_refusal:ReadsChildWeight"},
        cluster={"ps_shards": 2, "workers": 2, "devices_per_worker": 1},
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0, "bucket_bytes": 4096},
    )
    result = run_local(job, out, marker)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "cannot train this model: parameter 'head.inner." in result.stderr, result.stderr[-3000:]
    worker_logs = "".join(path.read_text() for path in (out / "logs").glob("worker-*.log"))
    assert "Traceback" not in worker_logs, worker_logs[-3000:]
    assert "restart" not in result.stderr.lower() or "restarting" not in result.stderr.lower(), result.stderr[-3000:]
    assert not (out / "model.pt").exists()
    assert not pids_with_marker(marker)
