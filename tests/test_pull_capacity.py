"""A shard serves any number of waiting pulls: none of them holds one of the server's threads.

Real gRPC on 127.0.0.1 port 0, the server the PS process runs (asyncio, 32 pool threads).
Before issue 12 each waiting pull parked a pool thread, so 32 of them starved every push.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.transport import ServingServer, open_channel, start_server

NUMEL = 1000
CHUNK_BYTES = 1024  # four chunks per pull
POOL_THREADS = 32  # start_server's default, as the PS process runs it
SGD = pb.OptimizerSpec(name="sgd")
LR = pb.LrSchedule(scaled_lr=0.5)
DEADLINE_S = 60.0


def serve(workers: int) -> tuple[ServingServer, ParameterServerServicer, ParameterShard, str]:
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    shard = ParameterShard(0, 0, NUMEL, torch.zeros(NUMEL), SGD, LR, workers=workers)
    servicer.attach(shard, CHUNK_BYTES)
    server.set_serving(True)
    return server, servicer, shard, f"127.0.0.1:{server.port}"


@pytest.fixture
def sixty_four() -> Iterator[tuple[ParameterServerServicer, ParameterShard, str]]:
    server, servicer, shard, address = serve(workers=64)
    yield servicer, shard, address
    shard.close()
    server.stop(0)


def test_64_waiting_pulls_then_64_pushes_all_complete(sixty_four) -> None:  # type: ignore[no-untyped-def]
    servicer, shard, address = sixty_four
    workers = 64
    clients = [PsClient([address], NUMEL, chunk_bytes=CHUNK_BYTES, pull_timeout_s=DEADLINE_S) for _ in range(workers)]
    outs = [torch.full((NUMEL,), float("nan")) for _ in range(workers)]
    try:
        with ThreadPoolExecutor(max_workers=workers) as pullers:
            pulls = [pullers.submit(c.pull, 1, out) for c, out in zip(clients, outs, strict=True)]
            assert servicer.wait_until_pulls_waiting(workers, DEADLINE_S), (
                f"only {servicer.pulls_waiting} of {workers} pulls reached the shard"
            )
            assert not any(p.done() for p in pulls)
            grads = [torch.full((NUMEL,), float(w)) for w in range(workers)]
            handles = [c.push(g, w, 0, 1) for w, (c, g) in enumerate(zip(clients, grads, strict=True))]
            acks = [ack for h in handles for ack in h.wait()]  # the client's push_timeout_s bounds each
            assert sum(a.completed for a in acks) == 1 and not any(a.duplicate for a in acks)
            versions = [p.result(DEADLINE_S) for p in pulls]
    finally:
        for client in clients:
            client.close(cancel=True)
    assert versions == [1] * workers
    expected = -0.5 * torch.stack(grads).mean(0)
    for out in outs:
        torch.testing.assert_close(out, expected)
    assert shard.version == 1 and servicer.pulls_waiting == 0


def test_a_flood_of_waiting_pulls_does_not_stop_pushes_or_status() -> None:
    server, servicer, shard, address = serve(workers=2)
    flood = 4 * POOL_THREADS
    client = PsClient([address], NUMEL, chunk_bytes=CHUNK_BYTES, push_timeout_s=DEADLINE_S)
    try:
        with open_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            # Server-streaming calls start at once: one thread holds all of them on this side.
            pulls = [stub.Pull(pb.PullRequest(shard_id=0, min_version=1), timeout=DEADLINE_S) for _ in range(flood)]
            assert servicer.wait_until_pulls_waiting(flood, DEADLINE_S), f"{servicer.pulls_waiting} of {flood} waiting"
            status = stub.GetShardStatus(pb.ShardStatusRequest(), timeout=DEADLINE_S)
            assert (status.version, status.pushes_waiting) == (0, 0)
            (first,) = client.push(torch.ones(NUMEL), 0, 0, 1).wait()
            assert (first.version, first.completed) == (0, False)
            assert servicer.pulls_waiting == flood  # still waiting: version 1 does not exist yet
            (last,) = client.push(torch.ones(NUMEL), 1, 0, 1).wait()
            assert (last.version, last.completed) == (1, True)
            for call in pulls:
                replies = list(call)
                assert {r.version for r in replies} == {1}
                data = b"".join(r.chunk.data for r in replies)
                assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), torch.full((NUMEL,), -0.5))
        assert servicer.pulls_waiting == 0
    finally:
        client.close()
        shard.close()
        server.stop(0)


def test_waiting_pulls_hold_no_server_thread(sixty_four) -> None:  # type: ignore[no-untyped-def]
    servicer, _, address = sixty_four
    flood = 3 * POOL_THREADS
    before = _server_threads()
    with open_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        pulls = [stub.Pull(pb.PullRequest(shard_id=0, min_version=1), timeout=DEADLINE_S) for _ in range(flood)]
        assert servicer.wait_until_pulls_waiting(flood, DEADLINE_S)
        assert _server_threads() - before <= 1  # at most the one thread that follows the shard's versions
        for call in pulls:
            call.cancel()
        for call in pulls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED


def _server_threads() -> int:
    return sum(t.name.startswith(("grpc-server", "shard-")) for t in threading.enumerate())
