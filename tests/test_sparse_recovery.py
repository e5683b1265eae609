"""Sparse tables under faults and schedules (issue 9 with issues 11 and S2.5): redone steps, checkpoints, LR.

No network: ``SparseShard`` / ``LocalSparseClient`` directly, and the checkpoint writer on a tmp dir.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointError, CheckpointWriter, ShardState
from pstrain.ps_server.errors import StepConflict
from pstrain.ps_server.sparse_checkpoint import (
    CheckpointJoin,
    SparseCheckpointWriter,
    load_tables,
    sparse_shard_for,
    sparse_steps,
)
from pstrain.ps_server.sparse_local_client import LocalSparseClient
from pstrain.ps_server.sparse_table import SparseCheckpoints, SparseShard
from pstrain.runtime.sparse_rows import TableSpec, init_rows

SPEC = TableSpec("t", 100, 3, init="normal", init_scale=0.1, seed=7, optimizer="adam", lr=0.5)


def grads(ids, value=1.0, dim=3):
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids, torch.full((len(ids), dim), value), torch.ones(len(ids), dtype=torch.int32)


# ---------------------------------------------------------------------- S2.5: a replaced worker redoes its step


def test_a_worker_push_arriving_twice_for_the_same_step_is_a_duplicate_and_updates_once():
    shards = [SparseShard(k, 2, [SPEC], workers=2, total_devices=2) for k in range(2)]
    client = LocalSparseClient(shards)
    ids = torch.tensor([1, 2, 3])
    before = client.pull_rows(0, {"t": ids})["t"].clone()
    payload = {"t": grads([1, 2, 3], 0.7)}
    first = client.push_rows(0, 0, payload, device_count=1)
    again = client.push_rows(0, 0, payload, device_count=1)  # the replacement's redo of the same step
    assert not any(a.duplicate for a in first) and all(a.duplicate for a in again)
    assert all(not a.completed for a in again) and all(s.version == 0 for s in shards)
    client.push_rows(1, 0, {"t": grads([2], 0.3)}, device_count=1)
    after = client.pull_rows(1, {"t": ids})["t"]
    reference = [SparseShard(k, 2, [SPEC], workers=2, total_devices=2) for k in range(2)]
    single = LocalSparseClient(reference)
    single.pull_rows(0, {"t": ids})
    single.push_rows(0, 0, payload, device_count=1)
    single.push_rows(1, 0, {"t": grads([2], 0.3)}, device_count=1)
    assert torch.equal(after, single.pull_rows(1, {"t": ids})["t"])  # bit for bit: one update, not two
    assert not torch.equal(after, before)
    for s, r in zip(shards, reference, strict=True):  # Adam's step count advanced once per row
        assert torch.equal(s.states()[1]["t"].state["step"], r.states()[1]["t"].state["step"])


def test_a_redone_step_pulls_the_rows_its_first_attempt_saw_even_after_the_step_completed():
    shards = [SparseShard(k, 2, [SPEC], workers=2, total_devices=2) for k in range(2)]
    client = LocalSparseClient(shards)
    ids = torch.tensor([0, 1, 2, 5, 40, 41])  # 0, 1: touched in step 0; the rest not (40, 41 never pulled)
    first = client.pull_rows(0, {"t": torch.tensor([0, 1, 2, 5])})["t"].clone()
    client.push_rows(0, 0, {"t": grads([0, 1])}, device_count=1)  # the worker that will die pushed its rows
    client.push_rows(1, 0, {"t": grads([1])}, device_count=1)  # ... and so did the other: the step completed
    assert all(s.version == 1 for s in shards)
    redo = client.pull_rows(0, {"t": ids})["t"]  # its replacement redoes step 0
    assert torch.equal(redo[:4], first)
    assert torch.equal(redo[4:], init_rows(SPEC, ids[4:]))
    assert client.push_rows(0, 0, {"t": grads([0, 1])}, device_count=1)[0].duplicate
    now = client.pull_rows(1, {"t": ids})["t"]
    assert not torch.equal(now[:2], first[:2]) and torch.equal(now[2:4], first[2:4])
    client.push_rows(0, 1, {}, 1)
    client.push_rows(1, 1, {}, 1)
    with pytest.raises(Exception, match="stale pull"):  # two versions back: gone
        client.pull_rows(0, {"t": ids})
    with pytest.raises(StepConflict):
        shards[0].pull(0, {"t": torch.tensor([0])}, 1.0)


# ---------------------------------------------------------------------- the table's learning rate


def schedule(warmup_steps: int) -> pb.LrSchedule:
    return pb.LrSchedule(base_lr=0.1, scaled_lr=0.4, warmup_steps=warmup_steps)


@pytest.mark.parametrize("lr_schedule, factors", [("follow", [0.25, 0.5, 0.75, 1.0, 1.0]), ("constant", [1.0] * 5)])
def test_the_table_lr_follows_the_dense_warmup_unless_constant(lr_schedule, factors):
    spec = TableSpec("t", 10, 2, init="zeros", optimizer="sgd", lr=0.2, lr_schedule=lr_schedule)
    shard = SparseShard(0, 1, [spec], workers=1, total_devices=1, schedule=schedule(4))
    expected = torch.zeros(2)
    for step, factor in enumerate(factors):
        shard.push(0, step, {"t": grads([3], 1.0, dim=2)}, 1)
        expected -= 0.2 * factor
        got = shard.pull(step + 1, {"t": torch.tensor([3])}, 1.0)[1]["t"][0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------- checkpoints: one confirmation per step


def test_the_join_confirms_a_step_only_once_the_dense_and_the_sparse_file_are_written():
    confirmed: list[int] = []

    def confirm(step: int) -> int:
        confirmed.append(step)
        return step

    join = CheckpointJoin(("dense", "sparse"), confirm)
    dense, sparse = join.part("dense"), join.part("sparse")
    assert dense(3) is None and confirmed == []
    assert sparse(6) is None and confirmed == []  # sparse ran ahead: 6 waits for its dense file
    assert sparse(3) == 3 and confirmed == [3]
    assert dense(6) == 6 and confirmed == [3, 6]
    assert dense(9) == 6  # the newest committed step stays known to both writers


def test_a_sparse_checkpoint_is_confirmed_with_the_dense_one_and_pruned_below_the_committed_step(tmp_path):
    committed: list[int] = []
    join = CheckpointJoin(("dense", "sparse"), lambda step: committed.append(step) or step)
    dense = CheckpointWriter(tmp_path, 0, keep=2, on_written=join.part("dense"))
    sparse = SparseCheckpointWriter(tmp_path, 0, keep=2, on_written=join.part("sparse"))
    shard = SparseShard(0, 1, [SPEC], workers=1, total_devices=1, checkpoints=SparseCheckpoints(2, 7, sparse.submit))
    for version in (2, 4, 6, 7):  # the dense files first: nothing is confirmed without the sparse ones
        dense.submit(ShardState(0, 0, 4, version, torch.zeros(4), {}))
    dense.close()
    assert committed == []
    for step in range(7):
        shard.push(0, step, {"t": grads([step % 3, 10 + step])}, 1)
    sparse.close()
    assert committed == [2, 4, 6, 7]  # each once, after both of its files
    assert sparse_steps(tmp_path, 0) == [6, 7]  # below the committed 7, keep - 1 = 1 file stays
    restored = load_tables(tmp_path, 0, 7)["t"]
    final = shard.states()[1]["t"]
    assert torch.equal(restored.ids, final.ids) and torch.equal(restored.rows, final.rows)
    assert torch.equal(restored.state["exp_avg"], final.state["exp_avg"])


def test_the_snapshot_is_taken_under_the_lock_and_written_outside_it(tmp_path):
    """A slow writer holds neither pulls nor the next step's pushes (backpressure only at the next due step)."""
    release, entered = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow(version, states):
        seen.append(version)
        entered.set()
        release.wait(10)

    shard = SparseShard(0, 1, [SPEC], workers=2, total_devices=2, checkpoints=SparseCheckpoints(1, 10, slow))
    shard.push(0, 0, {"t": grads([1])}, 1)
    finisher = threading.Thread(target=lambda: shard.push(1, 0, {}, 1))
    finisher.start()
    assert entered.wait(10) and seen == [1]
    assert shard.pull(1, {"t": torch.tensor([1])}, 1.0)[0] == 1  # the lock is free while the snapshot is handed over
    release.set()
    finisher.join(10)


def test_resuming_from_a_sparse_checkpoint_needs_its_file(tmp_path):
    job = pb.JobSpec(
        ps_shards=1,
        workers=1,
        total_devices=1,
        checkpoint_dir=str(tmp_path),
        checkpoint_every_steps=2,
        steps=4,
        checkpoint_keep=2,
    )
    job.embeddings.append(SPEC.to_pb())
    shard, writer = sparse_shard_for(job, 0, 0, on_written=lambda step: step)
    assert writer is not None
    shard.push(0, 0, {"t": grads([1])}, 1)
    shard.push(0, 1, {"t": grads([1])}, 1)
    writer.close()
    resumed, again = sparse_shard_for(job, 0, 2, on_written=lambda step: step)
    assert again is not None
    assert torch.equal(resumed.states()[1]["t"].rows, shard.states()[1]["t"].rows)
    again.close()
    with pytest.raises(CheckpointError, match="no file"):
        sparse_shard_for(job, 0, 4, on_written=lambda step: step)
