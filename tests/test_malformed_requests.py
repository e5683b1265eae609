"""Request bytes that are not the method's message: INVALID_ARGUMENT, counted as a refusal, no traceback, no change.

gRPC parses a request before the handler runs; a parser that raises made the PS answer UNKNOWN and the coordinator
INTERNAL, each with an ERROR traceback, past the refusal count and its rate limit. Each service over real gRPC on
127.0.0.1 ephemeral ports.
"""

import logging

import grpc
import pytest
import torch

from pstrain.coordinator.service import CoordinatorServicer
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.sparse_service import SparseTablesServicer, add_sparse_tables
from pstrain.runtime import refusals
from pstrain.runtime.metrics import REJECTED
from pstrain.runtime.transport import open_channel, start_server
from tests.test_job import make_job

NOT_A_MESSAGE = b"\x08\xff"  # a varint cut off: no protobuf message parses from it


def invalid_argument_refusals() -> float:
    return REJECTED.labels("INVALID_ARGUMENT")._value.get()


def call(channel: grpc.Channel, path: str, kind: str, payload: bytes) -> grpc.RpcError:
    """Send raw bytes to ``path``; the error it is answered with."""
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with pytest.raises(grpc.RpcError) as err:
        if kind == "unary":
            channel.unary_unary(path, **raw)(payload, timeout=10)
        elif kind == "server_stream":
            list(channel.unary_stream(path, **raw)(payload, timeout=10))
        else:
            channel.stream_unary(path, **raw)(iter([payload]), timeout=10)
    return err.value


@pytest.fixture(autouse=True)
def fresh_refusal_log(monkeypatch):
    """The refusal log's rate limit counts per method across tests: each test starts a window of its own."""
    monkeypatch.setattr(refusals, "_LOG", refusals.RateLimitedLog())


def assert_refused(channel, path, kind, message, caplog) -> None:
    before = invalid_argument_refusals()
    with caplog.at_level(logging.WARNING):
        error = call(channel, path, kind, NOT_A_MESSAGE)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, error.code(), error.details())
    assert error.details().startswith(f"malformed {message}: ")
    assert invalid_argument_refusals() == before + 1  # counted, as every refusal is
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback
    assert any(r.name == "pstrain.runtime.refusals" for r in caplog.records)  # the rate-limited refusal log
    caplog.clear()


@pytest.fixture
def ps():
    servicer = ParameterServerServicer()
    sparse = SparseTablesServicer()
    server = start_server(
        "127.0.0.1:0",
        [(add_parameter_server, servicer), (add_sparse_tables, sparse)],
        ["ParameterServer", "SparseTables"],
        aio=True,
    )
    shard = ParameterShard(0, 0, 4, torch.ones(4), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1), 1)
    servicer.attach(shard, 8)
    server.set_serving(True)
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            yield channel, shard
    finally:
        shard.close()
        server.stop(0)


@pytest.mark.parametrize(
    "method, kind, message",
    [
        ("GetShardStatus", "unary", "ShardStatusRequest"),
        ("Pull", "server_stream", "PullRequest"),
        ("PullAt", "server_stream", "PullAtRequest"),
        ("PushShared", "unary", "PushHeader"),
        ("PushBulk", "unary", "PushHeader"),
        ("SetWorkers", "unary", "SetWorkersRequest"),
        ("Push", "client_stream", "PushRequest"),
    ],
)
def test_the_parameter_server_refuses_malformed_requests(ps, method, kind, message, caplog):
    channel, shard = ps
    assert_refused(channel, f"/pstrain.v1.ParameterServer/{method}", kind, message, caplog)
    assert shard.version == 0 and torch.equal(shard.parameters()[1], torch.ones(4))
    status = pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(), timeout=10)
    assert status.version == 0  # and the service still answers


@pytest.mark.parametrize("method, message", [("PullRows", "PullRowsRequest"), ("PushRows", "PushRowsRequest")])
def test_the_sparse_tables_refuse_malformed_requests(ps, method, message, caplog):
    channel, _ = ps
    assert_refused(channel, f"/pstrain.v1.SparseTables/{method}", "unary", message, caplog)


@pytest.mark.parametrize(
    "method, kind, message",
    [
        ("ReportStep", "unary", "StepReport"),
        ("RegisterWorker", "unary", "RegisterWorkerRequest"),
        ("GetJobStatus", "unary", "JobStatusRequest"),
        ("WatchProgress", "server_stream", "WatchProgressRequest"),
        ("UploadBuffers", "client_stream", "TensorChunk"),
    ],
)
def test_the_coordinator_refuses_malformed_requests(tmp_path, method, kind, message, caplog):
    job, *_ = make_job(tmp_path)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], [])
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            assert_refused(channel, f"/pstrain.v1.Coordinator/{method}", kind, message, caplog)
            status = pb_grpc.CoordinatorStub(channel).GetJobStatus(pb.JobStatusRequest(), timeout=10)
        assert status.step == 0 and not status.members  # nothing registered, nothing reported
    finally:
        server.stop(0)
        job.close()


def test_the_worker_refuses_malformed_requests(caplog):
    from pstrain.worker.service import WorkerServicer

    servicer = WorkerServicer(["cpu"])
    server = start_server("127.0.0.1:0", [(pb_grpc.add_WorkerServicer_to_server, servicer)], ["Worker"])
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            assert_refused(channel, "/pstrain.v1.Worker/GetWorkerStatus", "unary", "WorkerStatusRequest", caplog)
            status = pb_grpc.WorkerStub(channel).GetWorkerStatus(pb.WorkerStatusRequest(), timeout=10)
        assert list(status.devices) == ["cpu"]
    finally:
        server.stop(0)


def test_method_names_a_server_does_not_serve_are_not_remembered():
    """Only the methods a handler serves are kept: calls to made-up names cannot grow a server's memory."""
    from pstrain.runtime.transport import _TolerantGeneric

    servicer = CoordinatorServicer.__new__(CoordinatorServicer)
    inner = grpc.method_handlers_generic_handler(
        "pstrain.v1.Coordinator",
        {"GetJobStatus": grpc.unary_unary_rpc_method_handler(servicer.GetJobStatus, pb.JobStatusRequest.FromString)},
    )
    handler = _TolerantGeneric(inner)

    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str) -> None:
            self.method, self.invocation_metadata = method, ()

    for i in range(100):
        assert handler.service(Details(f"/evil.Service/M{i}")) is None
    served = handler.service(Details("/pstrain.v1.Coordinator/GetJobStatus"))
    assert served is not None and handler.service(Details("/pstrain.v1.Coordinator/GetJobStatus")) is served
    assert len(handler._made) == 1
