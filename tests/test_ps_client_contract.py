"""One contract, two ParameterServerClients: gRPC to real servers on 127.0.0.1, and in-memory.

Every test runs against both, so the trainer (tested on the in-memory client) sees the same
results and the same error types that it sees in production.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.ps_api import (
    Cancelled,
    InvalidRequest,
    ParameterServerClient,
    ShardAck,
    StepConflict,
    Unavailable,
    UnknownWorker,
    WaitTimeout,
)
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import start_server

TOTAL = 11
SHARDS = 2
SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.5)


class ObservedShard(ParameterShard):
    """A shard that says when a pull has reached it, so a test cancels a pull that really waits."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.reading = threading.Event()

    def read(self, min_version: int, timeout_s: float):  # type: ignore[no-untyped-def]
        self.reading.set()
        return super().read(min_version, timeout_s)

    def read_at(self, version: int, timeout_s: float):  # type: ignore[no-untyped-def]
        self.reading.set()
        return super().read_at(version, timeout_s)


@dataclass
class Cluster:
    shards: list[ObservedShard]
    initial: torch.Tensor
    connect: Callable[..., ParameterServerClient]  # (pull_timeout_s=...) -> a new client


@pytest.fixture(params=["grpc", "local"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Two shards of an 11-element model for 2 workers, reached over gRPC or in memory."""
    initial = torch.linspace(-1, 1, TOTAL)
    shards = [
        ObservedShard(r.shard_id, r.start, r.end, initial[r.start : r.end].clone(), SGD, LR, workers=2)
        for r in shard_ranges(TOTAL, SHARDS)
    ]
    servers = []
    clients: list[ParameterServerClient] = []
    if request.param == "grpc":
        for shard in shards:
            servicer = ParameterServerServicer()
            server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
            servicer.attach(shard, 8)  # tiny chunks: many per stream
            server.set_serving(True)
            servers.append(server)
        addresses = [f"127.0.0.1:{s.port}" for s in servers]

        def connect(pull_timeout_s: float = 10.0) -> ParameterServerClient:
            client = PsClient(addresses, TOTAL, chunk_bytes=12, push_timeout_s=10, pull_timeout_s=pull_timeout_s)
            clients.append(client)
            return client
    else:

        def connect(pull_timeout_s: float = 10.0) -> ParameterServerClient:
            client = LocalPsClient(shards, pull_timeout_s=pull_timeout_s)
            clients.append(client)
            return client

    yield Cluster(shards, initial, connect)
    for client in clients:
        client.close(cancel=True)
    for shard in shards:
        shard.close()  # wakes a server-side pull still waiting for a version
    for server in servers:
        server.stop(0)


def test_pushes_from_every_worker_then_pull_match_torch(cluster: Cluster) -> None:
    workers = [cluster.connect(), cluster.connect()]  # one client per worker, as in separate processes
    assert workers[0].ranges == shard_ranges(TOTAL, SHARDS) and workers[0].total == TOTAL
    out = torch.empty(TOTAL)
    assert workers[0].pull(0, out) == 0 and torch.equal(out, cluster.initial)
    ref = torch.nn.Parameter(cluster.initial.clone())
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        g0, g1 = torch.randn(TOTAL, generator=gen), torch.randn(TOTAL, generator=gen)
        first = workers[0].push(g0, worker_id=0, step=step, device_count=2).wait()
        assert first == [ShardAck(i, step, duplicate=False, completed=False) for i in range(SHARDS)]
        second = workers[1].push(g1, worker_id=1, step=step, device_count=2).wait()
        assert second == [ShardAck(i, step + 1, duplicate=False, completed=True) for i in range(SHARDS)]
        assert workers[1].pull(step + 1, out) == step + 1
        ref.grad = (g0 + g1) / 4
        opt.step()
        torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-7)


def test_a_repeated_push_is_acknowledged_once(cluster: Cluster) -> None:
    client = cluster.connect()
    g0, g1 = torch.full((TOTAL,), 2.0), torch.full((TOTAL,), 4.0)
    client.push(g0, 0, 0, 1).wait()
    again = client.push(g0, 0, 0, 1).wait()  # a retry after a lost reply
    assert all(a.duplicate and not a.completed and a.version == 0 for a in again)
    client.push(g1, 1, 0, 1).wait()
    out = torch.empty(TOTAL)
    assert client.pull(1, out) == 1
    torch.testing.assert_close(out, cluster.initial - 0.5 * (g0 + g1) / 2)


def test_a_skipped_step_completes_everywhere_without_an_update(cluster: Cluster) -> None:
    client = cluster.connect()
    client.push(torch.full((TOTAL,), 2.0), 0, 0, 1).wait()
    acks = client.skip_step(1, 0, 1).wait()
    assert acks == [ShardAck(i, 1, duplicate=False, completed=True, skipped=True) for i in range(SHARDS)]
    assert client.skip_step(1, 0, 1).wait()[0].duplicate  # repeated: acknowledged once
    out = torch.empty(TOTAL)
    assert client.pull(1, out) == 1 and torch.equal(out, cluster.initial)
    nan = torch.full((TOTAL,), float("nan"))
    with pytest.raises(InvalidRequest, match="NaN or Inf"):
        for ack in client.push(nan, 0, 1, 1).wait():
            raise AssertionError(f"a non-finite push was accepted: {ack}")
    assert all(s.version == 1 and s.snapshot().pushes_waiting == 0 for s in cluster.shards)


def test_stale_and_ahead_pushes_are_step_conflicts(cluster: Cluster) -> None:
    client = cluster.connect()
    with pytest.raises(StepConflict, match="ahead"):
        client.push(torch.ones(TOTAL), 0, 2, 1).wait()
    for step in range(2):
        client.push(torch.ones(TOTAL), 0, step, 1).wait()
        client.push(torch.ones(TOTAL), 1, step, 1).wait()
    before = [s.parameters() for s in cluster.shards]
    with pytest.raises(StepConflict, match="stale push"):
        client.push(torch.ones(TOTAL), 0, 0, 1).wait()
    for shard, (version, params) in zip(cluster.shards, before, strict=True):
        assert shard.version == version == 2 and torch.equal(shard.parameters()[1], params)


def test_requests_the_shards_refuse(cluster: Cluster) -> None:
    client = cluster.connect()
    with pytest.raises(UnknownWorker, match="unknown worker 9"):
        client.push(torch.ones(TOTAL), 9, 0, 1).wait()
    with pytest.raises(InvalidRequest, match="device_count"):
        client.push(torch.ones(TOTAL), 0, 0, 0).wait()
    assert all(s.snapshot().pushes_waiting == 0 for s in cluster.shards)


@pytest.mark.parametrize(
    "flat",
    [torch.ones(TOTAL - 1), torch.ones(TOTAL, dtype=torch.float64), torch.ones(1, TOTAL)],
    ids=["short", "float64", "2-d"],
)
def test_wrong_buffers_are_invalid_requests(cluster: Cluster, flat: torch.Tensor) -> None:
    client = cluster.connect()
    with pytest.raises(InvalidRequest, match="float32"):
        client.push(flat, 0, 0, 1)
    with pytest.raises(InvalidRequest, match="float32"):
        client.pull(0, torch.empty_like(flat))
    with pytest.raises(ValueError):  # InvalidRequest is a ValueError, as the old client raised
        client.pull(0, torch.empty(2 * TOTAL)[::2])  # right size, not contiguous
    assert all(s.version == 0 and s.snapshot().pushes_waiting == 0 for s in cluster.shards)


def test_pull_of_a_version_nobody_makes_times_out(cluster: Cluster) -> None:
    client = cluster.connect(pull_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(WaitTimeout):
        client.pull(5, torch.empty(TOTAL))
    assert time.monotonic() - started < 5


def test_a_closed_shard_is_unavailable(cluster: Cluster) -> None:
    client = cluster.connect()
    cluster.shards[1].close()
    with pytest.raises(Unavailable, match="shutting down"):
        client.push(torch.ones(TOTAL), 0, 0, 1).wait()
    with pytest.raises(Unavailable, match="shutting down"):
        client.pull(0, torch.empty(TOTAL))


@pytest.mark.parametrize("call", ["pull", "pull_at"])
def test_close_with_cancel_ends_a_waiting_pull_promptly(cluster: Cluster, call: str) -> None:
    client = cluster.connect(pull_timeout_s=60)
    raised: list[BaseException] = []

    def pull() -> None:
        try:
            getattr(client, call)(1, torch.empty(TOTAL))
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            raised.append(exc)

    puller = threading.Thread(target=pull, daemon=True)
    puller.start()
    assert cluster.shards[0].reading.wait(10), "the pull never reached a shard"
    started = time.monotonic()
    client.close(cancel=True)
    puller.join(10)
    assert not puller.is_alive(), "close(cancel=True) left the pull waiting"
    assert time.monotonic() - started < 5
    assert len(raised) == 1 and isinstance(raised[0], Cancelled), raised
    with pytest.raises(Cancelled):
        client.pull(0, torch.empty(TOTAL))
    with pytest.raises(Cancelled):
        client.push(torch.ones(TOTAL), 0, 0, 1)


def test_close_lets_calls_finish_and_refuses_new_ones(cluster: Cluster) -> None:
    client = cluster.connect()
    acks = client.push(torch.ones(TOTAL), 0, 0, 1)
    client.close()
    assert len(acks.wait()) == SHARDS
    with pytest.raises(Cancelled):
        client.pull(0, torch.empty(TOTAL))


def test_close_lets_a_push_and_pull_in_flight_finish(cluster: Cluster) -> None:
    """Without cancel, ``close`` refuses new calls but lets a push-and-pull in flight finish (over shared memory
    one call, which waits for the step's other worker) before it lets go of the channels and regions: the caller
    gets its acknowledgements and the new version, not ``Cancelled``."""
    workers = [cluster.connect(), cluster.connect()]
    pieces = shard_ranges(TOTAL, SHARDS)
    out = torch.zeros(TOTAL)
    pushed, pulled = workers[0].push_pull_pieces(torch.ones(TOTAL), pieces, 0, 0, 1, out)
    deadline = time.monotonic() + 10
    while not all(s.last_step_of(0) == 0 for s in cluster.shards):  # the shards have counted worker 0's pushes
        assert time.monotonic() < deadline, "worker 0's pushes never reached the shards"
        time.sleep(0.01)
    closer = threading.Thread(target=workers[0].close)
    closer.start()
    while True:  # close has begun once the client refuses a new call
        assert time.monotonic() < deadline, "close never began"
        try:
            workers[0].pull(0, torch.empty(TOTAL))
        except Cancelled:
            break
    assert closer.is_alive(), "close returned with a pull in flight"
    assert workers[1].push_pull_pieces(torch.ones(TOTAL), pieces, 1, 0, 1, torch.zeros(TOTAL))[1].wait() == 1
    closer.join(10)
    assert not closer.is_alive()
    assert [(a.shard_id, a.duplicate) for a in pushed.wait()] == [(i, False) for i in range(SHARDS)]
    assert pulled.wait() == 1
    torch.testing.assert_close(out, cluster.initial - 0.5, rtol=0, atol=1e-6)  # the mean gradient is 1


def test_close_lets_queued_piece_pulls_finish(cluster: Cluster) -> None:
    """More piece pulls than the client has threads for wait for a version; ``close`` (no cancel) lets every one of
    them finish once the version appears, those still queued behind the others included."""
    client = cluster.connect()
    pieces = shard_ranges(TOTAL, SHARDS)
    outs = [torch.empty(TOTAL) for _ in range(40)]
    handles = [client.pull_pieces(1, out, pieces) for out in outs]
    closer = threading.Thread(target=client.close)
    closer.start()
    deadline = time.monotonic() + 10
    while True:  # close has begun once the client refuses a new call; the pulls still wait for version 1
        assert time.monotonic() < deadline, "close never began"
        try:
            client.pull(0, torch.empty(TOTAL))
        except Cancelled:
            break
    pusher = cluster.connect()
    for worker in (0, 1):
        pusher.push(torch.ones(TOTAL), worker, 0, 1).wait()
    closer.join(30)
    assert not closer.is_alive()
    assert [h.wait() for h in handles] == [1] * len(handles)
    for out in outs:
        torch.testing.assert_close(out, cluster.initial - 0.5, rtol=0, atol=1e-6)  # the mean gradient is 1


# ---------------------------------------------------------------------- S4: pieces


def test_pieces_push_and_pull_like_whole_shards(cluster: Cluster) -> None:
    workers = [cluster.connect(), cluster.connect()]
    pieces = shard_ranges(TOTAL, SHARDS)  # one piece per shard here; test_overlap cuts shards finer
    out = torch.zeros(TOTAL)
    ref = torch.nn.Parameter(cluster.initial.clone())
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        g0, g1 = torch.randn(TOTAL, generator=gen), torch.randn(TOTAL, generator=gen)
        pulled = workers[0].pull_pieces(step + 1, out, pieces[::-1])  # started before the step can complete
        assert workers[0].push_pieces(g0, pieces, 0, step, 2).wait() == [
            ShardAck(i, step, duplicate=False, completed=False) for i in range(SHARDS)
        ]
        assert not pulled.done()
        assert [a.completed for a in workers[1].push_pieces(g1, pieces, 1, step, 2).wait()] == [True, True]
        assert pulled.wait() == step + 1
        ref.grad = (g0 + g1) / 4
        opt.step()
        torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-7)


def test_push_pull_pieces_pulls_the_version_the_pushes_complete(cluster: Cluster) -> None:
    workers = [cluster.connect(), cluster.connect()]
    pieces = shard_ranges(TOTAL, SHARDS)
    outs = [torch.zeros(TOTAL), torch.zeros(TOTAL)]
    ref = torch.nn.Parameter(cluster.initial.clone())
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        g0, g1 = torch.randn(TOTAL, generator=gen), torch.randn(TOTAL, generator=gen)
        first = workers[0].push_pull_pieces(g0, pieces[::-1], 0, step, 2, outs[0])
        assert not first[1].done()  # the step needs worker 1's pushes
        second = workers[1].push_pull_pieces(g1, pieces, 1, step, 2, outs[1])
        assert first[1].wait() == second[1].wait() == step + 1
        acks = [ack for pushed, _ in (first, second) for ack in pushed.wait()]
        assert sorted((a.shard_id, a.completed) for a in acks) == [(0, False), (0, True), (1, False), (1, True)]
        ref.grad = (g0 + g1) / 4
        opt.step()
        for out in outs:
            torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidRequest):  # a wrong pull buffer is refused before anything is pushed
        workers[0].push_pull_pieces(torch.ones(TOTAL), pieces, 0, 2, 2, torch.empty(TOTAL - 1))
    assert all(s.snapshot().pushes_waiting == 0 and s.version == 2 for s in cluster.shards)


def test_a_range_that_is_not_a_piece_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    client = cluster.connect(pull_timeout_s=2.0)
    whole = shard_ranges(TOTAL, SHARDS)[0]
    part = ShardRange(whole.shard_id, whole.start, whole.end - 1)
    with pytest.raises(InvalidRequest):
        client.push_pieces(torch.ones(TOTAL), [part], 0, 0, 1).wait()
    with pytest.raises(InvalidRequest):
        client.pull_pieces(0, torch.empty(TOTAL), [ShardRange(0, 1, whole.end)]).wait()
    with pytest.raises(InvalidRequest):  # outside its shard: the client refuses it at once
        client.push_pieces(torch.ones(TOTAL), [ShardRange(0, 0, TOTAL)], 0, 0, 1)
    out = torch.empty(TOTAL)
    assert client.pull(0, out) == 0 and torch.equal(out, cluster.initial)
    assert all(s.snapshot().pushes_waiting == 0 for s in cluster.shards)
