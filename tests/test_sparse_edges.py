"""Sparse tables at their edges: tables with fewer rows than PS shards, a table two layers share in the export,
and ids of the wrong dtype from ``sparse_ids``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pstrain.coordinator.initial_tables import CheckpointTable, initial_row_blocks, take_tables
from pstrain.coordinator.table_export import table_entries
from pstrain.nn import SparseEmbedding
from pstrain.ps_server.errors import StepConflict
from pstrain.ps_server.sparse_checkpoint import load_initial_rows
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_service import SparseTablesServicer, add_sparse_tables
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime import ps_api
from pstrain.runtime.factories import FactoryError
from pstrain.runtime.sparse_api import RowsAck
from pstrain.runtime.sparse_client import SparseClient
from pstrain.runtime.sparse_rows import TableSpec, init_rows
from pstrain.runtime.transport import start_server
from pstrain.worker.row_store import HostRowStore
from tests.helpers import wait_for

CPU = torch.device("cpu")


class Bag(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = SparseEmbedding("t", rows, dim)
        self.head = torch.linspace(-1, 1, dim)

    def sparse_ids(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": inputs}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return ((self.emb(inputs) * self.head).sum(-1) ** 2).mean()


def whole(shards: list[SparseShard], rows: int) -> torch.Tensor:
    return LocalSparseClient(shards).pull_rows(0, {"t": torch.arange(rows)})["t"]


def test_a_table_with_fewer_rows_than_shards_trains_exports_and_restarts_from_model_pt():
    """2 rows over 4 PS shards (shards 2 and 3 own none): training equals torch, the export holds the trained
    table, and a job started from that model.pt gives every shard its rows (shard 3 used to crash the stream)."""
    spec = TableSpec("t", 2, 3, init_scale=0.5, seed=1, lr=0.2, lr_schedule="constant")
    shards = [SparseShard(k, 4, [spec], workers=1, total_devices=1) for k in range(4)]
    store = HostRowStore(LocalSparseClient(shards), 0, [spec], [Bag(2, 3)], [CPU])
    batches = [torch.tensor([[0, 0, 1], [1, 1, 1]]), torch.tensor([[1, 1, 0]]), torch.tensor([[0, 0, 0]])]
    weight = nn.Parameter(init_rows(spec, torch.arange(2)))
    sgd = torch.optim.SGD([weight], lr=spec.lr)
    head = Bag(2, 3).head
    for step, ids in enumerate(batches):
        store.prepare(step, [ids])
        store.models[0](ids).backward()
        store.push(step)
        sgd.zero_grad()
        ((nn.functional.embedding_bag(ids, weight, mode="sum") * head).sum(-1) ** 2).mean().backward()
        sgd.step()
    trained = LocalSparseClient(shards).pull_rows(3, {"t": torch.arange(2)})["t"]
    assert torch.allclose(trained, weight.detach(), atol=1e-6)

    version, states = shards[0].states()
    ids = torch.cat([s.states()[1]["t"].ids for s in shards])
    rows = torch.cat([s.states()[1]["t"].rows for s in shards])
    model = nn.Sequential(SparseEmbedding("t", 2, 3))
    model.load_state_dict(table_entries(model, [spec], {"t": (ids, rows)}, None))
    assert torch.equal(model[0].weight, trained)

    tables = take_tables(model, "/nowhere/model.pt", [spec])
    fresh = [SparseShard(k, 4, [spec], workers=1, total_devices=1) for k in range(4)]
    for shard in fresh:
        load_initial_rows(shard, initial_row_blocks(tables, shard.shard_id, 4))
    assert torch.equal(whole(fresh, 2), trained)
    assert [s.rows_held()["t"] for s in fresh] == [1, 1, 0, 0]


@pytest.mark.parametrize("rows, shards, per_block", [(1, 3, 65536), (5, 4, 1), (13, 8, 2), (7, 3, 2)])
def test_a_whole_table_streams_to_every_shard_whatever_its_last_block_holds(rows, shards, per_block):
    """In a table's last block of ``per_block * shards`` rows, a shard past the table's end owns nothing."""
    spec = TableSpec("t", rows, 2, seed=4)
    table = init_rows(spec, torch.arange(rows)) + 1.0  # every row moved
    tables = {"t": CheckpointTable(spec, table)}
    got = [SparseShard(k, shards, [spec], workers=1, total_devices=1) for k in range(shards)]
    for shard in got:
        loaded = load_initial_rows(shard, initial_row_blocks(tables, shard.shard_id, shards, per_block))
        assert loaded == len(range(shard.shard_id, rows, shards))
    assert torch.equal(whole(got, rows), table)


def test_a_table_two_layers_share_counts_once_against_the_model_pt_limit(tmp_path):
    """model.pt holds up to the limit of tables in all: one table two layers read is one tensor, counted once."""
    spec = TableSpec("t", 100, 4, seed=2)
    model = nn.ModuleDict({"a": SparseEmbedding("t", 100, 4), "b": SparseEmbedding("t", 100, 4)})
    pulled = {"t": (torch.tensor([3]), torch.ones(1, 4))}
    entries = table_entries(model, [spec], pulled, tmp_path, limit_bytes=spec.rows * spec.row_bytes)
    assert sorted(entries) == ["a.weight", "b.weight"] and entries["a.weight"] is entries["b.weight"]
    assert torch.equal(entries["a.weight"][3], torch.ones(4)) and not (tmp_path / "tables").exists()
    assert table_entries(model, [spec], pulled, tmp_path, limit_bytes=spec.rows * spec.row_bytes - 1) == {}
    assert (tmp_path / "tables" / "t.pt").is_file()  # past the limit: the table directory


@pytest.mark.parametrize("ids", [torch.tensor([[1.0, 2.0]]), torch.tensor([[1.7]]), torch.tensor([[True]])])
def test_sparse_ids_of_a_non_integer_dtype_are_refused_before_any_row_is_pulled(ids):
    """nn.Embedding refuses float or bool indices; the row store did not: 1.7 pulled row 1, 1.0 trained row 1."""
    spec = TableSpec("t", 10, 3)
    shard = SparseShard(0, 1, [spec], workers=1, total_devices=1)
    store = HostRowStore(LocalSparseClient([shard]), 0, [spec], [Bag(10, 3)], [CPU])
    with pytest.raises(FactoryError, match="row ids must be an integer tensor"):
        store.prepare(0, [ids])
    assert shard.rows_held() == {"t": 0} and store.models[0].emb.rows is None
    store.prepare(0, [torch.tensor([[1, 2]], dtype=torch.int32)])  # any integer dtype, as torch takes int32
    assert store.rows_held == 2


def test_adagrad_rows_equal_torch_adagrad_with_its_defaults_even_for_tiny_gradients_and_rows_left_out():
    """``optimizer: adagrad`` is torch.optim.Adagrad(lr) row by row, eps included (the table's ``eps`` is Adam's: its
    1e-8 took a tenth off the first update of a row whose gradient is near 1e-7). Rows a step leaves out keep their
    value and accumulator, as torch's do with a zero gradient."""
    spec = TableSpec("t", 6, 3, seed=3, init_scale=0.1, optimizer="adagrad", lr=0.1, lr_schedule="constant")
    client = LocalSparseClient([SparseShard(0, 1, [spec], workers=1, total_devices=1)])
    weight = nn.Parameter(init_rows(spec, torch.arange(6)))
    adagrad = torch.optim.Adagrad([weight], lr=spec.lr)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        ids = torch.tensor([0, 1, 2]) if step % 3 else torch.tensor([1, 4])  # 3 and 5 never, 4 every third step
        grads = torch.randn(len(ids), 3, generator=gen) * 10.0 ** -float(step % 4 + 5)  # 1e-5 .. 1e-8
        client.push_rows(0, step, {"t": (ids, grads, torch.ones(len(ids), dtype=torch.int32))}, 1)
        weight.grad = torch.zeros(6, 3).index_add_(0, ids, grads)
        adagrad.step()
    got = client.pull_rows(8, {"t": torch.arange(6)})["t"]
    moved = (weight.detach() - init_rows(spec, torch.arange(6))).abs().amax(dim=1)
    assert float(moved[[0, 1, 2, 4]].min()) > 0.05  # every update is about lr, whatever the gradient's size
    assert torch.allclose(got, weight.detach(), rtol=0, atol=1e-6)


def one_row(ids: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return {"t": (torch.tensor(ids), torch.ones(len(ids), 3), torch.ones(len(ids), dtype=torch.int32))}


@pytest.fixture
def two_grpc_shards():
    """Two sparse shards of a 2-worker job, each its own gRPC server on 127.0.0.1, and a client per worker."""
    spec = TableSpec("t", 10, 3, seed=1, lr=0.5)
    servers, servicers = [], []
    for k in range(2):
        servicer = SparseTablesServicer()
        server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
        servicer.attach(SparseShard(k, 2, [spec], workers=2, total_devices=2))
        server.set_serving(True)
        servers.append(server)
        servicers.append(servicer)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    clients = [SparseClient(addresses, [spec], push_timeout_s=10, pull_timeout_s=10) for _ in range(2)]
    yield servicers, clients
    for client in clients:
        client.close()
    for server in servers:
        server.stop(0)


def test_a_push_one_step_ahead_of_a_shard_the_pull_skipped_waits_for_the_peers_rows_in_flight(two_grpc_shards):
    """Worker 1's rows of step 0 reached shard 0 but not yet shard 1. Worker 0's ids of step 1 all live on shard 0,
    so its pull of step 1 asks shard 0 only and goes through; its push of step 1 then reaches shard 1 still at step 0.
    That push used to be refused as ahead (FAILED_PRECONDITION, failing the worker); it waits for the step instead."""
    servicers, (w0, w1) = two_grpc_shards
    shards = [s.shard for s in servicers]
    w0.push_rows(0, 0, one_row([0, 1]), 1)
    w1._push_one(0, 1, 0, one_row([2]), 1)  # worker 1's push to shard 0; the one to shard 1 is still on its way
    assert [s.version for s in shards] == [1, 0]
    assert w0.pull_rows(1, {"t": torch.tensor([4])})["t"].shape == (1, 3)  # shard 0 only
    pushed: list[list[RowsAck]] = []
    pusher = threading.Thread(target=lambda: pushed.append(w0.push_rows(0, 1, one_row([4]), 1)))
    pusher.start()
    try:
        wait_for(lambda: servicers[1].gate.pulls.waiting == 1, 10, "worker 0 to wait for shard 1's step 1")
        assert not pushed and shards[1].version == 0
        w1._push_one(1, 1, 0, {}, 1)  # worker 1's push to shard 1 arrives
    finally:
        pusher.join(10)
    assert not pusher.is_alive() and [(a.shard_id, a.version, a.duplicate) for a in pushed[0]] == [
        (0, 1, False),
        (1, 1, False),
    ]
    assert shards[1].progress(0) == (1, 1)  # worker 0's rows of step 1 are held by shard 1
    with pytest.raises(ps_api.StepConflict, match="ahead"):  # two steps ahead is no race: refused at once
        w1.push_rows(1, 3, {}, 1)


class WatchedShard(SparseShard):
    """A sparse shard that says when a client starts waiting on it (``pull``), and can land a peer's push the moment
    it refuses one (``on_refusal``): the two orders of the race a push one step ahead runs into."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pulled = threading.Event()
        self.on_refusal: Callable[[], None] | None = None

    def pull(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        self.pulled.set()
        return super().pull(*args, **kwargs)  # type: ignore[arg-type]

    def push(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        try:
            return super().push(*args, **kwargs)  # type: ignore[arg-type]
        except StepConflict:
            land, self.on_refusal = self.on_refusal, None
            if land is not None:
                land()
            raise


def test_the_in_memory_client_waits_for_a_shard_one_step_behind_too():
    spec = TableSpec("t", 10, 3, seed=1, lr=0.5)
    shards = [WatchedShard(k, 2, [spec], workers=2, total_devices=2) for k in range(2)]
    w0 = LocalSparseClient(shards, pull_timeout_s=10)
    w0.push_rows(0, 0, one_row([0, 1]), 1)
    shards[0].push(1, 0, one_row([2]), 1)  # worker 1's rows of step 0 reached shard 0 only
    failed: list[BaseException] = []

    def push() -> None:
        try:
            w0.push_rows(0, 1, one_row([4]), 1)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failed.append(exc)

    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        wait_for(lambda: failed or shards[1].pulled.is_set(), 10, "worker 0 to wait for shard 1")
        shards[1].push(1, 0, {}, 1)
    finally:
        pusher.join(10)
    assert not pusher.is_alive() and not failed and shards[1].progress(0) == (1, 1)


def test_a_push_refused_just_before_the_peers_rows_landed_is_pushed_again():
    """The refusal and the check of the shard's version are two steps: the peer's rows may land between them, and
    then the shard is already at the pushed step (before, the refusal was raised: the worker failed)."""
    spec = TableSpec("t", 10, 3, seed=1, lr=0.5)
    shard = WatchedShard(0, 1, [spec], workers=2, total_devices=2)
    w0 = LocalSparseClient([shard], pull_timeout_s=10)
    w0.push_rows(0, 0, one_row([1]), 1)
    shard.on_refusal = lambda: SparseShard.push(shard, 1, 0, one_row([2]), 1)
    (ack,) = w0.push_rows(0, 1, one_row([1]), 1)
    assert shard.on_refusal is None  # it was refused once, and the peer's rows landed then
    assert (ack.version, ack.duplicate) == (1, False) and shard.progress(0) == (1, 1)
