"""The ParameterServer service over real gRPC on 127.0.0.1 ephemeral ports."""

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_chunks, encode_push_chunks, encode_push_header
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime import shm_board
from pstrain.runtime.identity import HEADER
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.shard_map import shard_ranges
from pstrain.runtime.transport import open_channel, start_server
from tests.helpers import guarded_shard

TOTAL = 11
SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.5)


@pytest.fixture
def cluster():
    """Two shards of an 11-element model, each its own gRPC server, for 2 workers."""
    initial = torch.linspace(-1, 1, TOTAL)
    servers, shards = [], []
    for r in shard_ranges(TOTAL, 2):
        servicer = ParameterServerServicer()  # tiny chunks: many per stream
        server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
        shard = ParameterShard(r.shard_id, r.start, r.end, initial[r.start : r.end].clone(), SGD, LR, workers=2)
        servicer.attach(shard, 8)
        server.set_serving(True)
        servers.append(server)
        shards.append(shard)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    client = PsClient(addresses, TOTAL, chunk_bytes=12, push_timeout_s=10, pull_timeout_s=10)
    yield addresses, shards, client, initial
    client.close()
    for s in servers:
        s.stop(0)


def test_push_pull_round_trip_matches_torch(cluster):
    addresses, shards, client, initial = cluster
    out = torch.empty(TOTAL)
    assert client.pull(0, out) == 0 and torch.equal(out, initial)
    ref = torch.nn.Parameter(initial.clone())
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        g0, g1 = torch.randn(TOTAL, generator=gen), torch.randn(TOTAL, generator=gen)
        first = client.push(g0, worker_id=0, step=step, device_count=2)
        second = client.push(g1, worker_id=1, step=step, device_count=2)
        replies = first.wait() + second.wait()
        assert sum(r.completed for r in replies) == 2  # each shard completed exactly once
        assert client.pull(step + 1, out) == step + 1
        ref.grad = (g0 + g1) / 4
        opt.step()
        assert torch.allclose(out, ref.detach(), rtol=1e-6, atol=1e-7)


def raw_push(address, header, chunks):
    with open_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        messages = ([pb.PushRequest(header=header)] if header else []) + [pb.PushRequest(chunk=c) for c in chunks]
        return stub.Push(iter(messages), timeout=10)


def header(**overrides):
    fields = dict(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=6) | overrides
    return pb.PushHeader(**fields)


@pytest.mark.parametrize(
    "hdr, chunks, code, match",
    [
        (header(numel=5), list(encode_chunks(torch.ones(5))), grpc.StatusCode.INVALID_ARGUMENT, "owns 6 elements"),
        (
            header(dtype=pb.FLOAT64),
            list(encode_chunks(torch.ones(6, dtype=torch.float64))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "FLOAT32",
        ),
        (header(shard_id=1), list(encode_chunks(torch.ones(6))), grpc.StatusCode.INVALID_ARGUMENT, "reached shard 0"),
        (header(worker_id=9), list(encode_chunks(torch.ones(6))), grpc.StatusCode.NOT_FOUND, "unknown worker 9"),
        (header(step=3), list(encode_chunks(torch.ones(6))), grpc.StatusCode.FAILED_PRECONDITION, "ahead"),
        (None, list(encode_chunks(torch.ones(6))), grpc.StatusCode.INVALID_ARGUMENT, "must start with a PushHeader"),
        (header(), list(encode_chunks(torch.ones(4))), grpc.StatusCode.INVALID_ARGUMENT, "ended after 4 of 6"),
        (
            header(),
            list(encode_chunks(torch.ones(6, dtype=torch.float64))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "does not match",
        ),
    ],
)
def test_bad_pushes_get_the_right_status_and_change_nothing(cluster, hdr, chunks, code, match):
    addresses, shards, _, _ = cluster
    before = shards[0].parameters()
    with pytest.raises(grpc.RpcError) as err:
        raw_push(addresses[0], hdr, chunks)
    assert err.value.code() == code and match in err.value.details()
    after = shards[0].parameters()
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert shards[0].snapshot().pushes_waiting == 0


def test_stale_push_is_failed_precondition_and_duplicate_is_ok(cluster):
    addresses, shards, client, _ = cluster
    for step in range(2):
        client.push(torch.ones(TOTAL), 0, step, 1).wait()
        client.push(torch.ones(TOTAL), 1, step, 1).wait()
    reply = raw_push(addresses[0], header(step=1, worker_id=1), list(encode_chunks(torch.ones(6))))
    assert reply.duplicate and reply.version == 2
    with pytest.raises(grpc.RpcError) as err:
        raw_push(addresses[0], header(step=0), list(encode_chunks(torch.ones(6))))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale push" in err.value.details()
    assert shards[0].version == 2


def test_pull_of_a_missing_version_hits_its_deadline(cluster):
    addresses, _, _, _ = cluster
    with open_channel(addresses[0]) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(pb.PullRequest(shard_id=0, min_version=1), timeout=0.3))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(pb.PullRequest(shard_id=1, min_version=0), timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_status_and_health(cluster):
    addresses, _, _, _ = cluster
    with open_channel(addresses[1]) as channel:
        status = pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(), timeout=5)
        assert (status.shard_id, status.start, status.end, status.version) == (1, 6, 11, 0)
        # parameters, accumulator and the two halves of the published board (both allocated up front)
        buffers = 4 if shm_board.SUPPORTED else 3
        assert status.workers_expected == 2 and status.bytes_held == 5 * 4 * buffers
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="pstrain.v1.ParameterServer"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unattached_shard_is_unavailable():
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pstrain.v1.ParameterServer"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)


def test_malformed_push_bytes_are_invalid_argument_and_change_nothing(cluster):
    addresses, shards, _, _ = cluster
    before = shards[0].parameters()
    messages = [pb.PushRequest(header=header()).SerializeToString(), b"\x12\x05\x10\x01"]  # a chunk cut short
    with open_channel(addresses[0]) as channel:
        push = channel.stream_unary("/pstrain.v1.ParameterServer/Push", response_deserializer=pb.PushReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            push(iter(messages), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "runs past its end" in err.value.details()
    after = shards[0].parameters()
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert shards[0].snapshot().pushes_waiting == 0


def test_a_skip_push_with_a_payload_is_invalid_argument(cluster):
    addresses, shards, _, _ = cluster
    with pytest.raises(grpc.RpcError) as err:
        raw_push(addresses[0], header(skip=True), list(encode_chunks(torch.ones(6))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no payload" in err.value.details()
    assert shards[0].snapshot().pushes_waiting == 0 and shards[0].version == 0


def test_every_pull_of_a_version_gets_the_same_bytes_from_one_encoding(cluster):
    addresses, shards, _, initial = cluster
    with open_channel(addresses[1]) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        first, second = (list(stub.Pull(pb.PullRequest(shard_id=1, min_version=0), timeout=5)) for _ in range(2))
    assert first == second and [r.version for r in first] == [0, 0, 0]  # 5 floats in chunks of 2 elements
    data = b"".join(r.chunk.data for r in first)
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), initial[6:])


def test_a_pull_without_the_token_is_refused_and_one_with_it_is_served():
    """The token check runs on the asyncio server too, for the streaming Pull as for Push."""
    security = TransportSecurity(token="s3cret")
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], security, aio=True)
    servicer.attach(ParameterShard(0, 0, 3, torch.ones(3), SGD, LR, workers=1), 8)
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.ParameterServerStub(channel).Pull(pb.PullRequest(shard_id=0), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = PsClient([f"127.0.0.1:{server.port}"], 3, security=security)
        out = torch.empty(3)
        assert client.pull(0, out) == 0 and torch.equal(out, torch.ones(3))
        client.close()
    finally:
        server.stop(0)


def test_a_push_that_stops_sending_is_deadline_exceeded_and_frees_its_slot():
    """A worker that opens a push and stops sending holds a staging slot for the job's push timeout at most; its
    push is then refused with DEADLINE_EXCEEDED (whatever deadline its own call has) and changes nothing."""
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    shard = ParameterShard(0, 0, 6, torch.zeros(6), SGD, LR, workers=1)
    servicer.attach(shard, 8)
    servicer.push_timeout_s = 0.3  # the job's transport.push_timeout_s
    address = f"127.0.0.1:{server.port}"
    resume = threading.Event()

    def stalled():
        yield pb.PushRequest(header=header())
        yield pb.PushRequest(chunk=next(iter(encode_chunks(torch.ones(6), 8))))
        resume.wait(30)

    try:
        error: grpc.RpcError | None = None
        with open_channel(address) as channel:
            try:
                pb_grpc.ParameterServerStub(channel).Push(stalled(), timeout=60)
            except grpc.RpcError as refused:
                error = refused
            resume.set()  # the client's sending thread ends before its channel closes
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "transport.push_timeout_s" in error.details()
        assert shard.snapshot().pushes_waiting == 0 and shard.version == 0
        assert raw_push(address, header(), list(encode_chunks(torch.ones(6), 8))).completed  # the slot is free
        assert torch.equal(shard.parameters()[1], torch.full((6,), -0.5))  # that push alone moved it
    finally:
        resume.set()
        shard.close()
        server.stop(0)


def _varint(value: int) -> bytes:
    return pb.TensorChunk(offset=value).SerializeToString()[1:]  # field 4's tag, then the varint


HUGE_CHUNKS = {  # a TensorChunk's fields, ~24 MiB of them, built when a test runs
    "24 Mi packed dimensions": lambda: b"\x1a" + _varint(24 << 20) + bytes(24 << 20),
    "12 Mi unpacked dimensions": lambda: b"\x18\x00" * (12 << 20),
    "12 Mi unknown fields": lambda: b"\x78\x00" * (12 << 20),
}


@pytest.mark.parametrize("kind", list(HUGE_CHUNKS))
def test_a_chunk_of_millions_of_fields_is_refused_at_once_and_a_push_goes_through(kind):
    """The Push decoder runs on the shard's event loop before the caller's credential is checked: one 24 MiB message
    of tiny fields froze the loop (every call of every worker) for over a minute. Now it is refused after a bounded
    number of fields, within a deadline the old decoder could not meet, and the shard goes on serving."""
    message = HUGE_CHUNKS[kind]()
    with guarded_shard(6, workers=1) as ps, open_channel(ps.address) as channel:
        push = channel.stream_unary(
            "/pstrain.v1.ParameterServer/Push", request_serializer=bytes, response_deserializer=pb.PushReply.FromString
        )
        raw = b"\x12" + _varint(len(message)) + message  # PushRequest.chunk, from a caller with no credential
        with pytest.raises(grpc.RpcError) as err:
            push(iter([raw]), timeout=20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "malformed TensorChunk" in err.value.details()
        assert ps.shard.version == 0 and ps.shard.snapshot().pushes_waiting == 0
        credential = [(HEADER, ps.keys.mint("worker", 0).encode())]
        requests = [encode_push_header(header()), *encode_push_chunks(torch.ones(6), 8)]
        assert push(iter(requests), metadata=credential, timeout=20).completed
