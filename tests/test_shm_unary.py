"""Issue 12: the unary shared-memory RPCs (PushShared, PullShared) and the shard's early place for the second worker.

A colocated worker's piece push and pull are one unary call each (no stream, one thread hop on the shard); they
must refuse what ``Push``/``Pull`` refuse, with the same status codes, and change nothing when they do; a
duplicate is acknowledged and counted once; a pull waiting for a version is answered when the pushes complete it.
The client must use them (not the streams) when it has regions. The shard takes the second worker's contribution
into the accumulator at once when it arrives first: the sum stays bitwise the in-order one, and the caller may
reuse its buffer as soon as the push returns (the shared-memory region is rewritten by the next push).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.service import ParameterServerServicer
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime import shm_region
from pstrain.runtime.transport import open_channel
from tests.test_shm_path import WORKERS, Cluster, pieces_of, start_cluster, train

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.1)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


class _Regions:
    """Worker 0's regions on shard 0, mapped here as its client would map them."""

    def __init__(self, stub: pb_grpc.ParameterServerStub, worker_id: int = 0) -> None:
        reply = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=worker_id), timeout=10)
        self.nonce = reply.nonce
        self.push = shm_region.attach(reply.push_path, reply.numel, reply.nonce)
        self.pull = shm_region.attach(reply.pull_path, reply.numel, reply.nonce)

    def close(self) -> None:
        self.push.close()
        self.pull.close()


def _header(cluster: Cluster, regions: _Regions, **fields: object) -> pb.PushHeader:
    piece = cluster.shards[0].pieces[1]
    header = pb.PushHeader(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=piece.numel)
    header.piece_start, header.shm_nonce = piece.start, regions.nonce
    for key, value in fields.items():
        setattr(header, key, value)
    return header


def test_bad_unary_shared_pushes_are_refused_with_pushs_codes_and_change_nothing(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    regions = _Regions(stub)
    shard = cluster.shards[0]
    piece = shard.pieces[1]
    where = slice(piece.start - shard.start, piece.end - shard.start)
    regions.push.data[where] = 1.0
    before = shard.parameters()[1].clone()

    def refused(code: grpc.StatusCode, **fields: object) -> None:
        with pytest.raises(grpc.RpcError) as err:
            stub.PushShared(_header(cluster, regions, **fields), timeout=10)
        assert err.value.code() == code, err.value.details()

    refused(grpc.StatusCode.INVALID_ARGUMENT, shm_nonce=b"")  # no region named: that is Push's job
    refused(grpc.StatusCode.INVALID_ARGUMENT, skip=True)  # a skip carries no payload: Push
    refused(grpc.StatusCode.INVALID_ARGUMENT, bulk_ticket=b"x" * 16)
    refused(grpc.StatusCode.INVALID_ARGUMENT, shard_id=1)  # the wrong shard
    refused(grpc.StatusCode.INVALID_ARGUMENT, piece_start=piece.start + 1)  # not where a piece starts
    refused(grpc.StatusCode.INVALID_ARGUMENT, numel=piece.numel + 1)  # runs past the piece
    refused(grpc.StatusCode.INVALID_ARGUMENT, dtype=pb.BFLOAT16)  # this job pushes float32
    refused(grpc.StatusCode.INVALID_ARGUMENT, dtype=99)
    refused(grpc.StatusCode.INVALID_ARGUMENT, device_count=0)
    refused(grpc.StatusCode.NOT_FOUND, worker_id=7)  # no such worker
    refused(grpc.StatusCode.FAILED_PRECONDITION, step=1)  # ahead of the shard
    refused(grpc.StatusCode.ABORTED, shm_nonce=bytes(16))  # regions it does not have
    refused(grpc.StatusCode.ABORTED, worker_id=1)  # worker 1 has no regions
    regions.push.data[where.start + 3] = float("nan")
    refused(grpc.StatusCode.INVALID_ARGUMENT)  # a NaN in the region never reaches the accumulator
    assert shard.version == 0 and shard.snapshot().pushes_waiting == 0
    assert torch.equal(shard.parameters()[1], before)
    regions.close()


def test_a_duplicate_unary_shared_push_is_acknowledged_and_counted_once(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    regions = _Regions(stub)
    shard = cluster.shards[0]
    piece = shard.pieces[1]
    regions.push.data[piece.start - shard.start : piece.end - shard.start] = 0.5
    first = stub.PushShared(_header(cluster, regions), timeout=10)
    assert not first.duplicate and not first.completed and first.version == 0
    regions.push.data[:] = float("nan")  # a retry's payload is never read again
    again = stub.PushShared(_header(cluster, regions), timeout=10)
    assert again.duplicate and again.version == 0
    assert shard.snapshot().pushes_waiting == 1
    # Worker 1 streams its part; the step completes with worker 0's gradient counted once.
    other = pb.PushHeader(shard_id=0, worker_id=1, step=0, device_count=1, dtype=pb.FLOAT32, numel=piece.numel)
    other.piece_start = piece.start
    reference = ParameterShard(0, piece.start, piece.end, piece.parameters()[1], SGD, LR, WORKERS)
    reference.push(0, 0, torch.full((piece.numel,), 0.5), 1)
    reference.push(1, 0, torch.full((piece.numel,), 0.25), 1)
    shard.push(1, 0, torch.full((piece.numel,), 0.25), 1, piece_start=piece.start)
    assert piece.version == 1
    assert torch.equal(piece.parameters()[1], reference.parameters()[1])
    regions.close()


def test_a_unary_shared_pull_waits_for_its_version_and_refuses_bad_requests(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    regions = _Regions(stub)
    shard = cluster.shards[0]
    piece = shard.pieces[2]
    request = pb.PullRequest(shard_id=0, min_version=1, piece_start=piece.start, shm_worker=0, shm_nonce=regions.nonce)

    def refused(code: grpc.StatusCode, **fields: object) -> None:
        bad = pb.PullRequest()
        bad.CopyFrom(request)
        for key, value in fields.items():
            if value is None:
                bad.ClearField(key)
            else:
                setattr(bad, key, value)
        with pytest.raises(grpc.RpcError) as err:
            stub.PullShared(bad, timeout=1 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 10)
        assert err.value.code() == code, err.value.details()

    refused(grpc.StatusCode.INVALID_ARGUMENT, shm_worker=None)  # no region named: that is Pull's job
    refused(grpc.StatusCode.INVALID_ARGUMENT, shard_id=1)
    refused(grpc.StatusCode.INVALID_ARGUMENT, piece_start=piece.start + 1)
    refused(grpc.StatusCode.INVALID_ARGUMENT, bulk_ticket=b"x" * 16)
    refused(grpc.StatusCode.ABORTED, shm_nonce=bytes(16))
    refused(grpc.StatusCode.DEADLINE_EXCEEDED, min_version=5)  # within the call's deadline: never
    before = regions.pull.data.clone()
    assert torch.equal(regions.pull.data, before)  # nothing was written by a refused pull

    answered: list[pb.PullReply] = []
    waiting = threading.Thread(target=lambda: answered.append(stub.PullShared(request, timeout=30)))
    waiting.start()
    for worker in range(WORKERS):  # the pushes that complete the piece's step 0
        grad = torch.full((piece.numel,), 0.1 * (worker + 1))
        shard.push(worker, 0, grad, 1, piece_start=piece.start)
    # Not through the servicer: the pull sees the version by its periodic look (a push through it wakes it at once).
    waiting.join(timeout=20)
    assert not waiting.is_alive() and answered[0].version == 1 and not answered[0].HasField("chunk")
    got = regions.pull.data[piece.start - shard.start : piece.end - shard.start]
    assert torch.equal(got, piece.parameters()[1])
    regions.close()


def test_the_client_pushes_and_pulls_pieces_with_the_unary_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"Push": 0, "Pull": 0, "PushShared": 0, "PullShared": 0, "PushBulk": 0, "PullBulk": 0}
    push, pull = ParameterServerServicer.Push, ParameterServerServicer.Pull
    push_shared, pull_shared = ParameterServerServicer.PushShared, ParameterServerServicer.PullShared
    push_bulk, pull_bulk = ParameterServerServicer.PushBulk, ParameterServerServicer.PullBulk

    async def counted_push(self, requests, context):  # type: ignore[no-untyped-def]
        calls["Push"] += 1
        return await push(self, requests, context)

    async def counted_pull(self, request, context):  # type: ignore[no-untyped-def]
        calls["Pull"] += 1
        async for reply in pull(self, request, context):
            yield reply

    async def counted_push_shared(self, request, context):  # type: ignore[no-untyped-def]
        calls["PushShared"] += 1
        return await push_shared(self, request, context)

    async def counted_pull_shared(self, request, context):  # type: ignore[no-untyped-def]
        calls["PullShared"] += 1
        return await pull_shared(self, request, context)

    async def counted_push_bulk(self, request, context):  # type: ignore[no-untyped-def]
        calls["PushBulk"] += 1
        return await push_bulk(self, request, context)

    async def counted_pull_bulk(self, request, context):  # type: ignore[no-untyped-def]
        calls["PullBulk"] += 1
        return await pull_bulk(self, request, context)

    # Before the servers start: they bind the servicers' methods as they register them.
    monkeypatch.setattr(ParameterServerServicer, "Push", counted_push)
    monkeypatch.setattr(ParameterServerServicer, "Pull", counted_pull)
    monkeypatch.setattr(ParameterServerServicer, "PushShared", counted_push_shared)
    monkeypatch.setattr(ParameterServerServicer, "PullShared", counted_pull_shared)
    monkeypatch.setattr(ParameterServerServicer, "PushBulk", counted_push_bulk)
    monkeypatch.setattr(ParameterServerServicer, "PullBulk", counted_pull_bulk)
    steps = 3
    streaming = start_cluster()
    try:
        streamed, clients = train(streaming, shared_memory=False, steps=steps)
        for client in clients:
            client.close()
    finally:
        streaming.stop()
    # Remote: bulk sockets (a call streams while a shard's bulk port is first probed), never the shared calls.
    assert calls["PushShared"] == calls["PullShared"] == 0 and calls["PushBulk"] > 0 and calls["PullBulk"] > 0
    calls.update({name: 0 for name in calls})
    shared_cluster = start_cluster()
    try:
        shared, clients = train(shared_cluster, shared_memory=True, steps=steps)
        for client in clients:
            client.close()
    finally:
        shared_cluster.stop()
    pieces = sum(len(pieces_of(r)) for r in clients[0].ranges)
    assert calls == {
        "Push": 0,
        "Pull": 0,
        "PushShared": steps * WORKERS * pieces,
        "PullShared": steps * WORKERS * pieces,
        "PushBulk": 0,
        "PullBulk": 0,
    }
    assert torch.equal(shared, streamed)  # bit for bit what streaming gives
    assert all(c.shared.counts.streamed_bytes == 0 and c.shared.counts.shared_bytes > 0 for c in clients)


def test_the_second_worker_first_is_summed_in_order_and_its_buffer_is_free_at_once() -> None:
    gen = torch.Generator().manual_seed(3)
    for workers in (2, 3):
        grads = [torch.randn(7, generator=gen) * 10 ** (3 * w) for w in range(workers)]
        reference = ParameterShard(0, 0, 7, torch.zeros(7), SGD, LR, workers)
        for w in range(workers):
            reference.push(w, 0, grads[w], 1)
        shard = ParameterShard(0, 0, 7, torch.zeros(7), SGD, LR, workers)
        order = [1, *range(2, workers), 0]  # the second in order first, the first last
        for w in order:
            buf = grads[w].clone()
            shard.push(w, 0, buf, 1)
            buf.fill_(float("nan"))  # e.g. the worker's region rewritten after the acknowledgement
        assert shard.version == 1
        assert torch.equal(shard.parameters()[1], reference.parameters()[1])


def test_a_second_worker_placed_early_stays_in_the_step_when_the_first_is_removed() -> None:
    grads = [torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 4.0)]
    shard = ParameterShard(0, 0, 4, torch.zeros(4), SGD, LR, 3)
    shard.push(1, 0, grads[1].clone(), 1)  # placed early: worker 0 has not pushed
    shard.set_workers(0, [1, 2], 0.1)  # worker 0 dropped at the step in flight
    assert shard.push(2, 0, grads[2], 1).completed
    reference = ParameterShard(0, 0, 4, torch.zeros(4), SGD, LR, 2)
    reference.push(0, 0, grads[1], 1)
    reference.push(1, 0, grads[2], 1)
    assert torch.equal(shard.parameters()[1], reference.parameters()[1])
