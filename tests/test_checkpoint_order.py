"""Checkpoint snapshots reach the writer in version order, each step is written once, the newest never moves back.

A shard (the dense range, the sparse tables) hands a due snapshot over after letting go of its lock, and the
hand-over may wait for the previous write (backpressure). Meanwhile the step's version is published, the pushing
worker's retry is answered as a duplicate, and the workers can complete the next due step: its snapshot must still
reach the writer after the older one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointWriter, ShardState, written_steps
from pstrain.ps_server.hand_over import HandOverTurns
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import CheckpointPolicy, ParameterShard
from pstrain.ps_server.sparse_checkpoint import SparseCheckpointWriter, sparse_steps
from pstrain.ps_server.sparse_table import RowGrads, SparseCheckpoints, SparseShard, TableState
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.sparse_rows import TableSpec
from tests.helpers import wait_for
from tests.test_checkpoints import state
from tests.test_shard import WatchedCondition

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.1)
NUMEL = 10


class HeldHandOver:
    """An ``on_snapshot`` (``dense`` or ``sparse``) that stops the hand-over of version ``held`` before it reaches
    the writer, as a preempted thread or one waiting for the previous write would, until ``release`` is set; every
    other one goes straight on."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls: list[int] = []

    def reach(self, version: int) -> None:
        """A hand-over of ``version`` is on its way to the writer: note it, and hold it if it is the held one."""
        self.calls.append(version)
        if version == self.held:
            self.entered.set()
            assert self.release.wait(30), "the test never released the held hand-over"

    def dense(self, submit: Callable[[ShardState], None]) -> Callable[[ShardState], None]:
        def on_snapshot(snapshot: ShardState) -> None:
            self.reach(snapshot.version)
            submit(snapshot)

        return on_snapshot

    def sparse(
        self, submit: Callable[[int, dict[str, TableState]], None]
    ) -> Callable[[int, dict[str, TableState]], None]:
        def on_snapshot(version: int, tables: dict[str, TableState]) -> None:
            self.reach(version)
            submit(version, tables)

        return on_snapshot


def shard_with(kind: str, on_snapshot: Callable[[ShardState], None]) -> tuple[PiecedShard, list[int]]:
    """A one-worker shard that snapshots every step: one piece, or two (``PiecedShard`` joins them); the starts
    of its pieces, in the order a worker pushes them."""
    policy = CheckpointPolicy(every_steps=1, final_version=100, on_snapshot=on_snapshot)
    initial = torch.arange(NUMEL, dtype=torch.float32)
    if kind == "one piece":
        return PiecedShard([ParameterShard(0, 0, NUMEL, initial, SGD, LR, 1, checkpoints=policy)]), [0]
    pieces = [ShardRange(0, 0, 4), ShardRange(0, 4, NUMEL)]
    return PiecedShard.build(pieces, initial, SGD, LR, 1, checkpoints=policy), [0, 4]


def gradient(step: int, piece: ParameterShard) -> torch.Tensor:
    return torch.full((piece.numel,), 0.1 * (step + 1))


def push_step(shard: PiecedShard, step: int, starts: list[int]) -> None:
    for start in starts:
        shard.push(0, step, gradient(step, shard._by_start[start]), 1, piece_start=start)


@pytest.mark.parametrize("kind", ["one piece", "two pieces"])
def test_a_later_snapshot_waits_for_an_earlier_hand_over_and_a_retried_push_adds_none(
    tmp_path: Path, kind: str
) -> None:
    """Step 0's hand-over is held; its push is retried (a duplicate: answered, no second snapshot, nothing
    confirmed), and step 1 completes meanwhile. Its snapshot goes to the writer only after step 0's: both are
    written and confirmed in order. Handed over first, version 2 was written before 1, which was then dropped
    (or, without the writer's guard, written after it, deleting the newer file as a discarded run's)."""
    confirmed: list[int] = []
    writer = CheckpointWriter(tmp_path, 0, keep=5, on_written=lambda step: confirmed.append(step))
    held = HeldHandOver(held=1)
    shard, starts = shard_with(kind, held.dense(writer.submit))
    last = shard._by_start[starts[-1]]  # the piece whose push completes each step
    handing = WatchedCondition()
    last._turns = HandOverTurns(handing)
    try:
        push_step(shard, 0, starts[:-1])
        first = threading.Thread(target=push_step, args=(shard, 0, starts[-1:]), name="step-0", daemon=True)
        first.start()
        assert held.entered.wait(30), "step 0's snapshot was never handed over"
        retried = shard.push(0, 0, gradient(0, last), 1, piece_start=last.start)
        assert retried.duplicate and not retried.completed
        assert held.calls == [1] and confirmed == []  # no second snapshot; nothing confirmed before it is durable
        push_step(shard, 1, starts[:-1])
        second = threading.Thread(target=push_step, args=(shard, 1, starts[-1:]), name="step-1", daemon=True)
        second.start()
        wait_for(lambda: not second.is_alive() or handing.is_blocked(second), 30, "step 1 to hand over or wait")
        held.release.set()
        for thread in (first, second):
            thread.join(30)
            assert not thread.is_alive(), f"{thread.name}'s push hung"
    finally:
        held.release.set()
        writer.close()
        shard.close()
    assert held.calls == [1, 2]
    assert confirmed == [1, 2] and [r.step for r in writer.records] == [1, 2]
    assert written_steps(tmp_path, 0) == [1, 2]


def test_a_writer_drops_a_snapshot_older_than_one_it_took_and_a_step_it_took_already(tmp_path: Path) -> None:
    """Should an older snapshot reach the writer after a newer one (two callers racing for the queue), it is not
    written: written after it, its confirmation would go backwards and its prune would delete the newer, confirmed
    file as a discarded run's. The same step twice is written and confirmed once."""
    confirmed: list[int] = []
    writer = CheckpointWriter(tmp_path, 0, keep=5, on_written=lambda step: confirmed.append(step))
    for step in (2, 1, 2, 3):
        writer.submit(state(step))
    writer.close()
    assert confirmed == [2, 3] and [r.step for r in writer.records] == [2, 3]
    assert written_steps(tmp_path, 0) == [2, 3]


def test_a_failed_hand_over_lets_the_next_one_through(tmp_path: Path) -> None:
    """The turn passes on even when ``on_snapshot`` raises, so a later step's push never waits for good."""
    taken: list[int] = []

    def flaky(snapshot: ShardState) -> None:
        if snapshot.version == 1:
            raise OSError(28, "No space left on device")
        taken.append(snapshot.version)

    shard, starts = shard_with("one piece", flaky)
    try:
        with pytest.raises(OSError, match="No space left"):
            push_step(shard, 0, starts)
        finished = threading.Thread(target=push_step, args=(shard, 1, starts), daemon=True)
        finished.start()
        finished.join(30)
        assert not finished.is_alive(), "step 1's hand-over waited for the failed one for good"
    finally:
        shard.close()
    assert taken == [2] and shard.version == 2


# ---------------------------------------------------------------------- the sparse tables: the same order

SPARSE = TableSpec("t", 100, 3, init="normal", init_scale=0.1, seed=7, optimizer="sgd", lr=0.5)


def sparse_shard_with(on_snapshot: Callable[[int, dict[str, TableState]], None]) -> SparseShard:
    """A one-worker, one-device sparse shard (all rows its own) that snapshots its tables every step."""
    return SparseShard(0, 1, [SPARSE], workers=1, total_devices=1, checkpoints=SparseCheckpoints(1, 100, on_snapshot))


def rows(step: int) -> dict[str, RowGrads]:
    ids = torch.tensor([step, 50], dtype=torch.int64)
    return {"t": (ids, torch.full((2, SPARSE.dim), 0.1 * (step + 1)), torch.ones(2, dtype=torch.int32))}


def push_rows(shard: SparseShard, step: int) -> None:
    assert shard.push(0, step, rows(step), 1).completed


def test_a_later_sparse_snapshot_waits_for_an_earlier_hand_over_and_none_is_dropped(tmp_path: Path) -> None:
    """Version 1's hand-over is held; its push is retried (a duplicate: no second snapshot, nothing confirmed),
    and step 1 completes meanwhile. Version 2's snapshot goes to the writer only after version 1's: both are
    written and confirmed, in order. Handed over first, version 2 was written and version 1 dropped by the
    writer's guard: that step's sparse file was never written, so the coordinator could never commit it."""
    confirmed: list[int] = []
    writer = SparseCheckpointWriter(tmp_path, 0, keep=5, on_written=lambda step: confirmed.append(step))
    held = HeldHandOver(held=1)
    shard = sparse_shard_with(held.sparse(writer.submit))
    handing = WatchedCondition()
    shard._turns = HandOverTurns(handing)
    try:
        first = threading.Thread(target=push_rows, args=(shard, 0), name="step-0", daemon=True)
        first.start()
        assert held.entered.wait(30), "version 1's snapshot was never handed over"
        retried = shard.push(0, 0, rows(0), 1)
        assert retried.duplicate and not retried.completed
        assert held.calls == [1] and confirmed == []  # no second snapshot; nothing confirmed before it is durable
        second = threading.Thread(target=push_rows, args=(shard, 1), name="step-1", daemon=True)
        second.start()
        wait_for(lambda: not second.is_alive() or handing.is_blocked(second), 30, "step 1 to hand over or wait")
        held.release.set()
        for thread in (first, second):
            thread.join(30)
            assert not thread.is_alive(), f"{thread.name}'s push hung"
    finally:
        held.release.set()
        writer.close()
        shard.close()
    assert held.calls == [1, 2]
    assert confirmed == [1, 2] and [r.step for r in writer.records] == [1, 2]
    assert sparse_steps(tmp_path, 0) == [1, 2]


def test_a_failed_sparse_hand_over_lets_the_next_one_through() -> None:
    """The turn passes on even when ``on_snapshot`` raises, so a later step's push never waits for good."""
    taken: list[int] = []

    def flaky(version: int, tables: dict[str, TableState]) -> None:
        if version == 1:
            raise OSError(28, "No space left on device")
        taken.append(version)

    shard = sparse_shard_with(flaky)
    try:
        with pytest.raises(OSError, match="No space left"):
            push_rows(shard, 0)
        finished = threading.Thread(target=push_rows, args=(shard, 1), daemon=True)
        finished.start()
        finished.join(30)
        assert not finished.is_alive(), "step 1's hand-over waited for the failed one for good"
    finally:
        shard.close()
    assert taken == [2] and shard.version == 2
