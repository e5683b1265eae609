"""The PS side of sparse tables: rows, the sync protocol, bad input, the optimizers, and the gRPC path."""

from __future__ import annotations

import os
import threading

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.admission import ShardGate
from pstrain.ps_server.errors import InvalidArgument, StepConflict, UnknownWorker
from pstrain.ps_server.sparse_checkpoint import load_tables, save_tables
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_service import SparseTablesServicer, add_sparse_tables
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime import ps_api
from pstrain.runtime.identity import HEADER, MemberKeys
from pstrain.runtime.sparse_client import SparseClient, pull_tables
from pstrain.runtime.sparse_rows import TableSpec, encode_block, init_rows
from pstrain.runtime.transport import open_channel, start_server
from tests.helpers import wait_for

SPEC = TableSpec("t", 100, 3, init="normal", init_scale=0.1, seed=7, optimizer="sgd", lr=0.5)


def grads(ids, values=None, counts=None, dim=3):
    ids = torch.tensor(ids, dtype=torch.int64)
    n = len(ids)
    v = torch.ones(n, dim) if values is None else torch.tensor(values, dtype=torch.float32)
    c = torch.ones(n, dtype=torch.int32) if counts is None else torch.tensor(counts, dtype=torch.int32)
    return ids, v, c


def shards_of(spec=SPEC, n=3, workers=2, devices=4):
    return [SparseShard(k, n, [spec], workers, devices) for k in range(n)]


def test_initial_rows_depend_on_seed_table_and_id_only():
    a = init_rows(SPEC, torch.tensor([5, 9, 2]))
    b = init_rows(SPEC, torch.tensor([2, 9, 5]))
    assert torch.equal(a[[2, 1, 0]], b)
    assert not torch.equal(a, init_rows(TableSpec("u", 100, 3, seed=7, init_scale=0.1), torch.tensor([5, 9, 2])))
    assert 0.05 < float(init_rows(SPEC, torch.arange(100)).std()) < 0.15
    assert torch.equal(init_rows(TableSpec("z", 10, 2, init="zeros"), torch.arange(3)), torch.zeros(3, 2))


def test_rows_are_created_on_first_touch_identically_whatever_the_order_or_shard_count():
    one = LocalSparseClient(shards_of(n=1, workers=1))
    three = LocalSparseClient(shards_of(n=3, workers=1))
    ids = torch.tensor([42, 7, 99, 0])
    assert torch.equal(one.pull_rows(0, {"t": ids})["t"], init_rows(SPEC, ids))
    assert torch.equal(three.pull_rows(0, {"t": ids.flip(0)})["t"], init_rows(SPEC, ids.flip(0)))
    assert three.pull_requests == 2  # one per owning shard: 42, 99, 0 on shard 0, 7 on shard 1; none to shard 2


def test_count_rule_divides_each_row_by_its_occurrences_and_leaves_others_bit_identical():
    shards = shards_of(n=1, workers=2, devices=4)
    client = LocalSparseClient(shards)
    before = client.pull_rows(0, {"t": torch.arange(10)})["t"]
    client.push_rows(0, 0, {"t": grads([1, 2], [[2, 2, 2], [1, 1, 1]], [2, 1])}, device_count=2)
    client.push_rows(1, 0, {"t": grads([2, 3], [[3, 3, 3], [4, 4, 4]], [1, 1])}, device_count=2)
    after = client.pull_rows(1, {"t": torch.arange(10)})["t"]
    assert torch.allclose(after[1], before[1] - 0.5 * 2 / 2)  # one worker, two devices: /2
    assert torch.allclose(after[2], before[2] - 0.5 * (1 + 3) / 2)  # one device of each worker: /2
    assert torch.allclose(after[3], before[3] - 0.5 * 4 / 1)  # one device of one worker: /1, not /4
    untouched = [0, *range(4, 10)]
    assert torch.equal(after[untouched], before[untouched])


def test_devices_rule_divides_by_every_device_of_the_job():
    spec = TableSpec("t", 100, 3, seed=7, init_scale=0.1, lr=0.5, averaging="devices")
    client = LocalSparseClient(shards_of(spec, n=1, workers=1, devices=4))
    before = client.pull_rows(0, {"t": torch.tensor([3])})["t"]
    client.push_rows(0, 0, {"t": grads([3], [[4, 4, 4]], [1])}, device_count=4)
    assert torch.allclose(client.pull_rows(1, {"t": torch.tensor([3])})["t"], before - 0.5 * 4 / 4)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_adagrad_and_lazy_adam_follow_their_row_wise_rules(optimizer):
    spec = TableSpec("t", 10, 2, seed=1, init_scale=0.1, optimizer=optimizer, lr=0.1, eps=1e-8)
    client = LocalSparseClient(shards_of(spec, n=1, workers=1, devices=1))
    w = client.pull_rows(0, {"t": torch.tensor([4, 5])})["t"].clone()
    acc, m, v, t = torch.zeros(2), torch.zeros(2), torch.zeros(2), 0
    gs = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 3.0])]
    for step, g in enumerate(gs):
        ids = [4, 5] if step != 1 else [4]  # row 5 skips step 1: its Adam step count does not advance
        rows = {"t": (torch.tensor(ids), g.repeat(len(ids), 1), torch.ones(len(ids), dtype=torch.int32))}
        client.push_rows(0, step, rows, device_count=1)
        if optimizer == "adagrad":
            acc = acc + g * g
            w[0] -= 0.1 * g / (acc.sqrt() + 1e-8)
        else:
            t += 1
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            w[0] -= 0.1 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    got = client.pull_rows(3, {"t": torch.tensor([4, 5])})["t"]
    assert torch.allclose(got[0], w[0], atol=1e-6)
    if optimizer == "adam":  # row 5 saw 2 steps; its first update is lr * sign(g) exactly
        state = client._shards[0].tables["t"].state()
        assert state.state["step"][state.ids.tolist().index(5)] == 2
        assert state.state["step"][state.ids.tolist().index(4)] == 3


BAD_PUSHES = [
    (lambda: {"t": grads([-1])}, "must be in"),
    (lambda: {"t": grads([100])}, "must be in"),
    (lambda: {"t": grads([1])}, "belongs to shard 1"),
    (
        lambda: {"t": (torch.tensor([0], dtype=torch.int32), torch.ones(1, 3), torch.ones(1, dtype=torch.int32))},
        "int64",
    ),
    (
        lambda: {"t": (torch.tensor([0]), torch.ones(1, 3, dtype=torch.float64), torch.ones(1, dtype=torch.int32))},
        "float32",
    ),
    (lambda: {"t": (torch.tensor([0]), torch.ones(1, 2), torch.ones(1, dtype=torch.int32))}, "shape"),
    (lambda: {"t": grads([0], counts=[3])}, "1..2 devices"),
    (lambda: {"t": grads([0], counts=[0])}, "1..2 devices"),
    (lambda: {"t": grads([0, 0], counts=[1, 1])}, "once"),
    (lambda: {"t": grads([0], [[float("nan"), 0, 0]])}, "NaN"),
    (lambda: {"nope": grads([0])}, "no sparse table"),
]


@pytest.mark.parametrize("rows, match", BAD_PUSHES)
def test_bad_pushes_are_refused_and_change_nothing(rows, match):
    shard = SparseShard(0, 3, [SPEC], workers=2, total_devices=4)
    shard.pull(0, {"t": torch.tensor([0, 3])}, 1.0)
    before = shard.states()
    with pytest.raises(InvalidArgument, match=match):
        shard.push(0, 0, rows(), device_count=2)
    after = shard.states()
    assert after[0] == before[0] == 0
    assert torch.equal(after[1]["t"].ids, before[1]["t"].ids) and torch.equal(after[1]["t"].rows, before[1]["t"].rows)
    shard.push(0, 0, {"t": grads([3])}, device_count=2)  # the worker may still push its step


def test_bad_pulls_are_refused_and_create_no_rows():
    shard = SparseShard(0, 3, [SPEC], workers=1, total_devices=1)
    for ids, match in [([0, 1], "belongs to shard 1"), ([0, -3], "must be in"), ([99, 300], "must be in")]:
        with pytest.raises(InvalidArgument, match=match):
            shard.pull(0, {"t": torch.tensor(ids)}, 1.0)
    with pytest.raises(InvalidArgument, match="1-D int64"):
        shard.pull(0, {"t": torch.tensor([0.0])}, 1.0)
    with pytest.raises(InvalidArgument, match="row ids must be unique, 2 repeat"):  # a reply as large as the ask
        shard.pull(0, {"t": torch.tensor([0, 3, 0, 0])}, 1.0)
    assert shard.rows_held() == {"t": 0}


def test_loading_or_restoring_a_row_twice_is_refused_and_changes_nothing():
    """init_checkpoint rows (or a checkpoint) that name a row twice would leave two slots for one id and overwrite a
    row still in use at the next insert: refused by name, the table as it was."""
    shard = SparseShard(0, 1, [SPEC], workers=1, total_devices=1)
    table = shard.tables["t"]
    with pytest.raises(InvalidArgument, match="row ids must be unique, 1 repeat"):
        table.load(torch.tensor([5, 5, 7]), torch.ones(3, 3))
    assert len(table) == 0
    table.load(torch.tensor([5, 7]), torch.ones(2, 3))
    state = table.state()
    doubled = type(state)(
        state.spec,
        torch.tensor([5, 5]),
        torch.ones(2, 3),
        {k: v[:1].repeat(2, *[1] * (v.dim() - 1)) for k, v in state.state.items()},
    )
    with pytest.raises(InvalidArgument, match="unique"):
        type(table).restore(doubled, 0, 1)


def test_a_restored_shard_refuses_a_pull_of_the_version_before_it():
    """A live shard answers a pull one version back from its pre-update copy; a shard restored from a checkpoint at
    version v has no such copy, so a pull of v - 1 is a StepConflict, not the rows of v passed off as v - 1's."""
    live = SparseShard(0, 1, [SPEC], workers=1, total_devices=1)
    ids = torch.tensor([3])
    before = live.pull(0, {"t": ids}, 1.0)[1]["t"]
    live.push(0, 0, {"t": grads([3])}, 1)
    assert torch.equal(live.pull(0, {"t": ids}, 1.0)[1]["t"], before)  # from the pre-update copy
    version, states = live.states()
    restored = SparseShard.restore(0, 1, version, states, 1, 1)
    with pytest.raises(StepConflict, match="restored at that one"):
        restored.pull(0, {"t": ids}, 1.0)
    assert torch.equal(restored.pull(1, {"t": ids}, 1.0)[1]["t"], live.pull(1, {"t": ids}, 1.0)[1]["t"])


def test_sync_protocol_duplicates_stale_ahead_unknown_and_skip():
    shard = SparseShard(0, 1, [SPEC], workers=2, total_devices=2)
    assert not shard.push(0, 0, {"t": grads([1])}, 1).completed
    assert shard.push(0, 0, {"t": grads([1])}, 1).duplicate  # a retry is acknowledged, not counted
    with pytest.raises(StepConflict, match="ahead"):
        shard.push(1, 1, {}, 1)
    with pytest.raises(UnknownWorker):
        shard.push(2, 0, {}, 1)
    done = shard.push(1, 0, {}, 1)  # an empty push: worker 1 touched none of this shard's rows
    assert done.completed and done.version == 1
    assert shard.push(1, 0, {"t": grads([2])}, 1).duplicate  # a late retry of its last step
    rows = shard.pull(1, {"t": torch.tensor([1, 2])}, 1.0)[1]["t"].clone()
    shard.push(0, 1, {"t": grads([1])}, 1)
    skipped = shard.push(1, 1, None, 1)  # a worker saw a non-finite step
    assert skipped.completed and skipped.skipped and skipped.version == 2
    assert torch.equal(shard.pull(2, {"t": torch.tensor([1, 2])}, 1.0)[1]["t"], rows)
    with pytest.raises(StepConflict, match="stale"):
        shard.push(1, 0, {"t": grads([2])}, 1)


def test_a_pull_waits_for_the_step_to_complete():
    shard = SparseShard(0, 1, [SPEC], workers=2, total_devices=2)
    shard.push(0, 0, {"t": grads([1])}, 1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(shard.pull(1, {"t": torch.tensor([1])}, 10.0)[0]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # version 1 needs worker 1's push
    shard.push(1, 0, {}, 1)
    waiter.join(10)
    assert got == [1]


def test_table_snapshot_round_trip(tmp_path):
    spec = TableSpec("t", 100, 3, seed=7, optimizer="adam", lr=0.1)
    shard = SparseShard(0, 1, [spec], workers=1, total_devices=1)
    shard.push(0, 0, {"t": grads([5, 9])}, 1)
    version, states = shard.states()
    for step in range(1, 5):
        save_tables(tmp_path, 0, step, states, keep=2)
    assert sorted(p.name for p in (tmp_path / "sparse-0").iterdir()) == [f"step-{s:09d}.pt" for s in (2, 3, 4)]
    restored = SparseShard.restore(0, 1, version, load_tables(tmp_path, 0, 4), 1, 1)
    got = restored.states()[1]["t"]
    assert torch.equal(got.ids, states["t"].ids) and torch.equal(got.rows, states["t"].rows)
    assert torch.equal(got.state["step"], states["t"].state["step"])
    shard.push(0, 1, {"t": grads([5])}, 1)
    restored.push(0, 1, {"t": grads([5])}, 1)
    assert torch.equal(shard.states()[1]["t"].rows, restored.states()[1]["t"].rows)


# ---------------------------------------------------------------------- gRPC


@pytest.fixture
def grpc_cluster():
    """Three sparse shards, each its own asyncio gRPC server on 127.0.0.1, for 2 workers of 2 devices."""
    servers, shards = [], []
    for k in range(3):
        servicer = SparseTablesServicer()
        server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
        shard = SparseShard(k, 3, [SPEC], workers=2, total_devices=4)
        servicer.attach(shard)
        server.set_serving(True)
        servers.append(server)
        shards.append(shard)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    client = SparseClient(addresses, [SPEC], push_timeout_s=10, pull_timeout_s=10)
    yield addresses, shards, client
    client.close()
    for s in servers:
        s.stop(0)


def test_grpc_path_equals_the_in_memory_one(grpc_cluster):
    addresses, shards, client = grpc_cluster
    local = LocalSparseClient(shards_of(n=3, workers=2, devices=4))
    ids = torch.tensor([0, 1, 2, 5, 50, 99])
    assert torch.equal(client.pull_rows(0, {"t": ids})["t"], local.pull_rows(0, {"t": ids})["t"])
    pushes = [grads([1, 5, 50], [[1, 2, 3]] * 3, [2, 1, 1]), grads([0, 5], [[-1, 0, 1]] * 2, [1, 2])]
    for worker, rows in enumerate(pushes):
        acks = client.push_rows(worker, 0, {"t": rows}, 2)
        local.push_rows(worker, 0, {"t": rows}, 2)
        assert len(acks) == 3  # every shard, including those owning none of the rows
    assert all(a.completed for a in acks)
    assert torch.equal(client.pull_rows(1, {"t": ids})["t"], local.pull_rows(1, {"t": ids})["t"])
    assert client.bytes_sent > 0
    exported = pull_tables(addresses, [SPEC], 1)["t"]
    assert sorted(exported[0].tolist()) == sorted(ids.tolist())


def raw_push(address, request):
    channel = open_channel(address)
    try:
        return pb_grpc.SparseTablesStub(channel).PushRows(request, timeout=10)
    finally:
        channel.close()


@pytest.mark.parametrize(
    "block, code",
    [
        (encode_block("t", torch.tensor([1]), torch.ones(1, 3), torch.ones(1, dtype=torch.int32)), "INVALID_ARGUMENT"),
        (encode_block("t", torch.tensor([-3]), torch.ones(1, 3), torch.ones(1, dtype=torch.int32)), "INVALID_ARGUMENT"),
        (encode_block("t", torch.tensor([3]), torch.ones(1, 2), torch.ones(1, dtype=torch.int32)), "INVALID_ARGUMENT"),
        (pb.RowBlock(table="t", ids=b"\x00" * 7), "INVALID_ARGUMENT"),
        (encode_block("t", torch.tensor([3]), torch.ones(1, 3)), "INVALID_ARGUMENT"),
        (encode_block("x", torch.tensor([3]), torch.ones(1, 3), torch.ones(1, dtype=torch.int32)), "INVALID_ARGUMENT"),
    ],
)
def test_bad_grpc_pushes_are_invalid_argument_and_change_nothing(grpc_cluster, block, code):
    addresses, shards, client = grpc_cluster
    before = shards[0].states()
    with pytest.raises(grpc.RpcError) as err:
        raw_push(addresses[0], pb.PushRowsRequest(shard_id=0, worker_id=0, step=0, device_count=2, blocks=[block]))
    assert err.value.code().name == code
    after = shards[0].states()
    assert after[0] == before[0] and torch.equal(after[1]["t"].rows, before[1]["t"].rows)


def test_bad_grpc_reads_are_invalid_argument(grpc_cluster):
    """A pull whose reply could not fit a message, and a table read in blocks of a negative size, are refused by
    name before any row is made or read."""
    addresses, shards, _ = grpc_cluster
    channel = open_channel(addresses[0])
    stub = pb_grpc.SparseTablesStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.ReadTable(pb.ReadTableRequest(shard_id=0, table="t", rows_per_block=-1), timeout=10).next()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows_per_block" in err.value.details()
        twice = pb.PullRowsRequest(shard_id=0, min_version=5, blocks=[encode_block("t", torch.tensor([0, 3, 3]))])
        with pytest.raises(grpc.RpcError) as err:  # at once: not after waiting for a version 5 that never comes
            stub.PullRows(twice, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unique" in err.value.details()
    finally:
        channel.close()
    wide = TableSpec("w", 2**40, 4096, seed=1)
    servicer = SparseTablesServicer()
    server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
    try:
        servicer.attach(SparseShard(0, 1, [wide], workers=1, total_devices=1))
        server.set_serving(True)
        channel = open_channel(f"127.0.0.1:{server.port}")
        ids = torch.arange(20_000, dtype=torch.int64)  # 20,000 rows of 16 KiB: 312 MiB of reply
        request = pb.PullRowsRequest(shard_id=0, min_version=0, blocks=[encode_block("w", ids)])
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.SparseTablesStub(channel).PullRows(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pull fewer rows" in err.value.details()
        assert servicer.shard.rows_held() == {"w": 0}
        channel.close()
    finally:
        server.stop(0)


def test_more_waiting_row_pulls_than_threads_do_not_hold_up_the_push_that_completes_the_step():
    """Every worker but the last has pushed its rows and waits in a pull for the step's update: more pulls than the
    server's event loop has threads. The last push still goes through at once, and every pull gets the version."""
    workers = min(32, (os.cpu_count() or 1) + 4) + 2  # the loop's default thread pool, and then some
    servicer = SparseTablesServicer()
    server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
    channel = None
    try:
        servicer.attach(SparseShard(0, 1, [SPEC], workers=workers, total_devices=workers))
        server.set_serving(True)
        channel = open_channel(f"127.0.0.1:{server.port}")
        stub = pb_grpc.SparseTablesStub(channel)
        ids = torch.tensor([1])

        def push(worker: int) -> pb.PushRowsReply:
            block = encode_block("t", ids, torch.ones(1, 3), torch.ones(1, dtype=torch.int32))
            request = pb.PushRowsRequest(shard_id=0, worker_id=worker, step=0, device_count=1, blocks=[block])
            return stub.PushRows(request, timeout=5)

        for worker in range(workers - 1):
            push(worker)
        pull = pb.PullRowsRequest(shard_id=0, min_version=1, blocks=[encode_block("t", ids)])
        pulls = [stub.PullRows.future(pull, timeout=30) for _ in range(workers - 1)]
        wait_for(lambda: servicer.gate.pulls.waiting == workers - 1, 10, "every pull to wait for version 1")
        assert push(workers - 1).completed  # within its 5 s: no thread was needed that a waiting pull held
        assert [p.result().version for p in pulls] == [1] * (workers - 1)
    finally:
        if channel is not None:
            channel.close()
        server.stop(0)


def test_grpc_errors_map_to_the_client_hierarchy(grpc_cluster):
    _, _, client = grpc_cluster
    with pytest.raises(ps_api.InvalidRequest, match="must be in"):
        client.pull_rows(0, {"t": torch.tensor([100])})
    client.push_rows(0, 0, {}, 2)
    with pytest.raises(ps_api.StepConflict):
        client.push_rows(0, 5, {}, 2)
    with pytest.raises(ps_api.UnknownWorker):
        client.push_rows(7, 0, {}, 2)


def test_a_row_push_needs_the_pushing_workers_credential(grpc_cluster):
    """Issue 8 for tables: a forged row push (NaN rows under worker 0's id) is PERMISSION_DENIED, nothing changes."""
    addresses, shards, _ = grpc_cluster
    keys = MemberKeys.generate()
    servicer = SparseTablesServicer()
    servicer.gate = ShardGate(keys, max_devices=2)
    server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
    try:
        servicer.attach(shards[0])
        server.set_serving(True)
        address = f"127.0.0.1:{server.port}"
        before = shards[0].states()
        nan = encode_block("t", torch.tensor([3]), torch.full((1, 3), float("nan")), torch.ones(1, dtype=torch.int32))
        request = pb.PushRowsRequest(shard_id=0, worker_id=0, step=0, device_count=2, blocks=[nan])
        channel = open_channel(address)
        stub = pb_grpc.SparseTablesStub(channel)
        try:
            for metadata in ([], [(HEADER, keys.mint("worker", 1).encode())]):  # none; worker 1's for worker 0
                with pytest.raises(grpc.RpcError) as err:
                    stub.PushRows(request, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as err:  # the right worker, more devices than the job registered
                stub.PushRows(
                    pb.PushRowsRequest(shard_id=0, worker_id=0, step=0, device_count=3),
                    metadata=[(HEADER, keys.mint("worker", 0).encode())],
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:  # a pull without any member's credential
                stub.PullRows(pb.PullRowsRequest(shard_id=0, min_version=0), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            channel.close()
        after = shards[0].states()
        assert after[0] == before[0] and torch.equal(after[1]["t"].rows, before[1]["t"].rows)
    finally:
        server.stop(0)
