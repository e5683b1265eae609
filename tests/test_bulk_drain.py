"""Bulk sockets while a shard stops, and tensors that are not in host memory.

Real aio gRPC shards and real sockets on 127.0.0.1. A shard that is stopping closes its bulk port while gRPC still
answers: its ``OpenBulk`` must be a passing refusal (UNAVAILABLE), not the "never bulk here" of TLS or bulk off
(FAILED_PRECONDITION), or every client streams to that address for the rest of its life. A buffer that is not in
host memory must be refused before any call starts, with an error that names its device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import CodecError, TensorAssembler
from pstrain.ps_server import bulk as server_bulk
from pstrain.ps_server.errors import NotReady
from pstrain.ps_server.main import open_bulk_port
from pstrain.runtime.ps_api import InvalidRequest
from pstrain.runtime.transport import CONTROL_TIMEOUT_S
from tests.test_shm_path import TOTAL, Cluster, pieces_of, start_cluster
from tests.test_wire_bulk import client_of, clients_on_a_clock, one_step, raw_stub


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def open_bulk_code(cluster: Cluster, shard_id: int) -> grpc.StatusCode:
    """What the shard answers worker 0's ``OpenBulk`` with (OK if it grants one)."""
    channel, _, _, grant = raw_stub(cluster.addresses[shard_id])
    with channel:
        try:
            grant(pb.BulkRequest(shard_id=shard_id, worker_id=0), timeout=CONTROL_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_stopping_shard_is_asked_for_bulk_sockets_again_once_it_is_back(cluster: Cluster) -> None:
    """Before: the drain closed the bulk port, ``OpenBulk`` answered FAILED_PRECONDITION meanwhile, and each client
    that asked then streamed to that shard for good, also after it came back on the same address."""
    clients, _ = clients_on_a_clock(cluster)  # the clock never moves: no back-off may be what brings bulk back
    try:
        pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
        one_step(clients, 0, pieces)
        ports = [s.bulk.listen() for s in cluster.servicers]
        for servicer in cluster.servicers:  # the drain's first act (``ShardDataPlane.close``); gRPC still answers
            servicer.bulk.close()
        assert open_bulk_code(cluster, 0) == grpc.StatusCode.UNAVAILABLE
        one_step(clients, 1, pieces)  # streamed meanwhile
        for client in clients:
            assert all(until != math.inf for until in client.bulk._off.values()), client.bulk._off
        for servicer, port in zip(cluster.servicers, ports, strict=True):  # back on the same port
            servicer.bulk = server_bulk.BulkSockets(host="127.0.0.1", port=port)
            servicer.bulk.listen()
        one_step(clients, 2, pieces)
        for client in clients:
            assert client.bulk.off == set() and client.bulk._idle.get(0) and client.bulk._idle.get(1)
        assert all(s.bulk.idle > 0 for s in cluster.servicers)
    finally:
        for client in clients:
            client.close()


def test_bulk_off_and_tls_are_still_refused_for_good(cluster: Cluster) -> None:
    """Only a stopping shard's refusal passes; ``transport.bulk_sockets: off`` and TLS stay FAILED_PRECONDITION."""
    stopping = server_bulk.BulkSockets(host="127.0.0.1")
    stopping.listen()
    stopping.close()
    with pytest.raises(NotReady, match="stopping"):
        stopping.grant(0)
    tls = server_bulk.BulkSockets(host="127.0.0.1")
    assert open_bulk_port(tls, tls=True, shard_id=0)
    with pytest.raises(server_bulk.BulkRefused) as refused:
        tls.grant(0)
    assert not isinstance(refused.value, NotReady)

    cluster.servicers[0].bulk.turn_off()  # what pstrain-ps does for transport.bulk_sockets: off
    assert open_bulk_code(cluster, 0) == grpc.StatusCode.FAILED_PRECONDITION


def test_a_push_from_off_the_host_is_refused_before_any_call(cluster: Cluster) -> None:
    """Before: the stream's request iterator raised inside gRPC once the shard had the header, and the caller got
    UNKNOWN "Exception iterating requests!" from ``wait``. Now ``push`` itself raises, naming the device."""
    client = client_of(cluster, 0, bulk=False)
    pieces = [p for r in client.ranges for p in pieces_of(r)]
    off_host = torch.zeros(TOTAL, device="meta")
    try:
        with pytest.raises(InvalidRequest, match="on meta"):
            client.push(off_host, 0, 0, 1)
        with pytest.raises(InvalidRequest, match="on meta"):
            client.push_pieces(off_host, pieces, 0, 0, 1)
        with pytest.raises(InvalidRequest, match="on meta"):
            client.push_pull_pieces(off_host, pieces, 0, 0, 1, torch.empty(TOTAL))
        assert all(s.snapshot().pushes_waiting == 0 and s.version == 0 for s in cluster.shards)
        client.push(torch.zeros(TOTAL), 0, 0, 1).wait()  # the client still works
    finally:
        client.close()


def test_a_pull_into_memory_off_the_host_is_refused_before_its_push(cluster: Cluster) -> None:
    """Before: the destination failed as numpy's TypeError only when its pull ran, so ``push_pull_pieces`` had
    already pushed the step's gradient (the shard counted it) when the caller got the error."""
    client = client_of(cluster, 0, bulk=False)
    pieces = [p for r in client.ranges for p in pieces_of(r)]
    off_host = torch.empty(TOTAL, device="meta")
    try:
        with pytest.raises(InvalidRequest, match="on meta"):
            client.push_pull_pieces(torch.zeros(TOTAL), pieces, 0, 0, 1, off_host)
        assert all(s.snapshot().pushes_waiting == 0 for s in cluster.shards)
        for pull in (
            lambda: client.pull(0, off_host),
            lambda: client.pull_pieces(0, off_host, pieces),
            lambda: client.pull_at(0, off_host),
        ):
            with pytest.raises(InvalidRequest, match="on meta"):
                pull()
        with pytest.raises(CodecError, match="on meta"):
            TensorAssembler(torch.float32, 4, out=torch.empty(4, device="meta"))
    finally:
        client.close()
