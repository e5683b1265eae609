"""The worker's training loop with a sparse table, without a network (issue 9).

Two ``Trainer``s of 2 CPU devices each over in-memory dense shards and sparse shards (a
``HostRowStore`` on a ``LocalSparseClient``) equal a single process that applies the dense rule
(gradient averaged over all devices) to the dense part and the count rule to the table.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils.data import Dataset

from pstrain.nn import SparseEmbedding
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.shard_map import shard_ranges
from pstrain.runtime.sparse_rows import TableSpec, init_rows
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.row_store import HostRowStore
from pstrain.worker.trainer import Trainer
from tests.test_trainer import NO_WAIT, ListSource, Reporter, start

STEPS, WORKERS, DEVICES, PER_DEVICE, BAG = 4, 2, 2, 3, 4
ROWS, DIM, LR, TABLE_LR = 40, 4, 0.1, 0.5
SPEC = TableSpec("t", ROWS, DIM, init="normal", init_scale=0.1, seed=3, optimizer="sgd", lr=TABLE_LR)
SAMPLES_PER_WORKER = STEPS * DEVICES * PER_DEVICE


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = SparseEmbedding("t", ROWS, DIM)
        self.out = nn.Linear(DIM, 2)

    def sparse_ids(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": inputs}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(inputs))


def seeded_model() -> nn.Module:
    torch.manual_seed(0)
    return BagModel()


class Ids(Dataset):
    """Bags of ids skewed to the low rows (so ids repeat across devices and workers) and a label."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = (torch.rand(n, BAG, generator=gen) ** 2 * ROWS).long()
        self.y = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self.x[i], self.y[i]


DATA = Ids(WORKERS * SAMPLES_PER_WORKER)
LAYOUT = ParamLayout.of(seeded_model())


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """One process: per step, every device's slice; dense grads / all devices, table grads / occurrences."""
    model = seeded_model()
    table = init_rows(SPEC, torch.arange(ROWS))
    per_step = DEVICES * PER_DEVICE
    for step in range(STEPS):
        dense = [torch.zeros_like(p) for p in model.parameters()]
        total, count = torch.zeros_like(table), torch.zeros(ROWS)
        for w in range(WORKERS):
            start_at = w * SAMPLES_PER_WORKER + step * per_step
            x, y = DATA.x[start_at : start_at + per_step], DATA.y[start_at : start_at + per_step]
            for xd, yd in zip(x.chunk(DEVICES), y.chunk(DEVICES), strict=True):
                weight = table.clone().requires_grad_(True)
                model.zero_grad()
                out = model.out(nn.functional.embedding_bag(xd, weight, mode="sum"))
                nn.functional.cross_entropy(out, yd).backward()
                for acc, p in zip(dense, model.parameters(), strict=True):
                    acc += p.grad
                total += weight.grad
                count[torch.unique(xd)] += 1
        with torch.no_grad():
            for acc, p in zip(dense, model.parameters(), strict=True):
                p -= LR * acc / (WORKERS * DEVICES)
        touched = count > 0
        table[touched] -= TABLE_LR * total[touched] / count[touched, None]
    return LAYOUT.flatten(model), table


def test_two_workers_of_two_devices_with_a_table_train_like_one_process() -> None:
    initial = LAYOUT.flatten(seeded_model())
    schedule = pb.LrSchedule(scaled_lr=LR)
    dense = [
        ParameterShard(
            r.shard_id,
            r.start,
            r.end,
            initial[r.start : r.end].clone(),
            pb.OptimizerSpec(name="sgd"),
            schedule,
            WORKERS,
        )
        for r in shard_ranges(LAYOUT.total, 3)
    ]
    sparse = [SparseShard(k, 2, [SPEC], WORKERS, WORKERS * DEVICES, schedule=schedule) for k in range(2)]
    job = pb.JobSpec(steps=STEPS, per_device_batch=PER_DEVICE, total_params=LAYOUT.total, bucket_bytes=0)
    trainers = []
    for w in range(WORKERS):
        replicas = ReplicaSet(seeded_model, [torch.device("cpu")] * DEVICES, LAYOUT)
        indices = list(range(w * SAMPLES_PER_WORKER, (w + 1) * SAMPLES_PER_WORKER))
        feed = DataFeed(DATA, ListSource(w, indices))
        trainer = Trainer(
            w,
            job,
            replicas,
            LocalPsClient(dense, 60),
            feed,
            nn.functional.cross_entropy,
            Reporter(),
            threading.Event(),
            NO_WAIT,
        )
        models = [r.model for r in replicas.replicas]
        trainer.sparse = HostRowStore(LocalSparseClient(sparse, 60), w, [SPEC], models, [torch.device("cpu")] * DEVICES)
        trainers.append(trainer)
    runs = [start(t) for t in trainers]
    for thread, _ in runs:
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert [outcome for _, outcome in runs] == [{"ran": STEPS}] * WORKERS
    expected_dense, expected_table = reference()
    got_dense = torch.cat([s.parameters()[1] for s in dense])
    torch.testing.assert_close(got_dense, expected_dense, rtol=1e-5, atol=1e-6)
    got_table = LocalSparseClient(sparse).pull_rows(STEPS, {"t": torch.arange(ROWS)})["t"]
    torch.testing.assert_close(got_table, expected_table, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got_table, init_rows(SPEC, torch.arange(ROWS)))
    for t in trainers:
        assert t.sparse is not None and t.sparse.rows_held == 0  # the store is dropped after each push
        t.replicas.close()
