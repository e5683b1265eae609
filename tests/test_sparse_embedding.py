"""The worker side of sparse tables: the layer, the host row store, and equivalence with plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pstrain.nn import SparseEmbedding
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime.factories import FactoryError
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.sparse_rows import TableSpec, init_rows
from pstrain.worker.row_store import HostRowStore

CPU = torch.device("cpu")


class Model(nn.Module):
    """A pooled bag per sample, through a fixed linear layer (the dense part is not what these tests check)."""

    def __init__(self, rows: int, dim: int, mode: str | None = "sum") -> None:
        super().__init__()
        self.emb = SparseEmbedding("t", rows, dim, mode=mode)
        self.out = nn.Linear(dim, 1)
        with torch.no_grad():
            self.out.weight.copy_(torch.linspace(-1, 1, dim))
            self.out.bias.zero_()

    def sparse_ids(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": inputs}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(inputs)).squeeze(-1)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def run_pstrain(spec, batches, workers=2, devices=2, shards=3, steps=None):
    """Train the table with ``workers`` host row stores of ``devices`` each over ``shards`` sparse shards."""
    ps = [SparseShard(k, shards, [spec], workers, workers * devices) for k in range(shards)]
    client = LocalSparseClient(ps)
    stores = []
    for w in range(workers):
        models = [Model(spec.rows, spec.dim) for _ in range(devices)]
        stores.append(HostRowStore(client, w, [spec], models, [CPU] * devices))
    for step, batch in enumerate(batches):  # batch: [worker][device] -> ids (samples, bag)
        for store, per_device in zip(stores, batch, strict=True):
            store.prepare(step, per_device)
            for model, ids in zip(store.models, per_device, strict=True):
                loss_of(model(ids)).backward()
        for store in stores:
            store.push(step)
    return client, stores, ps


def reference_count_rule(spec, batches):
    """Single process: every device's gradient per row, summed, divided by the devices in which the row occurred."""
    table = init_rows(spec, torch.arange(spec.rows))
    probe = Model(spec.rows, spec.dim)
    for batch in batches:
        device_batches = [ids for per_device in batch for ids in per_device]
        total = torch.zeros_like(table)
        count = torch.zeros(spec.rows)
        for ids in device_batches:
            weight = table.clone().requires_grad_(True)
            out = probe.out(nn.functional.embedding_bag(ids, weight, mode="sum")).squeeze(-1)
            loss_of(out).backward()
            total += weight.grad
            count[torch.unique(ids)] += 1
        touched = count > 0
        table[touched] -= spec.lr * total[touched] / count[touched, None]
    return table


def random_batches(rows, steps, gen, workers=2, devices=2, samples=5, bag=3):
    return [
        [[torch.randint(0, rows, (samples, bag), generator=gen) for _ in range(devices)] for _ in range(workers)]
        for _ in range(steps)
    ]


def all_rows(client, spec, version):
    return client.pull_rows(version, {"t": torch.arange(spec.rows)})["t"]


def test_two_workers_two_devices_three_shards_equal_the_count_rule_reference():
    spec = TableSpec("t", 40, 4, init_scale=0.5, seed=3, lr=0.3)
    batches = random_batches(spec.rows, 4, torch.Generator().manual_seed(0))
    client, _, _ = run_pstrain(spec, batches)
    assert torch.allclose(all_rows(client, spec, 4), reference_count_rule(spec, batches), atol=1e-5)


def test_where_every_id_occurs_on_every_device_it_equals_embedding_bag_and_sgd_on_the_global_batch():
    spec = TableSpec("t", 30, 4, init_scale=0.5, seed=5, lr=0.2)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randperm(spec.rows, generator=gen)[:6].view(2, 3)
        per = [[ids[torch.randperm(2, generator=gen)].flip(1) for _ in range(2)] for _ in range(2)]
        batches.append(per)
    client, _, _ = run_pstrain(spec, batches)

    bag = nn.EmbeddingBag(spec.rows, spec.dim, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(init_rows(spec, torch.arange(spec.rows)))
    head = Model(spec.rows, spec.dim).out
    sgd = torch.optim.SGD(bag.parameters(), lr=spec.lr)
    for batch in batches:
        device_batches = [ids for per_device in batch for ids in per_device]
        sgd.zero_grad()
        loss = sum(loss_of(head(bag(ids)).squeeze(-1)) for ids in device_batches) / len(device_batches)
        loss.backward()
        sgd.step()
    assert torch.allclose(all_rows(client, spec, 3), bag.weight.detach(), atol=1e-5)


def test_untouched_rows_stay_bit_identical_and_a_row_on_one_device_is_divided_by_one():
    spec = TableSpec("t", 20, 3, init_scale=0.5, seed=9, lr=0.5)
    only = torch.tensor([[7, 7, 7]])  # row 7 only on worker 1, device 0
    others = [torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])]
    batches = [[[others[0], others[1]], [only, others[0]]]]
    client, stores, _ = run_pstrain(spec, batches)
    after = all_rows(client, spec, 1)
    initial = init_rows(spec, torch.arange(spec.rows))
    untouched = [i for i in range(spec.rows) if i not in (1, 2, 3, 4, 7)]
    assert torch.equal(after[untouched], initial[untouched])
    weight = initial.clone().requires_grad_(True)
    loss_of(
        Model(spec.rows, spec.dim).out(nn.functional.embedding_bag(only, weight, mode="sum")).squeeze(-1)
    ).backward()
    assert torch.allclose(after[7], initial[7] - spec.lr * weight.grad[7], atol=1e-6)  # / 1, not / 4


def test_rows_are_not_in_the_dense_layout_and_a_table_larger_than_it_trains_with_bounded_memory():
    spec = TableSpec("t", 1_000_000, 8, init_scale=0.1, seed=2, lr=0.1)
    model = Model(spec.rows, spec.dim)
    layout = ParamLayout.of(model)
    assert layout.names == ("out.weight", "out.bias") and layout.total == 9 < spec.rows
    gen = torch.Generator().manual_seed(4)
    batches = random_batches(spec.rows, 5, gen, samples=16, bag=4)
    client, stores, ps = run_pstrain(spec, batches)
    per_step = 2 * 16 * 4  # ids one worker's two devices look up
    for store in stores:
        assert 0 < store.peak_rows_held <= per_step and store.rows_held == 0  # released after the push
        for m in store.models:  # the layer allocates no table on any device
            assert m.emb.weight.numel() == 0 and m.emb.rows is None
    held = sum(s.rows_held()["t"] for s in ps)
    touched = {int(i) for step in batches for w in step for d in w for i in d.flatten()}
    assert held == len(touched)  # the PS holds only the rows training touched, not the table


def test_pooling_modes_and_plain_lookup_match_torch():
    spec = TableSpec("t", 10, 3, init_scale=0.5, seed=1)
    weight = init_rows(spec, torch.arange(10))
    for mode in ("sum", "mean", None):
        layer = SparseEmbedding("t", 10, 3, mode=mode)
        layer.load_state_dict({"weight": weight})
        ids = torch.tensor([[1, 2], [3, 3]])
        want = (
            nn.functional.embedding(ids, weight)
            if mode is None
            else nn.functional.embedding_bag(ids, weight, mode=mode)
        )
        assert torch.equal(layer(ids), want)
    flat, offsets = torch.tensor([1, 2, 3, 3, 9]), torch.tensor([0, 2])
    layer = SparseEmbedding("t", 10, 3, mode="mean")
    layer.load_state_dict({"weight": weight})
    assert torch.equal(layer(flat, offsets), nn.functional.embedding_bag(flat, weight, offsets, mode="mean"))
    assert torch.equal(layer.state_dict()["weight"], weight)


def test_a_model_that_does_not_fit_the_job_tables_is_refused():
    client = LocalSparseClient([SparseShard(0, 1, [TableSpec("t", 10, 3)], 1, 1)])
    with pytest.raises(FactoryError, match="declares 10 x 3"):
        HostRowStore(client, 0, [TableSpec("t", 10, 3)], [Model(11, 3)], [CPU])
    with pytest.raises(FactoryError, match="does not declare"):
        HostRowStore(client, 0, [TableSpec("u", 10, 3)], [Model(10, 3)], [CPU])
    store = HostRowStore(client, 0, [TableSpec("t", 10, 3)], [Model(10, 3)], [CPU])
    with pytest.raises(FactoryError, match="must be in"):
        store.prepare(0, [torch.tensor([[10]])])
    store.prepare(0, [torch.tensor([[1, 2]])])
    with pytest.raises(RuntimeError, match="did not return"):
        store.models[0](torch.tensor([[3]]))  # an id sparse_ids() did not declare for this batch
