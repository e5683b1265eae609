import pytest

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
