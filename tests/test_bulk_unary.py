"""Issue 12: the unary bulk-socket RPCs (PushBulk, PullBulk), over real aio gRPC shards on 127.0.0.1.

A remote worker's push and pull of a piece are one unary call each, the payload on its bulk socket (a stream of
one header costs both ends more CPU per piece). They must refuse what ``Push``/``Pull`` with a ticket refuse, with
the same status codes, leave the shard unchanged when they do, and refuse what belongs to another transport. The
client must use them, not the streams; to a shard that predates them (UNIMPLEMENTED) it sends its tickets in the
streams, which still take one (older workers: ``test_wire_bulk``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.data_plane import ShardDataPlane
from pstrain.ps_server.service import ParameterServerServicer
from pstrain.runtime.bulk_client import ClientSocket
from pstrain.runtime.bulk_socket import TICKET_BYTES, receive_exactly
from pstrain.runtime.identity import MemberKeys
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, open_channel
from tests.helpers import wait_for
from tests.test_shm_path import Cluster, start_cluster
from tests.test_wire_bulk import client_of, closed_by_peer, same, state, train, trained_on_a_fresh_cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def bulk_socket(stub: pb_grpc.ParameterServerStub, worker_id: int = 0) -> tuple[socket.socket, bytes]:
    """A bulk socket of ``worker_id`` to shard 0, opened as its client opens one."""
    grant = stub.OpenBulk(pb.BulkRequest(shard_id=0, worker_id=worker_id), timeout=CONTROL_TIMEOUT_S)
    sock = socket.create_connection(("127.0.0.1", grant.port), timeout=10)
    sock.sendall(grant.nonce)
    ticket = bytearray(TICKET_BYTES)
    receive_exactly(sock, memoryview(ticket), 10)
    return sock, bytes(ticket)


def piece_header(cluster: Cluster, ticket: bytes, **fields: object) -> pb.PushHeader:
    piece = cluster.shards[0].pieces[1]
    header = pb.PushHeader(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=piece.numel)
    header.piece_start, header.bulk_ticket = piece.start, ticket
    for key, value in fields.items():
        if value is None:
            header.ClearField(key)
        else:
            setattr(header, key, value)
    return header


def test_bad_unary_bulk_pushes_are_refused_with_pushs_codes_and_change_nothing(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    piece = cluster.shards[0].pieces[1]
    before = state(cluster)

    def refused(code: grpc.StatusCode, payload: torch.Tensor | None = None, **fields: object) -> None:
        """A push whose call takes its socket: refused, the shard closes its end (nothing stray is left on it)."""
        sock, ticket = bulk_socket(stub)
        call = stub.PushBulk.future(piece_header(cluster, ticket, **fields), timeout=10)
        sock.sendall((torch.ones(piece.numel) if payload is None else payload).numpy().tobytes())
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == code, err.value.details()
        assert closed_by_peer(sock)
        sock.close()

    def refused_untaken(code: grpc.StatusCode, **fields: object) -> None:
        """A push refused before its call takes a socket: the one it names stays idle, untouched."""
        sock, ticket = bulk_socket(stub)
        with pytest.raises(grpc.RpcError) as err:
            stub.PushBulk(piece_header(cluster, ticket, **fields), timeout=10)
        assert err.value.code() == code, err.value.details()
        assert cluster.servicers[0].bulk.owner(ticket) == 0
        sock.close()

    refused_untaken(grpc.StatusCode.INVALID_ARGUMENT, bulk_ticket=b"")  # no socket named: that is Push's job
    refused_untaken(grpc.StatusCode.INVALID_ARGUMENT, shm_nonce=bytes(16))  # a shared-memory piece: PushShared
    refused_untaken(grpc.StatusCode.INVALID_ARGUMENT, pull_after=True)
    refused_untaken(grpc.StatusCode.INVALID_ARGUMENT, skip=True)  # a skip carries no payload: Push
    refused_untaken(grpc.StatusCode.ABORTED, bulk_ticket=b"\1" * TICKET_BYTES)  # a socket the shard does not have
    refused_untaken(grpc.StatusCode.INVALID_ARGUMENT, worker_id=1)  # worker 0's socket: worker 1 cannot use it
    refused(grpc.StatusCode.INVALID_ARGUMENT, shard_id=1)  # the wrong shard
    refused(grpc.StatusCode.INVALID_ARGUMENT, piece_start=piece.start + 1)  # not where a piece starts
    refused(grpc.StatusCode.INVALID_ARGUMENT, numel=piece.numel + 1)  # runs past the piece
    refused(grpc.StatusCode.INVALID_ARGUMENT, numel=1 << 40)  # a buffer is never sized by an unchecked header
    refused(grpc.StatusCode.INVALID_ARGUMENT, piece_start=None, numel=1 << 40)  # nor for a whole shard
    refused(grpc.StatusCode.INVALID_ARGUMENT, dtype=pb.BFLOAT16)  # this job pushes float32
    refused(grpc.StatusCode.INVALID_ARGUMENT, dtype=99)
    refused(grpc.StatusCode.INVALID_ARGUMENT, device_count=0)
    refused(grpc.StatusCode.FAILED_PRECONDITION, step=1)  # ahead of the shard
    nan = torch.ones(piece.numel)
    nan[3] = float("nan")
    refused(grpc.StatusCode.INVALID_ARGUMENT, nan)  # read whole, then refused: never reaches the accumulator

    sock, ticket = bulk_socket(stub)
    call = stub.PushBulk.future(piece_header(cluster, ticket), timeout=10)
    sock.sendall(torch.ones(piece.numel // 2).numpy().tobytes())
    sock.close()  # half the payload, then the socket breaks
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.ABORTED

    sock, ticket = bulk_socket(stub)
    call = stub.PushBulk.future(piece_header(cluster, ticket), timeout=10)
    sock.sendall(torch.ones(piece.numel // 2).numpy().tobytes())
    # The call has taken its socket (a cancel that beat the header would leave it idle); from here a cancel closes it.
    wait_for(lambda: ticket in cluster.servicers[0].bulk._busy, 10, "the shard taking the push's socket")
    call.cancel()  # the caller gives up mid-payload: the shard's read ends with the socket
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    assert closed_by_peer(sock)
    sock.close()
    assert same(before, state(cluster))


def test_a_unary_bulk_push_and_pull_move_a_piece_and_a_duplicate_is_acknowledged_unread(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    shard = cluster.shards[0]
    piece = shard.pieces[1]
    grads = [torch.randn(piece.numel) for _ in range(2)]
    for worker in (0, 1):
        sock, ticket = bulk_socket(stub, worker)
        header = piece_header(cluster, ticket, worker_id=worker)
        call = stub.PushBulk.future(header, timeout=10)
        sock.sendall(grads[worker].numpy().tobytes())
        reply = call.result()
        assert (reply.version, reply.duplicate, reply.completed) == (int(worker == 1), False, worker == 1)
        if worker == 0:
            sock2, ticket2 = bulk_socket(stub, 0)
            again = stub.PushBulk.future(piece_header(cluster, ticket2), timeout=10)
            sock2.sendall((grads[0] * 7).numpy().tobytes())  # never read: a duplicate spoils only its socket
            assert again.result().duplicate
            assert closed_by_peer(sock2)
            sock2.close()
        sock.close()
    assert piece.version == 1 and shard.pieces[0].version == 0
    sock, ticket = bulk_socket(stub)
    request = pb.PullRequest(shard_id=0, min_version=1, piece_start=piece.start, bulk_ticket=ticket)
    request.bulk_numel = piece.numel
    call = stub.PullBulk.future(request, timeout=10)
    got = torch.empty(piece.numel)
    receive_exactly(sock, memoryview(got.numpy()).cast("B"), 10)
    reply = call.result()
    assert reply.version == 1 and not reply.HasField("chunk") and not reply.HasField("board_slot")
    with piece.read(1, 5) as (_, published):
        assert torch.equal(got, published)
    sock.close()


@dataclass
class Keyed:
    """A cluster with member credentials, worker 0's client with one bulk socket idle on shard 0 (``known``), and a
    stub without any credential."""

    cluster: Cluster
    zero: PsClient
    known: ClientSocket
    stub: pb_grpc.ParameterServerStub


@pytest.fixture
def keyed() -> Iterator[Keyed]:
    c = start_cluster(keys=MemberKeys.generate())
    try:
        zero = client_of(c, 0)
        try:
            zero.push(torch.randn(1000), 0, 0, 1).wait()
            (known,) = zero.bulk._idle[0]
            yield Keyed(c, zero, known, pb_grpc.ParameterServerStub(open_channel(c.addresses[0])))
        finally:
            zero.close()
    finally:
        c.stop()


def test_a_unary_bulk_push_without_its_workers_credential_leaves_the_socket_alone(keyed: Keyed) -> None:
    before = state(keyed.cluster)
    for ticket in (b"\1" * TICKET_BYTES, keyed.known.ticket):  # unknown and known: the same answer
        with pytest.raises(grpc.RpcError) as err:
            keyed.stub.PushBulk(piece_header(keyed.cluster, ticket, step=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert keyed.cluster.servicers[0].bulk.owner(keyed.known.ticket) == 0 and same(before, state(keyed.cluster))


def test_bad_unary_bulk_pulls_are_refused_before_a_byte(keyed: Keyed) -> None:
    numel = keyed.cluster.shards[0].numel

    def refused(code: grpc.StatusCode, **fields: object) -> None:
        request = pb.PullRequest(shard_id=0, min_version=0, bulk_ticket=keyed.known.ticket, bulk_numel=numel)
        for key, value in fields.items():
            setattr(request, key, value)
        with pytest.raises(grpc.RpcError) as err:
            keyed.stub.PullBulk(request, timeout=10)
        assert err.value.code() == code, err.value.details()

    refused(grpc.StatusCode.INVALID_ARGUMENT, bulk_ticket=b"")  # no socket named: that is Pull's job
    refused(grpc.StatusCode.INVALID_ARGUMENT, shm_worker=0)  # a pull region: PullShared
    refused(grpc.StatusCode.INVALID_ARGUMENT, board=True)
    refused(grpc.StatusCode.INVALID_ARGUMENT, shard_id=1)
    for ticket in (b"\1" * TICKET_BYTES, keyed.known.ticket):  # unknown and known: the same answer, no credential
        refused(grpc.StatusCode.PERMISSION_DENIED, bulk_ticket=ticket)
    assert keyed.cluster.servicers[0].bulk.owner(keyed.known.ticket) == 0  # its socket is left alone
    assert keyed.zero.pull(0, torch.empty(1000)) == 0  # and still works


def test_a_unary_bulk_pull_of_a_wrong_size_is_refused_and_the_socket_closed(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    numel = cluster.shards[0].numel
    for wrong in (0, numel - 1, numel + 1):
        sock, ticket = bulk_socket(stub)
        with pytest.raises(grpc.RpcError) as err:
            stub.PullBulk(pb.PullRequest(shard_id=0, min_version=0, bulk_ticket=ticket, bulk_numel=wrong), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(wrong) in (err.value.details() or "") and str(numel) in (err.value.details() or "")
        assert closed_by_peer(sock)  # end of stream, not a stray byte
        sock.close()


def test_the_client_moves_bulk_payloads_with_the_unary_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    streamed: list[str] = []
    push, pull = ParameterServerServicer.Push, ParameterServerServicer.Pull

    async def counted_push(self, request_iterator, context):  # type: ignore[no-untyped-def]
        streamed.append("Push")
        return await push(self, request_iterator, context)

    async def counted_pull(self, request, context):  # type: ignore[no-untyped-def]
        streamed.append("Pull")
        async for reply in pull(self, request, context):
            yield reply

    monkeypatch.setattr(ParameterServerServicer, "Push", counted_push)  # registered by start_cluster, below
    monkeypatch.setattr(ParameterServerServicer, "Pull", counted_pull)
    c = start_cluster()
    try:
        _, clients = train(c, bulk=True, steps=1)  # the first calls may stream while a shard's port is probed
        streamed.clear()
        for worker, client in enumerate(clients):
            client.push(torch.randn(1000), worker, 1, 1).wait()
        for client in clients:
            assert client.pull(2, torch.empty(1000)) == 2
            assert client.bulk.off == set() and client.bulk._idle[0] and client.bulk._idle[1]
            client.close()
        assert streamed == []
    finally:
        c.stop()


def test_a_shard_that_predates_the_unary_bulk_calls_gets_the_tickets_in_the_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = trained_on_a_fresh_cluster()

    async def unimplemented(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")  # as an older shard answers

    moved = {"push": 0, "pull": 0}  # payloads the shards moved on bulk sockets: only through the streams here
    push, pull_bulk = ShardDataPlane.push, ShardDataPlane.pull_bulk

    async def counted_push(self, h, bulk, payload, time_left):  # type: ignore[no-untyped-def]
        result = await push(self, h, bulk, payload, time_left)
        moved["push"] += bulk is not None and bulk.moved
        return result

    async def counted_pull(self, request, bulk, *args):  # type: ignore[no-untyped-def]
        version = await pull_bulk(self, request, bulk, *args)
        moved["pull"] += bulk.moved
        return version

    monkeypatch.setattr(ParameterServerServicer, "PushBulk", unimplemented)
    monkeypatch.setattr(ParameterServerServicer, "PullBulk", unimplemented)
    monkeypatch.setattr(ShardDataPlane, "push", counted_push)
    monkeypatch.setattr(ShardDataPlane, "pull_bulk", counted_pull)
    c = start_cluster()
    try:
        got, clients = train(c, bulk=True)
        assert torch.equal(got, want)
        assert moved["push"] > 0 and moved["pull"] > 0
        for client in clients:  # the tickets went with the streams, which such a shard takes them in
            assert set(client._bulk_on_streams) == {0, 1} and client.bulk.off == set()
            assert client.bulk._idle.get(0) and client.bulk._idle.get(1)
            client.close()
    finally:
        c.stop()
