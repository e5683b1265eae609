"""The colocated shared-memory path (issue 12): real aio gRPC shards on 127.0.0.1 and real PsClients.

Pushes and pulls through shared memory must give exactly what streaming gives; a client that
cannot map the regions streams; a peer without the token or the worker's credential never gets
a region; regions are unlinked when the client closes and when the shard stops; a bad piece
changes nothing.
"""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from pstrain.coordinator.config import TransportConfig
from pstrain.coordinator.errors import ConfigError
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.runtime import shm_region
from pstrain.runtime.identity import IdentityHolder, MemberKeys
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.security import INSECURE, TransportSecurity
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import ServingServer, open_channel, start_server

TOTAL = 1000
SHARDS = 2
WORKERS = 2
PIECES_PER_SHARD = 3
SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.1)


def pieces_of(r: ShardRange) -> list[ShardRange]:
    cuts = [r.start + r.numel * i // PIECES_PER_SHARD for i in range(PIECES_PER_SHARD)] + [r.end]
    return [ShardRange(r.shard_id, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def ours() -> set[str]:
    return set(glob.glob(f"{shm_region.SHM_DIR}/{shm_region.PREFIX}{os.getpid()}-*"))


@dataclass
class Cluster:
    servers: list[ServingServer]
    servicers: list[ParameterServerServicer]
    shards: list[PiecedShard]
    addresses: list[str]
    keys: MemberKeys | None
    bf16: bool = False

    def client(self, worker: int, shared_memory: bool = True, credential: bool = True, token: str | None = None):  # type: ignore[no-untyped-def]
        push_dtype = torch.bfloat16 if self.bf16 else torch.float32
        security = INSECURE if token is None else TransportSecurity(token=token)
        if self.keys is not None and credential:
            holder = IdentityHolder()
            holder.adopt(self.keys.mint("worker", worker))
            security = security.with_identity(holder)
        return PsClient(self.addresses, TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10,
                        security=security, shared_memory=shared_memory, push_dtype=push_dtype)  # fmt: skip

    def stop(self) -> None:
        servers, self.servers = self.servers, []  # a test may stop the cluster before the fixture does
        for server, servicer, shard in zip(servers, self.servicers, self.shards, strict=False):
            shard.close()
            server.stop(0)
            servicer.close_shared_memory()


def start_cluster(
    seed: int = 0, keys: MemberKeys | None = None, token: str | None = None, bf16: bool = False
) -> Cluster:
    initial = torch.randn(TOTAL, generator=torch.Generator().manual_seed(seed))
    security = INSECURE if token is None else TransportSecurity(token=token)
    cluster = Cluster([], [], [], [], keys, bf16)
    for r in shard_ranges(TOTAL, SHARDS):
        servicer = ParameterServerServicer()
        server = start_server(
            "127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], security=security, aio=True
        )
        push_dtype = pb.BFLOAT16 if bf16 else pb.FLOAT32
        shard = PiecedShard.build(
            pieces_of(r), initial[r.start : r.end].clone(), SGD, LR, WORKERS, push_dtype=push_dtype
        )
        servicer.attach(shard, 64)
        if keys is not None:
            servicer.gate = ShardGate(keys, max_devices=1)
        server.set_serving(True)
        cluster.servers.append(server)
        cluster.servicers.append(servicer)
        cluster.shards.append(shard)
        cluster.addresses.append(f"127.0.0.1:{server.port}")
    return cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def train(cluster: Cluster, shared_memory: bool, steps: int = 3) -> tuple[torch.Tensor, list[PsClient]]:
    """Two workers push their pieces and pull them back for ``steps`` steps; the parameters at the end."""
    clients = [cluster.client(w, shared_memory) for w in range(WORKERS)]
    pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
    out = [torch.empty(TOTAL) for _ in clients]
    for step in range(steps):
        handles = []
        for w, client in enumerate(clients):
            grad = torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * step + w))
            handles.append(client.push_pieces(grad, pieces[::-1], w, step, 1))
        for handle in handles:
            handle.wait()
        for client, buf in zip(clients, out, strict=True):
            client.pull_pieces(step + 1, buf, pieces).wait()
    assert torch.equal(out[0], out[1])
    return out[0], clients


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16-push"])
def test_shared_memory_gives_the_streamed_results_bit_for_bit(bf16: bool) -> None:
    results = {}
    for shared in (False, True):
        c = start_cluster(bf16=bf16)
        try:
            params, clients = train(c, shared)
            for client in clients:
                counts = client.shared.counts
                if shared:
                    assert client.shared.active == [0, 1]
                    assert counts.streamed_bytes == 0 and counts.shared_bytes == 3 * 2 * TOTAL * 4
                else:
                    assert client.shared.active == [] and counts.shared_bytes == 0
                client.close()
            results[shared] = params
        finally:
            c.stop()
    assert torch.equal(results[True], results[False])


def test_regions_are_unlinked_once_used_when_released_and_when_the_shard_stops(cluster: Cluster) -> None:
    before = ours()
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    opened = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    assert ours() - before == {opened.push_path, opened.pull_path}
    for path in (opened.push_path, opened.pull_path):
        assert os.stat(path).st_mode & 0o777 == 0o600
    stub.CloseSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)  # what PsClient.close sends
    assert ours() - before == set()
    reopened = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=1), timeout=10)
    assert reopened.nonce != opened.nonce and len(ours() - before) == 2
    # Clients that used their regions: the names went with the first push (the mappings keep the memory).
    params, clients = train(cluster, True, steps=2)
    assert all(c.shared.active == [0, 1] for c in clients)
    assert ours() - before == set()  # worker 1's first pair on shard 0 went when its client opened another
    stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=1), timeout=10)  # opened, never used
    assert len(ours() - before) == 2
    cluster.stop()
    assert ours() - before == set()
    for client in clients:
        client.close(cancel=True)


def test_opening_again_replaces_the_pair_and_a_stale_nonce_falls_back_to_streaming(cluster: Cluster) -> None:
    before = ours()
    _, clients = train(cluster, True, steps=1)
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)  # e.g. a restarted worker 0
    assert len(ours() - before) == 2  # the new pair only
    # Worker 0's client still holds the old nonce for shard 0: refused with ABORTED, then streamed.
    grad = torch.ones(TOTAL)
    pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
    handles = [c.push_pieces(grad, pieces, w, 1, 1) for w, c in enumerate(clients)]
    for handle in handles:
        handle.wait()
    assert clients[0].shared.active == [1] and clients[0].shared.counts.streamed_bytes == cluster.shards[0].numel * 4
    for client in clients:
        client.close()
    cluster.stop()
    assert ours() - before == set()


def test_a_shard_reserves_its_regions_pages_and_one_without_room_is_streamed_to(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region's pages are taken when it is made, so a full ``/dev/shm`` (Docker's 64 MiB, say) refuses the regions
    (RESOURCE_EXHAUSTED, nothing left behind) and the worker streams, instead of the first write into a sparse file
    killing the writer with SIGBUS."""
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    opened = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    for path in (opened.push_path, opened.pull_path):
        assert os.stat(path).st_blocks * 512 >= os.stat(path).st_size  # not sparse: every page is there
    stub.CloseSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    reference, plain = train(cluster, False, steps=2)
    for client in plain:
        client.close()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # what a full tmpfs answers

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = ours()
    with pytest.raises(grpc.RpcError) as refused:
        stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "No space left" in refused.value.details() and "transport.shared_memory: off" in refused.value.details()
    assert ours() == before  # nothing half-made stays in /dev/shm
    again = start_cluster()
    try:
        params, clients = train(again, True, steps=2)
        assert torch.equal(params, reference)
        for client in clients:
            assert client.shared.active == [] and client.shared.counts.streamed_bytes > 0
            client.close()
    finally:
        again.stop()


def test_a_client_closed_with_pushes_in_flight_leaves_no_regions_on_the_shards(cluster: Cluster) -> None:
    """``close`` (no cancel) lets the pushes in flight finish, first pushes that open the regions included, and only
    then tells the shards to drop this worker's regions: none is opened after the release and left mapped."""
    client = cluster.client(0)
    pieces = [p for r in client.ranges for p in pieces_of(r)]
    pushed = client.push_pieces(torch.ones(TOTAL), pieces, 0, 0, 1)
    client.close()
    assert [a.duplicate for a in pushed.wait()] == [False] * len(pieces)
    assert client.shared.counts.shared_bytes > 0  # the pushes did go through shared memory
    assert all(not servicer.regions._pairs for servicer in cluster.servicers)


def test_a_client_that_cannot_map_the_regions_streams(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def elsewhere(path: str, numel: int, nonce: bytes) -> shm_region.Region:
        raise shm_region.ShmError(f"cannot open {path}")  # as on another host: no such file

    monkeypatch.setattr(shm_region, "attach", elsewhere)
    before = ours()
    params, clients = train(cluster, True, steps=2)
    for client in clients:
        assert client.shared.active == [] and client.shared.counts.shared_bytes == 0
        assert client.shared.counts.streamed_bytes > 0
    assert ours() - before == set()  # the client told the shards to drop the regions it could not use
    for client in clients:
        client.close()


def test_a_wrong_nonce_in_the_file_means_streaming(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shm_region.attach
    monkeypatch.setattr(shm_region, "attach", lambda path, numel, nonce: real(path, numel, bytes(16)))
    _, clients = train(cluster, True, steps=1)
    assert all(c.shared.active == [] and c.shared.counts.shared_bytes == 0 for c in clients)
    for client in clients:
        client.close()


def test_no_region_without_the_credential_or_the_token() -> None:
    keys = MemberKeys.generate()
    c = start_cluster(keys=keys, token="s3cret")
    before = ours()
    try:
        request = pb.ShmRequest(shard_id=0, worker_id=0)
        for security, code in [
            (INSECURE, grpc.StatusCode.UNAUTHENTICATED),  # no token
            (TransportSecurity(token="s3cret"), grpc.StatusCode.PERMISSION_DENIED),  # token, no credential
        ]:
            stub = pb_grpc.ParameterServerStub(open_channel(c.addresses[0], security))
            with pytest.raises(grpc.RpcError) as err:
                stub.OpenSharedMemory(request, timeout=10)
            assert err.value.code() == code
        holder = IdentityHolder()
        holder.adopt(keys.mint("worker", 1))  # worker 1 asking for worker 0's regions
        stub = pb_grpc.ParameterServerStub(
            open_channel(c.addresses[0], TransportSecurity(token="s3cret", identity=holder))
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSharedMemory(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert ours() - before == set()
        # A worker with both uses shared memory; one without its credential is refused by the push itself.
        good = c.client(0, token="s3cret")
        good.push_pieces(torch.ones(TOTAL), pieces_of(good.ranges[0]), 0, 0, 1).wait()
        assert good.shared.active == [0]
        bad = c.client(0, credential=False, token="s3cret")
        with pytest.raises(Exception, match="credential"):
            bad.push_pieces(torch.ones(TOTAL), pieces_of(bad.ranges[0]), 0, 0, 1).wait()
        assert bad.shared.active == []
        # Nor may another worker pull through worker 0's regions, even knowing the nonce.
        nonce = good.shared.for_pull(0).nonce  # type: ignore[union-attr]
        pull = pb.PullRequest(shard_id=0, min_version=0, shm_worker=0, shm_nonce=nonce)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(pull, timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        good.close()
        bad.close()
    finally:
        c.stop()


def test_bad_shared_pushes_are_refused_and_change_nothing(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    regions = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    shard = cluster.shards[0]
    before = shard.parameters()[1].clone()
    piece = shard.pieces[1]

    def push(code: grpc.StatusCode, **fields: object) -> None:
        header = pb.PushHeader(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32)
        header.numel, header.piece_start, header.shm_nonce = piece.numel, piece.start, regions.nonce
        for key, value in fields.items():
            setattr(header, key, value)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter([pb.PushRequest(header=header)]), timeout=10)
        assert err.value.code() == code, err.value.details()

    push(grpc.StatusCode.INVALID_ARGUMENT, piece_start=piece.start + 1)  # not where a piece starts
    push(grpc.StatusCode.INVALID_ARGUMENT, numel=piece.numel + 1)  # runs past the piece
    push(grpc.StatusCode.INVALID_ARGUMENT, piece_start=shard.end)  # outside the shard
    push(grpc.StatusCode.ABORTED, shm_nonce=bytes(16))  # regions it does not have
    push(grpc.StatusCode.ABORTED, worker_id=1)  # worker 1 has no regions
    with pytest.raises(grpc.RpcError) as err:  # an offset outside the regions on a pull
        list(stub.Pull(pb.PullRequest(shard_id=0, piece_start=-5, shm_worker=0, shm_nonce=regions.nonce), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert shard.version == 0 and shard.snapshot().pushes_waiting == 0
    assert torch.equal(shard.parameters()[1], before)


def test_transport_shared_memory_is_auto_or_off() -> None:
    assert TransportConfig().shared_memory == "auto"
    assert TransportConfig(shared_memory="off").shared_memory == "off"
    with pytest.raises(ConfigError, match="transport.shared_memory"):
        TransportConfig(shared_memory="on")


def test_a_shard_with_shared_memory_off_offers_none(cluster: Cluster) -> None:
    for servicer in cluster.servicers:
        servicer.regions.enabled = False  # transport.shared_memory: off on the PS side
    _, clients = train(cluster, True, steps=1)
    assert all(c.shared.active == [] and c.shared.counts.shared_bytes == 0 for c in clients)
    for client in clients:
        client.close()
