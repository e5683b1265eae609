"""Bulk sockets, the remote data plane's payload path (issue 12): real aio gRPC shards on 127.0.0.1, real clients.

A push or pull over a bulk socket must give exactly what a gRPC stream gives; every refusal of
the stream (bad header, wrong worker, duplicate, a socket that breaks mid-payload) must be the
same status with the shard unchanged; a shard that refuses bulk sockets (off, TLS) is streamed to;
only the worker's own credential gets a nonce, and a ticket without it leaves its socket alone; a
bulk port that cannot be reached costs one connect per shard and back-off, then streams.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from pstrain.coordinator.config import TransportConfig, parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import encode_push_header
from pstrain.ps_server import bulk as server_bulk
from pstrain.ps_server.main import parse_args
from pstrain.runtime import bulk_client
from pstrain.runtime.admission import Overloaded
from pstrain.runtime.bulk_socket import TICKET_BYTES, receive_exactly
from pstrain.runtime.identity import IdentityHolder, MemberKeys
from pstrain.runtime.ps_api import InvalidRequest
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, full_service_name, open_channel
from tests.helpers import wait_for
from tests.pki import make_pki
from tests.test_job import RAW
from tests.test_shm_path import TOTAL, WORKERS, Cluster, pieces_of, start_cluster

SERVICE = full_service_name("ParameterServer")


def client_of(cluster: Cluster, worker: int, bulk: bool = True, security: TransportSecurity = INSECURE) -> PsClient:
    if cluster.keys is not None:
        holder = IdentityHolder()
        holder.adopt(cluster.keys.mint("worker", worker))
        security = security.with_identity(holder)
    dtype = torch.bfloat16 if cluster.bf16 else torch.float32
    return PsClient(cluster.addresses, TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10,
                    security=security, shared_memory=False, push_dtype=dtype, bulk=bulk)  # fmt: skip


def train(cluster: Cluster, bulk: bool, steps: int = 3) -> tuple[torch.Tensor, list[PsClient]]:
    clients = [client_of(cluster, w, bulk) for w in range(WORKERS)]
    pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
    out = [torch.empty(TOTAL) for _ in clients]
    for step in range(steps):
        handles = []
        for w, client in enumerate(clients):
            grad = torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * step + w))
            if step == 1:  # whole-shard pushes and pulls too, not only pieces
                handles.append(client.push(grad, w, step, 1))
            else:
                handles.append(client.push_pieces(grad, pieces[::-1], w, step, 1))
        for handle in handles:
            handle.wait()
        for client, buf in zip(clients, out, strict=True):
            if step == 1:
                assert client.pull(step + 1, buf) == step + 1
            else:
                client.pull_pieces(step + 1, buf, pieces).wait()
    assert torch.equal(out[0], out[1])
    return out[0], clients


def trained_on_a_fresh_cluster() -> torch.Tensor:
    """What ``train`` over bulk sockets gives on a cluster that offers them: the reference of a fallback's result."""
    c = start_cluster()
    try:
        want, clients = train(c, bulk=True)
        for client in clients:
            client.close()
        return want
    finally:
        c.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def raw_stub(address: str, security: TransportSecurity = INSECURE):  # type: ignore[no-untyped-def]
    channel = open_channel(address, security)
    push = channel.stream_unary(f"/{SERVICE}/Push", lambda b: b, pb.PushReply.FromString)
    pull = channel.unary_stream(f"/{SERVICE}/Pull", pb.PullRequest.SerializeToString, pb.PullReply.FromString)
    grant = channel.unary_unary(f"/{SERVICE}/OpenBulk", pb.BulkRequest.SerializeToString, pb.BulkGrant.FromString)
    return channel, push, pull, grant


def open_socket(grant_call, shard_id: int, worker_id: int) -> tuple[socket.socket, bytes]:  # type: ignore[no-untyped-def]
    grant = grant_call(pb.BulkRequest(shard_id=shard_id, worker_id=worker_id), timeout=CONTROL_TIMEOUT_S)
    sock = socket.create_connection(("127.0.0.1", grant.port), timeout=10)
    sock.sendall(grant.nonce)
    ticket = bytearray(TICKET_BYTES)
    receive_exactly(sock, memoryview(ticket), 10)
    return sock, bytes(ticket)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end has closed (EOF, or a reset when it closed with our bytes unread)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def header(shard_id: int, worker_id: int, step: int, numel: int, ticket: bytes) -> bytes:
    return encode_push_header(
        pb.PushHeader(
            shard_id=shard_id,
            worker_id=worker_id,
            step=step,
            device_count=1,
            dtype=pb.FLOAT32,
            numel=numel,
            bulk_ticket=ticket,
        )
    )


def state(cluster: Cluster) -> list[tuple[int, int, torch.Tensor]]:
    out = []
    for shard in cluster.shards:
        s = shard.snapshot()
        with shard.read(0, 5) as (_, published):
            out.append((s.version, s.pushes_waiting, published.clone()))
    return out


def same(a: list[tuple[int, int, torch.Tensor]], b: list[tuple[int, int, torch.Tensor]]) -> bool:
    return all(x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16-push"])
def test_bulk_sockets_give_the_streamed_results_bit_for_bit(bf16: bool) -> None:
    results = {}
    for bulk in (False, True):
        c = start_cluster(bf16=bf16)
        try:
            params, clients = train(c, bulk)
            for client in clients:
                idle = sum(len(v) for v in client.bulk._idle.values())
                assert (idle > 0) == bulk and not client.bulk.off  # every call went through a socket, or none
                client.close()
            assert (sum(s.bulk.idle for s in c.servicers) > 0) == bulk
            results[bulk] = params
        finally:
            c.stop()
    assert torch.equal(results[True], results[False])


def test_a_duplicate_bulk_push_counts_once_and_spoils_only_its_socket(cluster: Cluster) -> None:
    zero, one = client_of(cluster, 0), client_of(cluster, 1)
    grad = torch.randn(TOTAL)
    assert not any(a.duplicate for a in zero.push(grad, 0, 0, 1).wait())
    assert all(a.duplicate for a in zero.push(grad * 7, 0, 0, 1).wait())  # the payload is never read
    assert all(a.completed for a in one.push(grad, 1, 0, 1).wait())
    out = torch.empty(TOTAL)
    assert zero.pull(1, out) == 1
    reference = start_cluster()
    try:
        ref_clients = [client_of(reference, w, bulk=False) for w in range(WORKERS)]
        for w, client in enumerate(ref_clients):
            client.push(grad, w, 0, 1).wait()
        expected = torch.empty(TOTAL)
        ref_clients[0].pull(1, expected)
        assert torch.equal(out, expected)
        for client in ref_clients:
            client.close()
    finally:
        reference.stop()
    zero.push(grad, 0, 1, 1).wait()  # the spoilt socket was replaced
    zero.close()
    one.close()


def test_bad_bulk_pushes_are_refused_and_change_nothing(cluster: Cluster) -> None:
    before = state(cluster)
    channel, push, _, grant = raw_stub(cluster.addresses[0])
    numel = cluster.shards[0].numel
    with channel:
        sock, ticket = open_socket(grant, 0, 0)
        with pytest.raises(grpc.RpcError) as err:  # a size the shard does not have
            call = push.future(iter((header(0, 0, 0, numel + 1, ticket),)), timeout=10)
            sock.sendall(torch.ones(numel + 1).numpy().tobytes())
            call.result()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        sock.close()
        with pytest.raises(grpc.RpcError) as err:  # that ticket is gone with its socket
            push(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED

        sock, ticket = open_socket(grant, 0, 0)
        with pytest.raises(grpc.RpcError) as err:  # worker 1 pushing through worker 0's socket
            push(iter((header(0, 1, 0, numel, ticket),)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        sock.close()

        sock, ticket = open_socket(grant, 0, 0)
        call = push.future(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        sock.sendall(torch.ones(numel // 2).numpy().tobytes())
        sock.close()  # half the payload, then the socket breaks
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.ABORTED

        sock, ticket = open_socket(grant, 0, 0)
        call = push.future(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        sock.sendall(torch.ones(numel // 2).numpy().tobytes())
        # The shard reads this push's payload now (a cancel that beat the header would leave the socket idle).
        wait_for(lambda: ticket in cluster.servicers[0].bulk._busy, 10, "the shard taking the push's socket")
        call.cancel()  # the caller gives up mid-payload: the shard's read ends with the socket
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
        assert closed_by_peer(sock)  # the shard closed its end
        sock.close()
    assert same(before, state(cluster))
    # The shard still works, for bulk and streaming clients alike.
    _, clients = train(cluster, bulk=True, steps=1)
    for client in clients:
        client.close()


def test_a_shard_that_refuses_bulk_sockets_is_streamed_to() -> None:
    c = start_cluster()
    try:
        for servicer in c.servicers:
            servicer.bulk.enabled = False
        got, clients = train(c, bulk=True)
        assert torch.equal(got, trained_on_a_fresh_cluster())
        for client in clients:
            assert client.bulk.off == {0, 1} and not client.bulk._idle.get(0)
            client.close()
    finally:
        c.stop()


def test_only_the_workers_credential_gets_a_nonce() -> None:
    c = start_cluster(keys=MemberKeys.generate())
    try:
        _, _, _, grant = raw_stub(c.addresses[0])
        with pytest.raises(grpc.RpcError) as err:
            grant(pb.BulkRequest(shard_id=0, worker_id=0), timeout=10)
        assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        got, clients = train(c, bulk=True, steps=1)  # with credentials: bulk sockets
        for client in clients:
            assert not client.bulk.off and client.bulk._idle.get(0)
            client.close()
    finally:
        c.stop()


def test_over_tls_a_shard_refuses_bulk_sockets_and_the_client_streams(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bundle = make_pki(tmp_path)
    pem = [p.read_bytes() for p in (bundle.ca, bundle.cert, bundle.key)]
    security = TransportSecurity(ca_pem=pem[0], cert_pem=pem[1], key_pem=pem[2])
    from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
    from pstrain.ps_server.shard import ParameterShard
    from pstrain.runtime.transport import start_server

    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], security, aio=True)
    sgd = pb.OptimizerSpec(name="sgd")
    servicer.attach(ParameterShard(0, 0, 5, torch.zeros(5), sgd, pb.LrSchedule(scaled_lr=1.0), workers=1), 8)
    try:
        client = PsClient([f"127.0.0.1:{server.port}"], 5, security=security, shared_memory=False)
        client.push(torch.ones(5), 0, 0, 1).wait()
        out = torch.empty(5)
        assert client.pull(1, out) == 1 and torch.equal(out, -torch.ones(5))
        assert client.bulk.off == {0} and servicer.bulk.idle == 0
        client.close()
    finally:
        server.stop(0)
        servicer.close_shared_memory()


def handshake(port: int, nonce: bytes) -> tuple[socket.socket, bytes | None]:
    """Connect and send ``nonce``; the ticket, or None if the port closed the connection instead."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(nonce)
    ticket = bytearray(TICKET_BYTES)
    try:
        receive_exactly(sock, memoryview(ticket), 10)
    except ConnectionError:
        return sock, None
    return sock, bytes(ticket)


def test_a_worker_keeps_a_bounded_number_of_idle_sockets() -> None:
    """Beyond its cap a worker's handshake is refused (its sockets in use are never closed for a newcomer)."""
    sockets = server_bulk.BulkSockets()
    port, nonce = sockets.grant(3)
    opened = []
    try:
        for i in range(server_bulk.MAX_SOCKETS_PER_WORKER + 3):
            sock, ticket = handshake(port, nonce)
            opened.append(sock)
            assert (ticket is not None) == (i < server_bulk.MAX_SOCKETS_PER_WORKER)
        assert sockets.idle == server_bulk.MAX_SOCKETS_PER_WORKER
        with pytest.raises(server_bulk.StaleBulk):
            sockets.take(b"\0" * TICKET_BYTES, 3)
        bad = socket.create_connection(("127.0.0.1", port), timeout=10)
        bad.sendall(b"x" * len(nonce))  # a wrong nonce: closed without a ticket
        assert closed_by_peer(bad)
        bad.close()
    finally:
        for sock in opened:
            sock.close()
        sockets.close()
    with pytest.raises(server_bulk.BulkRefused):
        sockets.grant(3)


def test_a_client_error_is_the_streams_error() -> None:
    """A push the shard refuses fails with the same ps_api error over a bulk socket as over a stream."""
    for bulk in (True, False):
        c = start_cluster()
        try:
            client = client_of(c, 0, bulk)
            with pytest.raises(InvalidRequest):
                client.push(torch.full((TOTAL,), float("nan")), 0, 0, 1).wait()
            assert c.shards[0].snapshot().pushes_waiting == 0
            if bulk:  # a refusal of the push is not one of the transport's: the client keeps its bulk sockets
                client.push(torch.ones(TOTAL), 0, 0, 1).wait()
                assert client.bulk.off == set() and not client._bulk_on_streams
                assert client.bulk._idle.get(0) and client.bulk._idle.get(1)
            client.close()
        finally:
            c.stop()


# ------------------------------------------------------------------ operating it: config, flags, failures


def test_transport_bulk_sockets_is_auto_or_off_and_reaches_the_job_spec() -> None:
    assert TransportConfig().bulk_sockets == "auto"
    assert TransportConfig(bulk_sockets="off").bulk_sockets == "off"
    assert TransportConfig(bulk_sockets=False).bulk_sockets == "off"  # YAML reads a bare ``off`` as false
    with pytest.raises(ConfigError, match="transport.bulk_sockets"):
        TransportConfig(bulk_sockets="on")
    for raw, off in (({}, False), ({"bulk_sockets": False}, True), ({"bulk_sockets": "auto"}, False)):
        cfg = parse_config({**RAW, "transport": raw})
        assert job_spec(cfg, make_plan(cfg), ModelState(cfg).layout, "bulk").bulk_sockets_off is off
    with pytest.raises(ConfigError, match="transport.bulk_sockets"):
        parse_config({**RAW, "transport": {"bulk_sockets": 3}})


def test_the_ps_flags_name_the_bulk_port() -> None:
    base = ["--shard-id", "0", "--coordinator", "127.0.0.1:1"]
    default = parse_args(base)
    assert default.bulk_port == 0 and not default.no_bulk
    fixed = parse_args([*base, "--bulk-port", "7150", "--no-bulk"])
    assert fixed.bulk_port == 7150 and fixed.no_bulk
    with pytest.raises(SystemExit):
        parse_args([*base, "--bulk-port", "70000"])


def test_a_fixed_bulk_port_listens_on_the_bind_host_and_a_taken_one_fails_at_listen() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    first = server_bulk.BulkSockets(host="127.0.0.1", port=port)
    taken = server_bulk.BulkSockets(host="127.0.0.1", port=port)
    try:
        assert first.listen() == port and first.listen() == port  # idempotent
        assert first.grant(0)[0] == port
        with pytest.raises(OSError):
            taken.listen()
    finally:
        first.close()
        taken.close()


def blackhole() -> tuple[int, Callable[[], None]]:
    """A port that never answers: a listener whose accept queue is full drops new SYNs (and one that got in is
    never accepted, so its handshake is never answered either)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fill = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fill.append(s)

    def close() -> None:
        for s in (*fill, listener):
            s.close()

    return port, close


def refused() -> tuple[int, Callable[[], None]]:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    return port, lambda: None


def clients_on_a_clock(cluster: Cluster) -> tuple[list[PsClient], list[float]]:
    """A client per worker whose bulk back-offs read ``now[0]`` (the test moves it on) instead of the clock."""
    now = [0.0]
    clients = [client_of(cluster, w) for w in range(WORKERS)]
    for client in clients:
        client.bulk.clock = lambda: now[0]
    return clients, now


def one_step(clients: list[PsClient], step: int, pieces: list) -> torch.Tensor:  # type: ignore[type-arg]
    for w, client in enumerate(clients):
        grad = torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * step + w))
        client.push_pieces(grad, pieces[::-1], w, step, 1).wait()
    out = [torch.empty(TOTAL) for _ in clients]
    for client, buf in zip(clients, out, strict=True):
        client.pull_pieces(step + 1, buf, pieces).wait()
    assert torch.equal(out[0], out[1])
    return out[0]


@pytest.mark.parametrize("port_of", [refused, blackhole], ids=["refused", "blackholed"])
def test_an_unreachable_bulk_port_is_tried_once_then_streamed_to_until_the_back_off_ends(
    port_of: Callable[[], tuple[int, Callable[[], None]]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(bulk_client, "CONNECT_TIMEOUT_S", 0.5)
    attempts: list[int] = []
    lock = threading.Lock()
    connect = bulk_client.BulkClient._connect

    def counted(self, shard_id, worker_id, grant):  # type: ignore[no-untyped-def]
        with lock:
            attempts.append(shard_id)
        return connect(self, shard_id, worker_id, grant)

    monkeypatch.setattr(bulk_client.BulkClient, "_connect", counted)
    reference, c = start_cluster(), start_cluster()
    bad_port, close_port = port_of()
    try:
        want_clients = [client_of(reference, w, bulk=False) for w in range(WORKERS)]
        pieces = [p for r in want_clients[0].ranges for p in pieces_of(r)]
        want = [one_step(want_clients, step, pieces) for step in range(3)]
        for servicer in c.servicers:  # a firewall between the workers and the bulk ports
            real = servicer.bulk.grant
            servicer.bulk.grant = lambda w, i=0, real=real: (bad_port, real(w, i)[1])  # type: ignore[method-assign]
        clients, now = clients_on_a_clock(c)
        with caplog.at_level(logging.WARNING, logger=bulk_client.__name__):
            assert torch.equal(one_step(clients, 0, pieces), want[0])  # streamed
        assert sorted(attempts) == [0, 0, 1, 1]  # one try per shard and client, however many pieces were sent
        warnings = [r.getMessage() for r in caplog.records if r.name == bulk_client.__name__]
        assert len(warnings) == 4 and all(f"port {bad_port}" in m and "streaming" in m for m in warnings)
        for client in clients:
            assert client.bulk.off == {0, 1} and not any(client.bulk._idle.values())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=bulk_client.__name__):
            assert torch.equal(one_step(clients, 1, pieces), want[1])
        assert len(attempts) == 4 and not caplog.records  # no second wait, no second warning
        for servicer in c.servicers:  # the port is opened; once the back-off is over, bulk sockets again
            del servicer.bulk.grant
        now[0] += bulk_client.RETRY_AFTER_S + 1
        assert torch.equal(one_step(clients, 2, pieces), want[2])
        for client in clients:
            assert client.bulk.off == set() and client.bulk._idle.get(0) and client.bulk._idle.get(1)
        assert all(s.bulk.idle > 0 for s in c.servicers)
        for client in (*clients, *want_clients):
            client.close()
    finally:
        close_port()
        c.stop()
        reference.stop()


def test_a_shard_that_cannot_grant_a_bulk_socket_now_is_asked_again_after_the_back_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ``OpenBulk`` refused for a passing reason (RESOURCE_EXHAUSTED: the shard is overloaded) is not a refusal
    for good, as TLS or bulk off are: the worker streams to that shard, asks again once the back-off is over, and
    moves its tensors on bulk sockets from then on."""
    reference, c = start_cluster(), start_cluster()
    try:
        want_clients = [client_of(reference, w, bulk=False) for w in range(WORKERS)]
        pieces = [p for r in want_clients[0].ranges for p in pieces_of(r)]
        want = [one_step(want_clients, step, pieces) for step in range(3)]
        asked: list[int] = []
        for servicer in c.servicers:

            def overloaded(w: int, i: int = 0) -> tuple[int, bytes]:
                asked.append(w)
                raise Overloaded("this shard holds as many pulls as it admits; try again later")

            servicer.bulk.grant = overloaded  # type: ignore[method-assign]
        clients, now = clients_on_a_clock(c)
        with caplog.at_level(logging.WARNING, logger=bulk_client.__name__):
            assert torch.equal(one_step(clients, 0, pieces), want[0])  # streamed
        warnings = [r.getMessage() for r in caplog.records if r.name == bulk_client.__name__]
        assert warnings and all("RESOURCE_EXHAUSTED" in m and "asking again" in m for m in warnings)
        assert all(client.bulk.off == {0, 1} for client in clients)
        tries = len(asked)
        assert torch.equal(one_step(clients, 1, pieces), want[1])
        assert len(asked) == tries  # not asked again during the back-off
        for servicer in c.servicers:
            del servicer.bulk.grant
        now[0] += bulk_client.RETRY_AFTER_S + 1
        assert torch.equal(one_step(clients, 2, pieces), want[2])
        for client in clients:
            assert client.bulk.off == set() and client.bulk._idle.get(0) and client.bulk._idle.get(1)
        for client in (*clients, *want_clients):
            client.close()
    finally:
        c.stop()
        reference.stop()


def test_a_ticket_without_its_workers_credential_leaves_that_socket_alone() -> None:
    keys = MemberKeys.generate()
    c = start_cluster(keys=keys)
    try:
        zero, one = client_of(c, 0), client_of(c, 1)
        grad = torch.randn(TOTAL)
        zero.push(grad, 0, 0, 1).wait()  # one call per shard: one socket per shard and worker
        one.push(grad, 1, 0, 1).wait()
        out = torch.empty(TOTAL)
        assert zero.pull(1, out) == 1
        (mine,) = zero.bulk._idle[0]
        servicer = c.servicers[0]
        assert servicer.bulk.owner(mine.ticket) == 0  # the ticket travels in the clear: assume a peer saw it
        as_one = IdentityHolder()
        as_one.adopt(keys.mint("worker", 1))
        numel = c.shards[0].numel
        for security in (INSECURE.with_identity(as_one), INSECURE):  # another worker's credential; none at all
            channel, push, pull, _ = raw_stub(c.addresses[0], security)
            with channel:
                with pytest.raises(grpc.RpcError) as err:
                    list(pull(pb.PullRequest(shard_id=0, min_version=1, bulk_ticket=mine.ticket), timeout=10))
                assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
                assert servicer.bulk.owner(mine.ticket) == 0  # still idle, still open
                with pytest.raises(grpc.RpcError) as err:  # a push naming worker 0 without its credential
                    push(iter((header(0, 0, 1, numel, mine.ticket),)), timeout=10)
                assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
                if security is not INSECURE:  # worker 1's own credential, worker 0's ticket
                    with pytest.raises(grpc.RpcError) as err:
                        push(iter((header(0, 1, 1, numel, mine.ticket),)), timeout=10)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert servicer.bulk.owner(mine.ticket) == 0
        assert c.shards[0].snapshot().pushes_waiting == 0
        zero.push(grad, 0, 1, 1).wait()  # worker 0's own socket still carries its calls
        one.push(grad, 1, 1, 1).wait()
        assert zero.pull(2, out) == 2
        assert [s.ticket for s in zero.bulk._idle[0]] == [mine.ticket] and servicer.bulk.owner(mine.ticket) == 0
        zero.close()
        one.close()
    finally:
        c.stop()


# ------------------------------------------------------------------ bounds and lifecycles of the bulk port


def handshake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bulk-handshake"]


def test_handshakes_in_progress_are_bounded_and_a_connection_beyond_is_closed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_bulk, "HANDSHAKE_TIMEOUT_S", 60.0)  # the silent ones hold their slot all along
    sockets = server_bulk.BulkSockets(host="127.0.0.1")
    port, nonce = sockets.grant(0)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(server_bulk.MAX_HANDSHAKES)]
    extra = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    try:
        assert all(closed_by_peer(sock) for sock in extra)  # at once, not after the handshake timeout
        assert len(handshake_threads()) <= server_bulk.MAX_HANDSHAKES
        for sock in silent:
            sock.close()  # each handshake ends (end of stream) and frees its slot
        for thread in handshake_threads():
            thread.join(10)
        sock, ticket = handshake(port, nonce)  # the port still serves
        assert ticket is not None and sockets.idle == 1
        sock.close()
    finally:
        for sock in (*silent, *extra):
            sock.close()
        sockets.close()


class _Signal(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.set()


def test_the_port_keeps_accepting_after_running_out_of_file_descriptors() -> None:
    import os
    import resource

    sockets = server_bulk.BulkSockets(host="127.0.0.1")
    port, nonce = sockets.grant(0)
    client = socket.socket()  # its descriptor exists before the limit drops
    signal = _Signal()
    server_bulk.log.addHandler(signal)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # the next accept fails: EMFILE
        try:
            client.connect(("127.0.0.1", port))
            assert signal.seen.wait(10)  # the accept failed and said so
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.settimeout(10)
        client.sendall(nonce)  # the queued connection is accepted once descriptors are back
        ticket = bytearray(TICKET_BYTES)
        receive_exactly(client, memoryview(ticket), 10)
        assert sockets.idle == 1
    finally:
        server_bulk.log.removeHandler(signal)
        client.close()
        sockets.close()


def test_close_frees_the_port_for_good() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    sockets = server_bulk.BulkSockets(host="127.0.0.1", port=port)
    assert sockets.listen() == port
    acceptor = sockets._acceptor
    assert acceptor is not None
    sockets.close()
    assert not acceptor.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)
    again = socket.create_server(("127.0.0.1", port))  # the fixed port can be bound again (a restart)
    again.close()


def test_sockets_are_kept_per_incarnation_and_dead_ones_make_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's sockets are bounded per incarnation and dead ones make room; a newer incarnation (the worker was
    replaced) retires the old one's: its idle sockets are closed, its nonce is refused, and an old socket busy in
    a call is closed when the call ends, so no replacement leaves descriptors behind on the shard."""
    monkeypatch.setattr(server_bulk, "MAX_SOCKETS_PER_WORKER", 3)
    sockets = server_bulk.BulkSockets(host="127.0.0.1")
    port, old = sockets.grant(5, incarnation=0)
    opened = []
    try:
        old_tickets = []
        for _ in range(3):
            sock, ticket = handshake(port, old)
            opened.append(sock)
            assert ticket is not None
            old_tickets.append(ticket)
        sock, ticket = handshake(port, old)  # a fourth: refused, nothing else closed
        opened.append(sock)
        assert ticket is None and sockets.held(5, 0) == 3
        opened[0].close()  # a socket whose client went away makes room for another
        sock, ticket = handshake(port, old)
        opened.append(sock)
        assert ticket is not None and sockets.held(5, 0) == 3
        busy = sockets.take(old_tickets[1], 5)  # a call of the old process is under way

        _, new = sockets.grant(5, incarnation=1)  # the worker was replaced
        assert new != old and sockets.held(5, 0) == 1  # only the busy one is left
        assert closed_by_peer(opened[2]) and closed_by_peer(opened[-1])  # the idle ones were closed
        sock, ticket = handshake(port, old)
        opened.append(sock)
        assert ticket is None  # the old nonce is gone
        with pytest.raises(server_bulk.StaleBulk, match="replaced by incarnation 1"):
            sockets.grant(5, incarnation=0)
        sockets.release(busy, keep=True)  # its call succeeded, yet the socket is closed, not kept
        assert sockets.held(5, 0) == 0 and closed_by_peer(opened[1])
        sock, ticket = handshake(port, new)  # the replacement has sockets of its own
        opened.append(sock)
        assert ticket is not None and sockets.held(5, 1) == 1 and sockets.idle == 1
    finally:
        for sock in opened:
            sock.close()
        sockets.close()


def test_a_bulk_push_refused_after_its_payload_closes_the_socket_on_both_ends(cluster: Cluster) -> None:
    channel, push, _, grant = raw_stub(cluster.addresses[0])
    numel = cluster.shards[0].numel
    servicer = cluster.servicers[0]
    with channel:
        sock, ticket = open_socket(grant, 0, 0)
        call = push.future(iter((header(0, 0, 0, numel, ticket),)), timeout=10)
        sock.sendall(torch.full((numel,), float("nan")).numpy().tobytes())  # read whole, then refused
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert closed_by_peer(sock)  # the shard does not keep a socket its client drops
        assert servicer.bulk.idle == 0 and servicer.bulk.held(0) == 0
        sock.close()


def test_a_bulk_pull_names_its_size_and_a_wrong_one_is_refused_before_a_byte(cluster: Cluster) -> None:
    channel, _, pull, grant = raw_stub(cluster.addresses[0])
    numel = cluster.shards[0].numel
    with channel:
        for wrong in (0, numel - 1, numel + 1):
            sock, ticket = open_socket(grant, 0, 0)
            request = pb.PullRequest(shard_id=0, min_version=0, bulk_ticket=ticket, bulk_numel=wrong)
            with pytest.raises(grpc.RpcError) as err:
                list(pull(request, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(wrong) in (err.value.details() or "") and str(numel) in (err.value.details() or "")
            assert closed_by_peer(sock)  # end of stream, not a stray byte
            sock.close()
        sock, ticket = open_socket(grant, 0, 0)
        request = pb.PullRequest(shard_id=0, min_version=0, bulk_ticket=ticket, bulk_numel=numel)
        call = pull(request, timeout=10)
        got = torch.empty(numel)
        receive_exactly(sock, memoryview(got.numpy()).cast("B"), 10)
        assert [r.version for r in call] == [0]
        with cluster.shards[0].read(0, 5) as (_, published):
            assert torch.equal(got, published)
        sock.close()


def test_a_past_deadline_is_a_timeout_not_an_error() -> None:
    from pstrain.ps_server.data_plane import bounded as _bounded
    from pstrain.runtime.bulk_socket import MIN_TIMEOUT_S, send_all

    a, b = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):  # more than the socket buffers hold, nobody reading, no time left
            send_all(a, memoryview(bytearray(64 << 20)), -1.0)
    finally:
        a.close()
        b.close()
    assert _bounded(0.0, 600.0) == MIN_TIMEOUT_S and _bounded(-3.0, 600.0) == MIN_TIMEOUT_S
    assert _bounded(None, 5.0) == 5.0 and _bounded(1000.0, 5.0) == 5.0 and _bounded(2.0, 5.0) == 2.0


def test_a_bulk_pull_is_asked_for_a_credential_before_its_ticket() -> None:
    c = start_cluster(keys=MemberKeys.generate())
    try:
        zero = client_of(c, 0)
        zero.push(torch.randn(TOTAL), 0, 0, 1).wait()
        (known,) = zero.bulk._idle[0]
        channel, _, pull, _ = raw_stub(c.addresses[0])  # no credential
        with channel:
            for ticket in (b"\1" * TICKET_BYTES, known.ticket):  # unknown and known: the same answer
                with pytest.raises(grpc.RpcError) as err:
                    list(pull(pb.PullRequest(shard_id=0, bulk_ticket=ticket, bulk_numel=1), timeout=10))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert c.servicers[0].bulk.owner(known.ticket) == 0
        zero.close()
    finally:
        c.stop()


def test_a_bulk_pull_keeps_its_admission_through_the_send_and_the_job_bounds_it() -> None:
    from pstrain.ps_server.admission import ShardGate
    from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
    from pstrain.ps_server.shard import ParameterShard
    from pstrain.runtime.admission import PullLimits
    from pstrain.runtime.transport import start_server

    numel = 8 << 20  # 32 MB: far more than the socket buffers hold, so a send waits for its reader
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    sgd = pb.OptimizerSpec(name="sgd")
    servicer.attach(ParameterShard(0, 0, numel, torch.zeros(numel), sgd, pb.LrSchedule(scaled_lr=1.0), workers=1), 8)
    servicer.gate = ShardGate(pulls=PullLimits(per_shard=1, per_peer=1, max_wait_s=1.0))  # the job's pull timeout
    channel, _, pull, grant = raw_stub(f"127.0.0.1:{server.port}")
    try:
        with channel:
            sock, ticket = open_socket(grant, 0, 0)
            request = pb.PullRequest(shard_id=0, min_version=0, bulk_ticket=ticket, bulk_numel=numel)
            call = pull(request, timeout=120)  # the caller's deadline is far; the job's limit is not
            first = bytearray(1024)
            receive_exactly(sock, memoryview(first), 10)  # the send has begun; nobody reads the rest
            assert servicer.gate.pulls.waiting == 1  # still admitted: a second pull is refused meanwhile
            assert any(t.name.startswith("bulk-io") for t in threading.enumerate())
            with pytest.raises(grpc.RpcError) as err:
                list(pull(pb.PullRequest(shard_id=0, min_version=0), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 30
            assert servicer.gate.pulls.waiting == 0 and servicer.bulk.held(0) == 0
            sock.close()
    finally:
        server.stop(0)
        servicer.close_shared_memory()


def test_a_tls_shard_opens_no_bulk_port() -> None:
    from pstrain.ps_server.main import open_bulk_port

    tls = server_bulk.BulkSockets(host="127.0.0.1")
    assert open_bulk_port(tls, tls=True, shard_id=0)
    assert tls._listener is None
    with pytest.raises(server_bulk.BulkRefused):
        tls.grant(0)
    plain = server_bulk.BulkSockets(host="127.0.0.1")
    try:
        assert open_bulk_port(plain, tls=False, shard_id=0) and plain._listener is not None
    finally:
        plain.close()


def test_the_ps_unit_passes_no_bulk_when_tls_is_configured() -> None:
    import jinja2

    from tests.test_ansible import ANSIBLE

    templates = ANSIBLE / "roles/pstrain_ps/templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(templates), str(ANSIBLE / "templates")]))
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
    env.filters["regex_replace"] = lambda v, *_: v
    base = {
        "ansible_managed": "", "pstrain_user": "u", "pstrain_group": "g", "pstrain_root": "", "pstrain_prefix": "/p",
        "pstrain_config_dir": "/c", "pstrain_coordinator_address": "c:1", "inventory_hostname": "h",
        "pstrain_ps_bulk": True, "pstrain_grace_s": 10, "pstrain_log_level": "info", "pstrain_tls_ca": "",
        "pstrain_tls_cert": "", "pstrain_tls_key": "", "pstrain_token_file": "/t", "pstrain_insecure": False,
        "pstrain_metrics_host": "", "pstrain_ps_memory_max": "1G", "pstrain_limit_nofile": 1024,
        "pstrain_state_dir": "/var/lib/pstrain", "pstrain_connect_timeout_s": 120, "pstrain_start_work_s": 300,
    }  # fmt: skip
    template = env.get_template("pstrain-ps@.service.j2")

    def exec_start(variables: dict[str, object]) -> str:
        return next(line for line in template.render(variables).splitlines() if line.startswith("ExecStart="))

    plain = exec_start(base)
    assert "--bulk-port ${PSTRAIN_PS_BULK_PORT}" in plain and "--no-bulk" not in plain
    tls = exec_start({**base, "pstrain_tls_ca": "/ca", "pstrain_tls_cert": "/crt", "pstrain_tls_key": "/key"})
    assert "--no-bulk" in tls and "--bulk-port" not in tls and "--tls-ca /ca" in tls


def test_a_shard_restarted_on_its_fixed_bulk_port_is_asked_for_a_new_grant(caplog: pytest.LogCaptureFixture) -> None:
    reference, c = start_cluster(), start_cluster()
    try:
        want_clients = [client_of(reference, w, bulk=False) for w in range(WORKERS)]
        pieces = [p for r in want_clients[0].ranges for p in pieces_of(r)]
        want = [one_step(want_clients, step, pieces) for step in range(3)]
        clients = [client_of(c, w) for w in range(WORKERS)]
        assert torch.equal(one_step(clients, 0, pieces), want[0])
        for servicer in c.servicers:  # each bulk port restarts on the same port: the clients' nonces are stale
            port = servicer.bulk.listen()
            servicer.bulk.close()
            servicer.bulk = server_bulk.BulkSockets(host="127.0.0.1", port=port)
            assert servicer.bulk.listen() == port
        with caplog.at_level(logging.WARNING, logger=bulk_client.__name__):
            assert torch.equal(one_step(clients, 1, pieces), want[1])
            assert torch.equal(one_step(clients, 2, pieces), want[2])
        assert not [r.getMessage() for r in caplog.records if r.name == bulk_client.__name__]  # not "unreachable"
        for client in clients:
            assert client.bulk.off == set() and client.bulk._idle.get(0) and client.bulk._idle.get(1)
        assert all(s.bulk.idle > 0 for s in c.servicers)
        for client in (*clients, *want_clients):
            client.close()
    finally:
        c.stop()
        reference.stop()
