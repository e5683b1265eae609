"""Data accounting across worker-set changes (``cluster.min_workers``), replacements and rollbacks.

The coordinator's real ``DataShardTracker`` and ``StepLedger`` (for the worker sets a step trains with) and each
worker's real ``DataFeed`` (the worker side: it asks for data shards as a step needs samples and reports them done
after the step's push), wired directly to each other instead of over gRPC. The Job's calls are made as it makes
them: a failed worker's shards are ``requeue``-d, a drop ``adopt``-s its slot, a return ``release``-s it, a
replacement ``reposition``-s it, a committed checkpoint records ``state_at`` and ``fold``-s.
"""

from __future__ import annotations

import threading
import time

import pytest

from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import WrongState
from pstrain.coordinator.ledger import StepLedger
from pstrain.protos import pstrain_pb2 as pb
from pstrain.worker.data_feed import DataFeed


class TrackerSource:
    """A worker's ``ShardSource`` on the tracker itself, numbering its requests as ``CoordinatorLink`` does."""

    def __init__(self, tracker: DataShardTracker, worker_id: int) -> None:
        self.tracker, self.worker_id, self.seq = tracker, worker_id, 0

    def request(self) -> pb.DataShard:
        self.seq += 1
        data_shard = self.tracker.dispatch(self.worker_id, self.seq)
        return pb.DataShard(data_shard_id=data_shard.data_shard_id, epoch=data_shard.epoch, indices=data_shard.indices)

    def complete(self, data_shard_id: int) -> None:
        self.tracker.complete(self.worker_id, data_shard_id)


class Cluster:
    """``slots`` workers training ``per_worker`` samples a step; ``taken[(step, worker)]`` = [(epoch, index)]."""

    def __init__(
        self, dataset: int, shard_size: int, slots: int, per_worker: int, tracker_state: dict | None = None
    ) -> None:
        self.dataset, self.shard_size, self.slots, self.per_worker = dataset, shard_size, slots, per_worker
        self.tracker = DataShardTracker(dataset, shard_size, True, 3, slots=slots)
        if tracker_state is not None:
            self.tracker.restore(tracker_state)
        self.ledger = StepLedger(slots, lambda step: 0.1, None, time.monotonic, threading.Condition())
        self.feeds = {w: self.new_feed(w) for w in range(slots)}
        self.taken: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def new_feed(self, worker_id: int) -> DataFeed:
        return DataFeed(dataset=[], source=TrackerSource(self.tracker, worker_id))  # type: ignore[arg-type]

    def consumed(self, step: int):  # type: ignore[no-untyped-def]
        """``Job._consumed``: a worker's batch for every step it trained before ``step``."""
        return lambda worker_id, start: (
            self.per_worker * sum(worker_id in self.ledger.workers_at(k) for k in range(start, step))
        )

    def take(self, worker_id: int) -> list[tuple[int, int]]:
        feed = self.feeds[worker_id]
        feed._fill(self.per_worker)
        head = list(feed._queue)[: self.per_worker]
        assert feed.next_indices(self.per_worker) == [index for index, _ in head]
        return [(data_shard_id // self.tracker.data_shards_per_epoch, index) for index, data_shard_id in head]

    def train(self, steps: range) -> None:
        for step in steps:
            for worker_id in self.ledger.workers_at(step):
                self.taken[(step, worker_id)] = self.take(worker_id)
                self.feeds[worker_id].commit()  # pushed everywhere: its exhausted data shards are reported done

    def die_mid_step(self, worker_id: int, step: int) -> None:
        """The worker took ``step``'s samples and died before its push; the coordinator declares it failed."""
        self.take(worker_id)
        del self.feeds[worker_id]
        self.tracker.requeue(worker_id)

    def drop(self, worker_id: int, step: int) -> None:
        """No replacement came: the job goes on without it from ``step``; the lowest live worker adopts its data."""
        live = [w for w in self.ledger.workers_at(step) if w != worker_id]
        self.tracker.adopt(worker_id, step, self.per_worker, min(live), self.consumed(step))
        self.ledger.set_workers(step, live)

    def take_back(self, worker_id: int, step: int) -> None:
        """A new worker takes the dropped slot back from ``step``."""
        self.ledger.set_workers(step, sorted({*self.ledger.workers_at(step), worker_id}))
        self.tracker.release(worker_id, step)
        self.feeds[worker_id] = self.new_feed(worker_id)

    def replace(self, worker_id: int, step: int) -> None:
        """Its replacement pulled version ``step`` and redoes it (``Job.rejoin_at``)."""
        self.tracker.reposition(worker_id, step, self.per_worker, self.consumed(step))
        self.feeds[worker_id] = self.new_feed(worker_id)

    def commit_checkpoint(self, step: int) -> dict:
        """What checkpoint ``step``'s manifest records (``Job._resume_state``)."""
        state = self.tracker.state_at(step, self.consumed(step), self.ledger.workers_at(step))
        assert state is not None
        self.tracker.fold(step, self.consumed(step))
        return state

    def samples(self) -> list[tuple[int, int]]:
        return [pair for key in sorted(self.taken) for pair in self.taken[key]]


def test_a_slot_adopted_by_a_worker_that_is_dropped_in_turn_is_still_trained():
    """Worker 2 is dropped and worker 0 adopts its slot; then worker 0 is dropped too and worker 1 adopts slot 0.
    Slot 2's data must go on to worker 1 with slot 0's: before, slot 2 stayed with the dead worker 0, so its
    data shards were never handed out again and every epoch from then on skipped a third of the dataset."""
    cluster = Cluster(dataset=12, shard_size=2, slots=3, per_worker=1)
    cluster.train(range(2))
    cluster.die_mid_step(2, 2)
    cluster.drop(2, 2)
    cluster.train(range(2, 4))
    cluster.die_mid_step(0, 4)
    cluster.drop(0, 4)
    cluster.train(range(4, 4 + 26))  # worker 1 alone: 36 samples in all, three epochs' worth
    samples = cluster.samples()
    assert len(samples) == len(set(samples)) == 36, "no sample twice"
    for epoch in (0, 1):
        assert sorted(index for e, index in samples if e == epoch) == list(range(12)), f"epoch {epoch} skipped samples"


def test_a_replaced_worker_that_had_adopted_a_slot_redoes_the_step_on_the_same_samples():
    """S2.5 with ``cluster.min_workers``: worker 0 adopted dropped worker 1's slot, so its data spans both slots;
    it dies mid-step and its replacement redoes that step. It must train exactly the samples the failed worker
    would have (the model equals the fault-free run's); before, the data shards it had not finished went back
    to the queue of the slot they came from and came out in another order (slot 0's queue first), so the
    replacement's steps took other samples than the fault-free run's."""

    def run(fail_at: int | None) -> dict[tuple[int, int], list[tuple[int, int]]]:
        cluster = Cluster(dataset=20, shard_size=3, slots=2, per_worker=4)
        cluster.train(range(1))
        cluster.die_mid_step(1, 1)
        cluster.drop(1, 1)
        for step in range(1, 8):
            if step == fail_at:
                cluster.die_mid_step(0, step)
                cluster.replace(0, step)
            cluster.train(range(step, step + 1))
        assert len(cluster.samples()) == len(set(cluster.samples()))
        return cluster.taken

    fault_free = run(None)
    for fail_at in range(1, 8):
        assert run(fail_at) == fault_free, f"the replacement at step {fail_at} trained other samples"


def test_a_rollback_after_a_dropped_slot_was_taken_back_continues_with_the_same_samples():
    """Worker 1 dies in step 1 and is dropped: worker 0 adopts its slot, and takes the rest of worker 1's data
    shard once its own is done. A worker registers at step 9 and takes slot 1 back from step 13 (``Job._joined``:
    4 steps ahead); worker 0 is still inside that slot-1 data shard when checkpoint 14 commits. A rollback to it
    must train every later step on the samples the run without the rollback trains (the crash guarantee: the
    same final model). Before, the checkpoint put the rest of that data shard back in slot 1's queue, so after
    the rollback worker 1 trained it, at other steps than worker 0 did."""
    steps, registers, back, checkpoint = 18, 9, 13, 14
    cluster = Cluster(dataset=60, shard_size=16, slots=2, per_worker=2)
    cluster.train(range(1))
    cluster.die_mid_step(1, 1)
    cluster.drop(1, 1)
    cluster.train(range(1, registers))
    cluster.take_back(1, back)
    cluster.train(range(registers, checkpoint))
    state = cluster.commit_checkpoint(checkpoint)
    cluster.train(range(checkpoint, steps))

    rolled_back = Cluster(dataset=60, shard_size=16, slots=2, per_worker=2, tracker_state=state)
    rolled_back.train(range(checkpoint, steps))
    assert rolled_back.taken == {key: taken for key, taken in cluster.taken.items() if key[0] >= checkpoint}
    before = [pair for (step, _), taken in sorted(cluster.taken.items()) if step < checkpoint for pair in taken]
    assert len(before + rolled_back.samples()) == len(set(before + rolled_back.samples())), "no sample twice"


def test_a_request_the_worker_gave_up_on_and_answered_late_hands_out_nothing():
    """Request 1's first attempt waits in its handler past the call's deadline; the worker retries it (served: the
    same data shard for the same number), moves on to request 2, and only then is the first attempt answered. It
    must hand out nothing: a shard handed to no one would never be trained and would count in the worker's
    stream."""
    tracker = DataShardTracker(40, 4, True, 3, slots=2)
    first = tracker.dispatch(0, 1)
    assert tracker.dispatch(0, 1) == first  # the retry
    second = tracker.dispatch(0, 2)
    with pytest.raises(WrongState, match="data shard request 1 of worker 0 arrived after its request 2"):
        tracker.dispatch(0, 1)
    assert tracker.outstanding(0) == sorted([first.data_shard_id, second.data_shard_id])
    assert tracker.dispatch(0, 3).data_shard_id not in (first.data_shard_id, second.data_shard_id)
    tracker.requeue(0)  # the worker failed: its replacement numbers from 1 again
    assert tracker.dispatch(0, 1) == first


def test_a_late_attempt_of_the_last_request_after_its_data_shard_was_completed_hands_out_nothing():
    tracker = DataShardTracker(40, 4, True, 3, slots=2)
    first = tracker.dispatch(0, 1)
    tracker.complete(0, first.data_shard_id)  # trained and reported before the stuck first attempt is answered
    with pytest.raises(WrongState, match=f"answered with data shard {first.data_shard_id}, which it has completed"):
        tracker.dispatch(0, 1)
    assert tracker.outstanding(0) == []
    assert tracker.dispatch(0, 2).data_shard_id != first.data_shard_id
