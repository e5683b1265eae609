"""The replacement window of issue 9: a worker killed after its dense push but before its row push leaves the
tables one step behind the dense range; its replacement reports that as inconsistent (the coordinator then rolls
the job back to its checkpoint) instead of pulling rows of a version that never comes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime import ps_api
from pstrain.runtime.sparse_rows import TableSpec
from pstrain.worker.main import rejoin
from pstrain.worker.row_store import rows_behind
from tests.test_sparse_table import grpc_cluster  # noqa: F401 - the gRPC fixture

SPEC = TableSpec("t", 100, 3, seed=7)


def rows(*ids: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    t = torch.tensor(ids, dtype=torch.int64)
    return {"t": (t, torch.ones(len(ids), 3), torch.ones(len(ids), dtype=torch.int32))}


def client_at_step_one(workers_pushing_step_one: list[int]) -> LocalSparseClient:
    """Two workers of 2 devices, 2 shards: step 0 complete; step 1 pushed by the given workers only."""
    client = LocalSparseClient([SparseShard(k, 2, [SPEC], workers=2, total_devices=4) for k in range(2)])
    for worker in (0, 1):
        client.push_rows(worker, 0, rows(1, 2, 3), 2)
    for worker in workers_pushing_step_one:
        client.push_rows(worker, 1, rows(4, 5), 2)
    return client


def test_tables_at_the_dense_version_are_consistent():
    assert rows_behind(client_at_step_one([0, 1]), 1, 2) == ""
    assert rows_behind(client_at_step_one([]), 1, 1) == ""


def test_a_worker_that_died_between_its_dense_and_its_row_push_is_reported():
    client = client_at_step_one([0])  # dense is at 2: both pushed their buckets of step 1; worker 1 no rows
    message = rows_behind(client, 1, 2)
    assert "sparse shard 0 is at version 1 (worker 1 last pushed rows for step 0)" in message
    assert "sparse shard 1" in message and message.endswith("between its dense and its row push")


def test_tables_behind_only_for_a_live_peer_still_pushing_are_consistent():
    # Worker 0 died after both pushes of step 1; worker 1 is alive and has not pushed its rows yet.
    assert rows_behind(client_at_step_one([0]), 0, 2) == ""


def test_a_worker_that_pushed_its_rows_to_some_shards_only_is_reported():
    client = client_at_step_one([0])
    client._shards[0].push(1, 1, rows(4), 2)  # its push reached shard 0 (id 4) only
    message = rows_behind(client, 1, 2)
    assert "sparse shard 0" not in message and "sparse shard 1 is at version 1" in message


@dataclass
class FakeCoordinator:
    requests: list[pb.RejoinRequest] = field(default_factory=list)

    def RejoinAt(self, request: pb.RejoinRequest, timeout: float) -> pb.Directive:  # noqa: N802 - the RPC's name
        self.requests.append(request)
        return pb.Directive(stop=bool(request.inconsistent), reason=request.inconsistent)


@dataclass
class FakeMember:
    coordinator: FakeCoordinator = field(default_factory=FakeCoordinator)


class DensePs:
    """The dense shards at one version (a pull of version 0 returns it, as the real shards do)."""

    def __init__(self, version: int) -> None:
        self.version = version

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        return self.version


@pytest.mark.parametrize("pushed, consistent", [([0, 1], True), ([0], False)])
def test_the_replacement_reports_the_tables_to_the_coordinator(pushed, consistent):
    client = client_at_step_one(pushed)
    member = FakeMember()
    joined = rejoin(member, 1, DensePs(2), 8, lambda version: rows_behind(client, 1, version))  # type: ignore[arg-type]
    (request,) = member.coordinator.requests
    assert request.step == 2 and joined == (2 if consistent else None)
    assert (request.inconsistent == "") is consistent


def test_the_grpc_shards_answer_the_same_progress(grpc_cluster):  # noqa: F811 - the fixture
    _, shards, client = grpc_cluster
    local = LocalSparseClient(shards)
    assert client.progress(1) == local.progress(1) == [(0, -1)] * 3
    client.push_rows(1, 0, rows(1, 2), 2)
    assert client.progress(1) == [(0, 0)] * 3 and client.progress(0) == [(0, -1)] * 3
    assert rows_behind(client, 1, 1) == "" and "worker 0 last pushed rows for step -1" in rows_behind(client, 0, 1)
    with pytest.raises(ps_api.UnknownWorker):
        client.progress(9)
