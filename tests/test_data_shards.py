import pytest
import torch

from pstrain.coordinator.data_shards import DataShardCounts, DataShardTracker
from pstrain.coordinator.errors import UnknownMember


def test_each_epoch_covers_the_dataset_once_in_shards():
    tracker = DataShardTracker(dataset_size=10, data_shard_size=4, shuffle=True, seed=1)
    assert tracker.data_shards_per_epoch == 3
    epochs: dict[int, list[int]] = {}
    for i in range(6):
        data_shard = tracker.dispatch(worker_id=i % 2)
        assert data_shard.data_shard_id == i
        epochs.setdefault(data_shard.epoch, []).extend(data_shard.indices)
        assert len(data_shard.indices) == (2 if i % 3 == 2 else 4)
    assert sorted(epochs[0]) == list(range(10)) and sorted(epochs[1]) == list(range(10))
    assert epochs[0] != epochs[1], "shuffle changes the order every epoch"


def test_order_is_reproducible_and_unshuffled_is_sequential():
    a = DataShardTracker(100, 10, True, seed=5)
    b = DataShardTracker(100, 10, True, seed=5)
    assert [a.dispatch(0).indices for _ in range(12)] == [b.dispatch(0).indices for _ in range(12)]
    plain = DataShardTracker(5, 2, False, seed=0)
    assert [plain.dispatch(0).indices for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_any_seed_the_config_accepts_shuffles():
    """``job.seed`` may be any 63-bit value: the permutation's seed is taken modulo 2**64, and seeds that fitted
    before keep their permutation."""
    big = DataShardTracker(100, 10, True, seed=2**62)
    assert sorted(i for _ in range(10) for i in big.dispatch(0).indices) == list(range(100))
    small = DataShardTracker(100, 10, True, seed=5)
    gen = torch.Generator().manual_seed(5 * 1_000_003)
    assert small.dispatch(0).indices == torch.randperm(100, generator=gen)[:10].tolist()


def test_dispatch_is_recorded_and_cleared_on_completion():
    tracker = DataShardTracker(8, 2, False, 0)
    s0, s1, s2 = tracker.dispatch(0), tracker.dispatch(1), tracker.dispatch(0)
    assert tracker.outstanding(0) == [s0.data_shard_id, s2.data_shard_id] and tracker.outstanding(1) == [
        s1.data_shard_id
    ]
    tracker.complete(0, s0.data_shard_id)
    assert tracker.outstanding(0) == [s2.data_shard_id]
    counts = tracker.counts()
    assert (counts.todo, counts.doing, counts.done) == (1, 2, 1)


def test_completion_by_the_wrong_worker_or_twice_is_rejected():
    tracker = DataShardTracker(8, 2, False, 0)
    data_shard = tracker.dispatch(0)
    with pytest.raises(UnknownMember, match="not held by worker 1"):
        tracker.complete(1, data_shard.data_shard_id)
    tracker.complete(0, data_shard.data_shard_id)
    with pytest.raises(UnknownMember):
        tracker.complete(0, data_shard.data_shard_id)
    with pytest.raises(UnknownMember):
        tracker.complete(0, 99)


def test_requeue_gives_a_failed_workers_shards_out_first():
    tracker = DataShardTracker(8, 2, False, 0)
    lost = [tracker.dispatch(1), tracker.dispatch(1)]
    tracker.dispatch(0)
    assert tracker.requeue(1) == [s.data_shard_id for s in lost]
    again = [tracker.dispatch(2), tracker.dispatch(2)]
    assert [s.indices for s in again] == [s.indices for s in lost]
    assert tracker.dispatch(2).data_shard_id == 3


def test_a_requeued_data_shard_is_counted_as_todo_and_completed_by_its_new_holder():
    tracker = DataShardTracker(8, 2, False, 0)
    lost = tracker.dispatch(1)
    assert tracker.counts() == DataShardCounts(todo=3, doing=1, done=0)
    assert tracker.requeue(1) == [lost.data_shard_id]
    assert tracker.outstanding(1) == [] and tracker.counts() == DataShardCounts(todo=4, doing=0, done=0)
    with pytest.raises(UnknownMember, match="not held by worker 1"):
        tracker.complete(1, lost.data_shard_id)  # the failed worker no longer holds it
    again = tracker.dispatch(0)
    assert again == lost and tracker.outstanding(0) == [lost.data_shard_id]
    tracker.complete(0, again.data_shard_id)
    assert tracker.counts() == DataShardCounts(todo=3, doing=0, done=1)
    assert tracker.requeue(0) == []


def consume(tracker: DataShardTracker, worker: int, count: int, queues: dict[int, list[int]]) -> list[int]:
    """What a worker's DataFeed does: take ``count`` samples, asking for data shards as needed."""
    queue = queues.setdefault(worker, [])
    while len(queue) < count:
        queue.extend(tracker.dispatch(worker).indices)
    taken, queues[worker] = queue[:count], queue[count:]
    return taken


def test_each_slot_gets_its_own_sequence_whatever_the_request_order():
    a = DataShardTracker(23, 4, True, seed=2, slots=2)
    b = DataShardTracker(23, 4, True, seed=2, slots=2)
    first = [a.dispatch(0).data_shard_id for _ in range(3)] + [a.dispatch(1).data_shard_id for _ in range(3)]
    assert first == [0, 2, 4, 1, 3, 5]
    interleaved = [b.dispatch(w).data_shard_id for w in (1, 0, 1, 1, 0, 0)]
    assert sorted(interleaved) == sorted(first) and [i for i in interleaved if i % 2 == 0] == [0, 2, 4]


def test_steps_are_the_same_samples_whatever_the_timing():
    """The samples of each step depend on (seed, epoch, slot, step), not on who asked first."""

    def steps(order: list[int]) -> list[list[int]]:
        tracker = DataShardTracker(23, 3, True, seed=4, slots=2)
        queues: dict[int, list[int]] = {}
        per_step: list[dict[int, list[int]]] = []
        counters = {0: 0, 1: 0}
        for worker in order:
            step = counters[worker]
            counters[worker] += 1
            while len(per_step) <= step:
                per_step.append({})
            per_step[step][worker] = consume(tracker, worker, 5, queues)
        return [sorted(s[0] + s[1]) for s in per_step]

    assert steps([0, 1] * 12) == steps([0] * 12 + [1] * 12) == steps([1, 1, 0] * 4 + [0] * 8 + [1] * 4)


def test_resume_continues_exactly_where_an_uninterrupted_run_is():
    reference = DataShardTracker(23, 3, True, seed=7, slots=2)
    ref_queues: dict[int, list[int]] = {}
    ref_steps = [[consume(reference, w, 5, ref_queues) for w in (0, 1)] for _ in range(12)]
    for t in (0, 1, 4, 7):
        resumed = DataShardTracker(23, 3, True, seed=7, slots=2)
        resumed.resume(t, 5)
        queues: dict[int, list[int]] = {}
        assert [[consume(resumed, w, 5, queues) for w in (0, 1)] for _ in range(12 - t)] == ref_steps[t:]
    used = DataShardTracker(23, 3, True, seed=7, slots=2)
    used.dispatch(0)
    with pytest.raises(RuntimeError, match="fresh tracker"):
        used.resume(2, 5)


def test_every_sample_once_per_epoch_across_slots():
    tracker = DataShardTracker(23, 3, True, seed=1, slots=2)
    seen: dict[int, list[int]] = {}
    dispatch = tracker.dispatch

    def recording(worker_id: int):  # type: ignore[no-untyped-def]
        data_shard = dispatch(worker_id)
        seen.setdefault(data_shard.epoch, []).extend(data_shard.indices)
        return data_shard

    tracker.dispatch = recording  # type: ignore[method-assign]
    queues: dict[int, list[int]] = {}
    for _ in range(8):
        for worker in (0, 1):
            consume(tracker, worker, 5, queues)
    assert sorted(seen[0]) == list(range(23))  # epoch 0's 8 data shards went out exactly once


def test_the_completed_ledger_of_a_long_job_stays_a_few_runs():
    """Before, every completed id stayed in a list, in memory and in every snapshot and manifest."""
    slots = 4
    tracker = DataShardTracker(1000, 1, True, 3, slots=slots)
    held = {w: tracker.dispatch(w) for w in range(slots)}
    for n in range(20_000):  # the slots finish in turns, one data shard always in flight per slot
        w = (n * 7) % slots
        tracker.complete(w, held[w].data_shard_id)
        held[w] = tracker.dispatch(w)
    state = tracker.snapshot()
    assert len(state["completed_ranges"]) <= slots and state["completed_again"] == []
    completed = tracker.completed_ids()
    assert len(completed) == len(set(completed)) == 20_000 == tracker.counts().done
    assert not set(completed) & {d.data_shard_id for d in held.values()}
    again = DataShardTracker(1000, 1, True, 3, slots=slots)
    again.restore(state)
    assert again.completed_ids() == completed and again.snapshot() == state


def test_a_snapshot_with_a_completed_list_is_still_read_and_a_repeat_shows():
    tracker = DataShardTracker(8, 2, False, 0)
    tracker.dispatch(0)
    state = tracker.snapshot()
    del state["completed_ranges"], state["completed_again"]
    state["completed"] = [5, 3, 4, 3]  # the old form, in completion order; 3 twice (a bug it must not hide)
    tracker.restore(state)
    assert tracker.completed_ids() == [3, 4, 5, 3]
    assert tracker.snapshot()["completed_ranges"] == [[3, 6]] and tracker.snapshot()["completed_again"] == [3]
