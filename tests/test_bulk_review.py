"""Bulk sockets (issue 12) under peers that misbehave, tensors they cannot carry and shards that restart.

Real aio gRPC shards and real sockets on 127.0.0.1. A socket must never be reused with bytes on it that no call
asked for (they would open the next payload and shift it), a payload the client cannot send must not leave the
shard waiting for it, and a shard whose bulk port moved must be asked for a new grant, not streamed to for the
whole back-off.
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Iterator

import grpc
import pytest
import torch

from pstrain.ps_server import bulk as server_bulk
from pstrain.runtime import bulk_client
from pstrain.runtime.ps_client import PsClient
from tests.helpers import wait_for
from tests.test_shm_path import TOTAL, WORKERS, Cluster, pieces_of, start_cluster
from tests.test_wire_bulk import (
    client_of,
    closed_by_peer,
    handshake,
    header,
    one_step,
    open_socket,
    raw_stub,
    same,
    state,
)

QUICK_S = 5.0  # well under the clients' 10 s push timeout: what the shard held must be free before that


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def test_a_bulk_push_with_more_bytes_than_its_header_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    """Before: the push was taken and its socket kept idle with the surplus on it, so the worker's next push on
    that socket read the surplus as its first elements and the shard applied a shifted gradient."""
    before = state(cluster)
    channel, push, _, grant = raw_stub(cluster.addresses[0])
    numel = cluster.shards[0].numel
    servicer = cluster.servicers[0]
    with channel:
        sock, ticket = open_socket(grant, 0, 0)
        call = push.future(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        sock.sendall(torch.ones(numel + 4).numpy().tobytes())  # four elements more than the header says
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than the header's" in err.value.details()
        assert closed_by_peer(sock)  # the surplus went with the socket
        sock.close()
        assert servicer.bulk.idle == 0 and servicer.bulk.held(0) == 0
        assert same(before, state(cluster))

        sock, ticket = open_socket(grant, 0, 0)  # the worker's next push, exact, still works
        call = push.future(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        sock.sendall(torch.ones(numel).numpy().tobytes())
        assert call.result().version == 0 and servicer.bulk.owner(ticket) == 0
        sock.close()


@pytest.mark.parametrize("peer_sends", [b"stray", b""], ids=["surplus-bytes", "peer-closed"])
def test_a_socket_with_anything_to_read_is_closed_not_kept(peer_sends: bytes) -> None:
    """What arrives after a call's payload (late surplus bytes, or the peer's close) must not go back to idle."""
    sockets = server_bulk.BulkSockets(host="127.0.0.1")
    port, nonce = sockets.grant(0)
    sock, ticket = handshake(port, nonce)
    try:
        assert ticket is not None
        busy = sockets.take(ticket, 0)
        if peer_sends:
            sock.sendall(peer_sends)
        else:
            sock.shutdown(socket.SHUT_WR)
        assert select.select([busy.sock], [], [], 10)[0]  # it has arrived on the shard's end
        sockets.release(busy, keep=True)  # the call itself succeeded
        assert sockets.idle == 0 and sockets.held(0) == 0
        assert closed_by_peer(sock)
    finally:
        sock.close()
        sockets.close()


def test_a_socket_with_nothing_to_read_is_kept() -> None:
    sockets = server_bulk.BulkSockets(host="127.0.0.1")
    port, nonce = sockets.grant(0)
    sock, ticket = handshake(port, nonce)
    try:
        assert ticket is not None
        sockets.release(sockets.take(ticket, 0), keep=True)
        assert sockets.idle == 1 and sockets.held(0) == 1
    finally:
        sock.close()
        sockets.close()


def error_of(call: object) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as err:  # noqa: PT011 - whatever the stream raises, bulk must raise the same
        call()  # type: ignore[operator]
    return type(err.value), str(err.value)


def settled(cluster: Cluster, client: PsClient) -> bool:
    """No shard holds a socket in a call, and the client holds no socket it does not pool."""
    pooled = {shard: len(idle) for shard, idle in client.bulk._idle.items()}
    return not any(s.bulk._busy for s in cluster.servicers) and all(
        held == pooled.get(shard, 0) for shard, held in client.bulk._held.items()
    )


def test_a_tensor_bulk_cannot_send_fails_as_the_stream_does_and_holds_nothing(cluster: Cluster) -> None:
    """A tensor whose memory is not on the CPU (here ``meta``; on a worker, CUDA). Before: ``ValueError`` escaped
    after ``PushBulk`` had started, so the shard held the socket, a staging slot and a bulk thread for the whole
    push timeout, and the client never released its socket; a pull alike."""
    streaming, bulk = client_of(cluster, 0, bulk=False), client_of(cluster, 1)
    try:
        for w, client in ((0, streaming), (1, bulk)):
            client.push(torch.zeros(TOTAL), w, 0, 1).wait()  # the bulk client opens its sockets
        for client in (streaming, bulk):
            client.pull(1, torch.empty(TOTAL))
        assert any(bulk.bulk._idle.values())
        off_cpu = torch.zeros(TOTAL, device="meta")
        got = error_of(lambda: bulk.push(off_cpu, 1, 1, 1).wait())
        wait_for(lambda: settled(cluster, bulk), QUICK_S, "the shards and the client to let go of the push's sockets")
        assert got == error_of(lambda: streaming.push(off_cpu, 0, 1, 1).wait())
        got = error_of(lambda: bulk.pull(0, off_cpu))
        wait_for(lambda: settled(cluster, bulk), QUICK_S, "the shards and the client to let go of the pull's sockets")
        assert got == error_of(lambda: streaming.pull(0, off_cpu))
        for w, client in ((0, streaming), (1, bulk)):  # both still push, the bulk one on fresh sockets
            client.push(torch.ones(TOTAL), w, 1, 1).wait()
        assert bulk.pull(2, torch.empty(TOTAL)) == 2 and any(bulk.bulk._idle.values())
    finally:
        streaming.close()
        bulk.close()


def test_a_shard_restarted_on_a_new_ephemeral_bulk_port_is_asked_for_a_new_grant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--bulk-port 0`` (the default) gives a restarted shard another port. Before: the cached grant's port refused
    the connection, so every worker streamed to that shard for ``RETRY_AFTER_S`` and warned to open a firewall."""
    reference, c = start_cluster(), start_cluster()
    clients: list[PsClient] = []
    try:
        want_clients = [client_of(reference, w, bulk=False) for w in range(WORKERS)]
        clients = [client_of(c, w) for w in range(WORKERS)]
        pieces = [p for r in want_clients[0].ranges for p in pieces_of(r)]
        want = [one_step(want_clients, step, pieces) for step in range(3)]
        assert torch.equal(one_step(clients, 0, pieces), want[0])
        for servicer in c.servicers:  # each bulk port restarts on a port of its own choosing
            old = servicer.bulk.listen()
            servicer.bulk.close()
            servicer.bulk = server_bulk.BulkSockets(host="127.0.0.1")
            assert servicer.bulk.listen() != old
        with caplog.at_level(logging.WARNING, logger=bulk_client.__name__):
            assert torch.equal(one_step(clients, 1, pieces), want[1])
            assert torch.equal(one_step(clients, 2, pieces), want[2])
        assert not [r.getMessage() for r in caplog.records if r.name == bulk_client.__name__]  # not "unreachable"
        for client in clients:
            assert client.bulk.off == set() and client.bulk._idle.get(0) and client.bulk._idle.get(1)
        assert all(s.bulk.idle > 0 for s in c.servicers)
        for client in want_clients:
            client.close()
    finally:
        for client in clients:
            client.close()
        c.stop()
        reference.stop()


def test_sockets_a_restarted_shard_closed_are_dropped_before_a_call_uses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: each idle socket whose shard end had closed (a restart; also a retired or reaped socket) was used
    by one call that the shard aborted, its payload sent into the dead socket and then streamed again."""
    aborted: list[grpc.StatusCode] = []
    older_shard = PsClient._older_shard

    def spied(self: PsClient, r: object, exc: grpc.RpcError) -> None:
        aborted.append(exc.code())
        older_shard(self, r, exc)  # type: ignore[arg-type]

    monkeypatch.setattr(PsClient, "_older_shard", spied)
    c = start_cluster()
    clients = [client_of(c, w) for w in range(WORKERS)]
    try:
        pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
        one_step(clients, 0, pieces)
        assert all(len(client.bulk._idle[shard]) > 1 for client in clients for shard in (0, 1))
        for servicer in c.servicers:  # each bulk port restarts on its fixed port: every idle socket is closed
            port = servicer.bulk.listen()
            servicer.bulk.close()
            servicer.bulk = server_bulk.BulkSockets(host="127.0.0.1", port=port)
            servicer.bulk.listen()
        idle = [s.sock for client in clients for pool in client.bulk._idle.values() for s in pool]
        wait_for(lambda: len(select.select(idle, [], [], 0)[0]) == len(idle), 10, "the shards' close to arrive")
        one_step(clients, 1, pieces)
        assert aborted == []
        for client in clients:  # the dead sockets are gone from the pool and from its count
            assert client.bulk.off == set()
            for shard in (0, 1):
                assert client.bulk._idle[shard] and client.bulk._held[shard] == len(client.bulk._idle[shard])
        assert all(s.bulk.idle > 0 for s in c.servicers)
    finally:
        for client in clients:
            client.close()
        c.stop()
