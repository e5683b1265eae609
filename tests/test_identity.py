"""Members bound to their identity (issue 8): each forgery of the issue, against real gRPC servers on 127.0.0.1.

The coordinator hands every member a credential at registration; a push, report or data-shard
request for worker ``w`` is accepted only with ``w``'s. Each forged call is refused with
PERMISSION_DENIED and the job (parameters, ledger, data shards) is exactly as before.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pstrain.coordinator.service import CoordinatorServicer
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_chunks, encode_named_tensors
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.identity import (
    HEADER,
    Credential,
    MemberKeys,
    MemberRegistry,
    MemberVerifier,
    NotIssued,
    PermissionDenied,
)
from pstrain.runtime.metrics import REJECTED
from pstrain.runtime.transport import open_channel, start_server
from tests.test_job import RAW, make_job

NUMEL = 6
SGD = pb.OptimizerSpec(name="sgd")
LR = pb.LrSchedule(scaled_lr=0.5)


def meta(credential: Credential | str) -> list[tuple[str, str]]:
    text = credential.encode() if isinstance(credential, Credential) else credential
    return [(HEADER, text)]


def rejected(code: str) -> float:
    return REJECTED.labels(code)._value.get()


# ------------------------------------------------------------------ the credentials themselves


def test_a_credential_verifies_only_for_its_member_and_key() -> None:
    keys = MemberKeys.generate()
    worker0 = keys.mint("worker", 0, 1)
    assert keys.require(meta(worker0), "worker", 0) == worker0
    with pytest.raises(PermissionDenied, match="may not act for worker 1"):
        keys.require(meta(worker0), "worker", 1)
    with pytest.raises(PermissionDenied, match="no x-pstrain-member"):
        keys.require([], "worker", 0)
    forged = Credential("worker", 0, 1, "0" * 128)
    with pytest.raises(PermissionDenied, match="not issued by this job"):
        keys.require(meta(forged), "worker", 0)
    with pytest.raises(PermissionDenied, match="not issued"):
        MemberKeys.generate().require(meta(worker0), "worker", 0)  # another job's key
    sig = worker0.signature
    for text in (
        "worker:0",
        "worker:\u00b2:1:" + sig,
        "worker:\u0663:1:" + sig,
        "worker:0:1:" + sig.upper(),
        "worker:00:1:" + sig,
    ):
        with pytest.raises(PermissionDenied, match="malformed"):  # one spelling per credential, ASCII digits only
            keys.require(meta(text), "worker", 0)
    assert worker0.signature not in repr(worker0) and "hidden" in repr(keys)


def test_what_a_shard_is_given_verifies_credentials_but_cannot_make_one() -> None:
    """A shard gets the job's public key: whoever registers as a shard (anyone with the bearer token, while its id
    is free) can check workers' credentials, not mint one (with the HMAC key of before, it could act as any)."""
    keys = MemberKeys.generate()
    shard = MemberVerifier(keys.public_key)
    worker0 = keys.mint("worker", 0, 2)
    assert shard.require(meta(worker0), "worker", 0) == worker0
    assert not hasattr(shard, "mint") and keys.job_key not in (keys.public_key, b"")
    subject = b"worker:1:0"
    for made in (
        hmac.new(keys.public_key, subject, hashlib.sha256).hexdigest() * 2,  # the old scheme, signature-long
        Ed25519PrivateKey.from_private_bytes(keys.public_key).sign(subject).hex(),  # the public key as a private one
    ):
        with pytest.raises(PermissionDenied, match="not issued by this job"):
            shard.require(meta(Credential("worker", 1, 0, made)), "worker", 1)
    with pytest.raises(ValueError, match="32 bytes"):
        MemberVerifier(b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        MemberKeys(b"0" * 16)


def test_the_registry_accepts_only_the_newest_registration_of_a_slot() -> None:
    registry = MemberRegistry()
    with pytest.raises(NotIssued):
        registry.require(meta(registry.keys.mint("worker", 0)), "worker", 0)
    old = registry.issue("worker", 0)
    assert registry.require(meta(old), "worker", 0) == old
    new = registry.issue("worker", 0)  # the worker restarted and registered again
    assert registry.require(meta(new), "worker", 0) == new
    with pytest.raises(PermissionDenied, match="replaced"):
        registry.require(meta(old), "worker", 0)
    with pytest.raises(PermissionDenied, match="only a worker"):
        registry.require_any(meta(registry.issue("ps", 0)), "worker")


# ------------------------------------------------------------------ the PS shard: forged pushes


@pytest.fixture
def guarded_shard():
    keys = MemberKeys.generate()
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    shard = ParameterShard(0, 0, NUMEL, torch.zeros(NUMEL), SGD, LR, workers=2)
    servicer.attach(shard, 8)
    servicer.gate = ShardGate(keys, max_devices=2)
    server.set_serving(True)
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield keys, shard, pb_grpc.ParameterServerStub(channel)
    channel.close()
    shard.close()
    server.stop(0)


def raw_push(channel_stub, grad: torch.Tensor, worker: int, devices: int = 1, metadata=None):  # type: ignore[no-untyped-def]
    header = pb.PushHeader(shard_id=0, worker_id=worker, step=0, device_count=devices, dtype=pb.FLOAT32, numel=NUMEL)
    requests = [pb.PushRequest(header=header), *(pb.PushRequest(chunk=c) for c in encode_chunks(grad, 8))]
    return channel_stub.Push(iter(requests), metadata=metadata, timeout=10)


def test_forged_pushes_for_a_real_worker_are_refused_and_change_nothing(guarded_shard) -> None:  # type: ignore[no-untyped-def]
    keys, shard, stub = guarded_shard
    nan = torch.full((NUMEL,), float("nan"))
    garbage = torch.full((NUMEL,), 1e6)
    worker0, worker1 = keys.mint("worker", 0, 0), keys.mint("worker", 1, 0)
    before = rejected("PERMISSION_DENIED")
    forgeries = [
        (garbage, None),  # no credential at all
        (garbage, meta(worker1)),  # another worker's credential
        (nan, meta(Credential("worker", 0, 0, "ab" * 32))),  # a made-up one
        (garbage, meta(MemberKeys.generate().mint("worker", 0, 0))),  # another job's
    ]
    for grad, metadata in forgeries:  # all before worker 0 pushed for step 0
        with pytest.raises(grpc.RpcError) as err:
            raw_push(stub, grad, worker=0, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert rejected("PERMISSION_DENIED") == before + len(forgeries)
    with pytest.raises(grpc.RpcError) as err:  # the real credential, but more devices than registered
        raw_push(stub, garbage, worker=0, devices=3, metadata=meta(worker0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "registered 2" in err.value.details()
    assert shard.version == 0 and shard.snapshot().pushes_waiting == 0
    # The real pushes are neither duplicates nor blocked: the step completes with the true gradients.
    first = raw_push(stub, torch.ones(NUMEL), worker=0, devices=1, metadata=meta(worker0))
    assert not first.duplicate and not first.completed
    last = raw_push(stub, torch.full((NUMEL,), 3.0), worker=1, devices=1, metadata=meta(worker1))
    assert last.completed and not last.duplicate and shard.version == 1
    with shard.read(1, 10) as (_, params):
        torch.testing.assert_close(params, torch.full((NUMEL,), -0.5 * 2.0))  # lr 0.5 x mean of 1 and 3


def test_pulls_need_a_member_credential_when_the_shard_has_keys(guarded_shard) -> None:  # type: ignore[no-untyped-def]
    keys, _, stub = guarded_shard
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(pb.PullRequest(shard_id=0, min_version=0), timeout=10))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    replies = list(
        stub.Pull(pb.PullRequest(shard_id=0, min_version=0), metadata=meta(keys.mint("worker", 1)), timeout=10)
    )
    assert {r.version for r in replies} == {0}


# ------------------------------------------------------------------ the coordinator: forged reports and requests


@pytest.fixture
def guarded_coordinator(tmp_path):
    job, _, _, _ = make_job(tmp_path, {**RAW, "model": {"factory": "tests.helpers:bn_mlp"}})  # a model with buffers
    registry = MemberRegistry()
    server = start_server(
        "127.0.0.1:0",
        [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job, registry))],
        ["Coordinator"],
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.CoordinatorStub(channel)
    ps = []
    for i in range(3):
        reply = stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=i, address=f"127.0.0.1:{5000 + i}"))
        assert reply.member_credential and reply.job_key == registry.keys.public_key != registry.keys.job_key
        stub.ParameterServerReady(pb.PsReadyRequest(shard_id=i), metadata=meta(reply.member_credential))
        ps.append(reply.member_credential)
    workers = []
    for _ in range(2):
        reply = stub.RegisterWorker(pb.RegisterWorkerRequest(address="127.0.0.1:0", hostname="h"))
        workers.append(reply.member_credential)
    assert [Credential.parse(c).member_id for c in workers] == [0, 1]
    yield job, stub, ps, workers
    channel.close()
    server.stop(0)
    job.close()


def step_report(worker: int, step: int = 0, loss: float = 1.0, samples: int = 8) -> pb.StepReport:
    return pb.StepReport(worker_id=worker, step=step, loss=loss, samples=samples, step_s=0.1)


def test_forged_step_reports_are_refused_and_record_nothing(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, ps, workers = guarded_coordinator
    forged = step_report(0, loss=float("nan"), samples=-2000)
    for metadata in (None, meta(workers[1]), meta(ps[0]), meta(Credential("worker", 0, 0, "00" * 32))):
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportStep(forged, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    # The worker itself cannot report impossible figures either.
    for impossible in (step_report(0, samples=-2000), step_report(0, samples=9), step_report(0, loss=float("nan"))):
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportStep(impossible, metadata=meta(workers[0]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a step the job has not reached: the ledger refuses it
        stub.ReportStep(step_report(0, step=2), metadata=meta(workers[0]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert job.records == [] and job.ledger.completed == 0
    for worker in range(2):  # the real reports complete the step with the real figures
        stub.ReportStep(step_report(worker, loss=2.0), metadata=meta(workers[worker]))
    (record,) = job.records
    assert record.loss == 2.0 and record.global_batch == 16 and not math.isnan(record.loss)


def test_a_forged_data_shard_request_steals_nothing(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, _, workers = guarded_coordinator
    before = job.status().data_shards
    for metadata in (None, meta(workers[1])):
        with pytest.raises(grpc.RpcError) as err:
            stub.RequestDataShard(pb.DataShardRequest(worker_id=0), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            stub.CompleteDataShard(pb.CompleteDataShardRequest(worker_id=0, data_shard_id=0), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert job.status().data_shards == before
    shard = stub.RequestDataShard(pb.DataShardRequest(worker_id=0), metadata=meta(workers[0]))
    assert len(shard.indices) > 0 and job.status().data_shards.doing == before.doing + 1


def test_heartbeats_and_ps_calls_need_the_members_own_credential(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    _, stub, ps, workers = guarded_coordinator
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(role="worker", id=1), metadata=meta(workers[0]))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportCheckpoint(pb.CheckpointWritten(shard_id=0, step=1), metadata=meta(ps[1]))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not stub.Heartbeat(pb.HeartbeatRequest(role="worker", id=1), metadata=meta(workers[1])).stop
    with pytest.raises(grpc.RpcError) as err:  # never registered: NOT_FOUND, so a member of a lost coordinator rejoins
        stub.Heartbeat(pb.HeartbeatRequest(role="worker", id=5), metadata=meta(workers[0]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_second_registration_for_a_live_shard_is_refused(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, _, _ = guarded_coordinator
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=0, address="127.0.0.1:6666"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as err:  # every worker slot is held by a live worker
        stub.RegisterWorker(pb.RegisterWorkerRequest(address="127.0.0.1:7777", hostname="intruder"))
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS)
    assert job.state.name == "RUNNING"


def test_upload_buffers_refuses_unknown_and_huge_claims_before_allocating(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, _, workers = guarded_coordinator
    name = "1.running_mean"  # bn_mlp's: float32 (6,)
    huge = pb.TensorChunk(name=name, dtype=pb.FLOAT32, shape=[2**40], offset=0, data=b"\0" * 1024)
    unknown = pb.TensorChunk(name="no_such_buffer", dtype=pb.FLOAT32, shape=[4], offset=0, data=b"\0" * 16)
    for chunk in (huge, unknown):
        with pytest.raises(grpc.RpcError) as err:
            stub.UploadBuffers(iter([chunk]), metadata=meta(workers[0]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "expected" in err.value.details()
    # The right announcement, then more bytes than every buffer of the model holds: refused as it arrives.
    flood = [pb.TensorChunk(name=name, dtype=pb.FLOAT32, shape=[6], offset=0, data=b"\0" * 24 * 1024)]
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadBuffers(iter(flood), metadata=meta(workers[0]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadBuffers(iter([unknown]), timeout=10)  # and never without a worker's credential
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert job.export._buffers is None  # nothing was kept
    # every buffer of the model: a partial set is refused too (test_buffers_commit.py)
    good = encode_named_tensors({n: torch.ones_like(b) for n, b in job.model.model.named_buffers()}, 1024)
    stub.UploadBuffers(good, metadata=meta(workers[0]), timeout=10)
    assert torch.equal(job.export._buffers[name], torch.ones(6))
