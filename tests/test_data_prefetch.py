"""``data.prefetch``: the next step's batch is read in a background thread while this step computes.

Only the reading moves: the samples each step takes and when their data shards count as done are the same as
without it, and the dataset is never read by two threads at once.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from pstrain.coordinator.config import ConfigError, parse_config
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.worker.data_feed import DataFeed
from tests.helpers import classification_set
from tests.test_job import RAW
from tests.test_trainer import (  # noqa: F401 - make_trainer is a fixture
    STEPS,
    MakeTrainer,
    build_shards,
    final_parameters,
    make_trainer,
    reference,
    start,
)

DATA = classification_set(40)


class Shards:
    """Data shards of 3 samples (so batches of 4 span them) from a list, recording requests and completions."""

    def __init__(self, samples: int = 40, size: int = 3) -> None:
        self.left = [list(range(i, min(i + size, samples))) for i in range(0, samples, size)]
        self.handed = 0
        self.completed: list[int] = []

    def request(self) -> pb.DataShard:
        self.handed += 1
        return pb.DataShard(data_shard_id=self.handed - 1, indices=self.left.pop(0))

    def complete(self, data_shard_id: int) -> None:
        self.completed.append(data_shard_id)


class Watched(Dataset):
    """``DATA``, recording which thread read each sample, blocking reads of ``blocked`` until ``release`` is set,
    and counting reads in progress at once."""

    def __init__(self, blocked: frozenset[int] = frozenset(), fail_at: int = -1) -> None:
        self.readers: dict[int, str] = {}
        self.blocked, self.fail_at = blocked, fail_at
        self.release = threading.Event()
        self.reading = threading.Event()
        self.at_once = self.most_at_once = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            self.readers[index] = threading.current_thread().name
            if index in self.blocked:
                self.reading.set()
                assert self.release.wait(10), "the test never released the read"
            if index == self.fail_at:
                raise OSError(f"sample {index}: cannot read the file")
            return DATA[index]
        finally:
            with self._lock:
                self.at_once -= 1


def batches(feed: DataFeed, steps: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a trainer does: each step's batch, then (but for the last) the next one's prefetch, then commit."""
    out = []
    for step in range(steps):
        out.append(feed.next_batch(count))
        if step + 1 < steps:
            feed.prefetch(count)
        feed.commit()
    return out


def test_prefetched_batches_equal_the_read_ones_and_shards_complete_at_the_same_steps() -> None:
    plain_source, ahead_source = Shards(), Shards()
    dataset = Watched()
    plain = batches(DataFeed(DATA, plain_source), 8)
    feed = DataFeed(dataset, ahead_source, prefetch_batches=True)
    try:
        ahead = batches(feed, 8)
    finally:
        feed.close()
    for (x, y), (x2, y2) in zip(plain, ahead, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert ahead_source.completed == plain_source.completed  # a shard is done after the step that read its last
    assert ahead_source.handed == plain_source.handed  # no prefetch after the last step: no shard beyond it
    assert all(dataset.readers[i].startswith("data-prefetch") for i in range(4, 32))  # every step but the first
    assert dataset.most_at_once == 1


def test_the_next_batch_is_read_while_the_step_goes_on() -> None:
    """``prefetch`` returns while the read it started is blocked: the step computes meanwhile."""
    dataset = Watched(blocked=frozenset({5}))
    feed = DataFeed(dataset, Shards(), prefetch_batches=True)
    try:
        feed.next_batch(4)
        feed.prefetch(4)  # samples 4..7, blocked at 5
        assert dataset.reading.wait(10)
        taken: list[torch.Tensor] = []
        waiter = threading.Thread(target=lambda: taken.append(feed.next_batch(4)[0]))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not taken  # the step needing it waits for the read, never reads beside it
        dataset.release.set()
        waiter.join(10)
        assert torch.equal(taken[0], torch.stack([DATA[i][0] for i in range(4, 8)]))
    finally:
        dataset.release.set()
        feed.close()


def test_a_prefetch_for_other_samples_is_dropped_and_the_right_ones_are_read() -> None:
    dataset = Watched()
    feed = DataFeed(dataset, Shards(), prefetch_batches=True)
    try:
        feed.prefetch(4)  # samples 0..3
        x, _ = feed.next_batch(6)  # a step of another size: 0..5
        assert torch.equal(x, torch.stack([DATA[i][0] for i in range(6)]))
    finally:
        feed.close()


def test_a_read_that_failed_in_the_background_fails_the_step_that_needs_it() -> None:
    feed = DataFeed(Watched(fail_at=6), Shards(), prefetch_batches=True)
    try:
        feed.next_batch(4)
        feed.prefetch(4)  # fails in the background: nothing raised yet
        feed.commit()
        with pytest.raises(OSError, match="sample 6: cannot read the file"):
            feed.next_batch(4)
    finally:
        feed.close()


def test_two_workers_with_prefetch_train_like_one_process_bitwise_as_without(
    make_trainer: MakeTrainer,  # noqa: F811
) -> None:
    finals = []
    for prefetch in (False, True):
        shards = build_shards(workers=2)
        trainers = [make_trainer(w, LocalPsClient(shards, pull_timeout_s=60), prefetch=prefetch) for w in range(2)]
        runs = [start(t) for t in trainers]
        for thread, _ in runs:
            thread.join(120)
            assert not thread.is_alive(), "a trainer hung"
        assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
        finals.append(final_parameters(shards))
    assert torch.equal(finals[0], finals[1])
    torch.testing.assert_close(finals[1], reference(workers=2), rtol=1e-5, atol=1e-6)


def test_data_prefetch_is_on_by_default_and_must_be_a_boolean() -> None:
    from pstrain.coordinator.model_state import ModelState
    from pstrain.coordinator.plan import job_spec, make_plan

    for data, off in (({}, False), ({"prefetch": False}, True)):
        cfg = parse_config({**RAW, "data": {**RAW["data"], **data}})
        model = ModelState(cfg)
        assert job_spec(cfg, make_plan(cfg), model.layout, "j").data_prefetch_off is off
    with pytest.raises(ConfigError, match="data.prefetch"):
        parse_config({**RAW, "data": {**RAW["data"], "prefetch": "sometimes"}})


def test_a_failed_read_of_samples_the_step_does_not_take_is_not_its_error() -> None:
    feed = DataFeed(Watched(fail_at=3), Shards(), prefetch_batches=True)
    try:
        feed.prefetch(4)  # samples 0..3: the read of 3 fails in the background
        x, _ = feed.next_batch(2)  # a step of 2 samples never reads sample 3
        assert torch.equal(x, torch.stack([DATA[i][0] for i in range(2)]))
    finally:
        feed.close()


def test_turning_prefetch_off_keeps_the_job_s_identity_and_its_checkpoints() -> None:
    """``data.prefetch`` moves only when a batch is read: a user who turns it off (a dataset that is not
    thread-safe) resumes from the checkpoints of the run that had it on. Before, the job file's hash changed."""
    from pstrain.coordinator.checkpoints import JobIdentity, Manifest

    on = JobIdentity.of(parse_config(RAW))
    off = JobIdentity.of(parse_config({**RAW, "data": {**RAW["data"], "prefetch": False}}))
    assert (off.digest, off.legacy_digest, off.settings) == (on.digest, on.legacy_digest, on.settings)
    written = Manifest(
        step=4, job_hash=on.digest, ps_shards=3, total_params=74, workers=2, per_worker_batch=8, committed_unix_s=0.0
    )
    off.check(written, Path("ckpt"))  # raises CheckpointMismatch for another job file


def test_a_read_that_hangs_does_not_hold_the_worker_s_exit() -> None:
    """The read runs in a daemon thread: a pool's threads are joined at exit, so a read hanging on a network file
    system would have held a stopping worker past its unit's stop timeout."""
    dataset = Watched(blocked=frozenset({4}))
    feed = DataFeed(dataset, Shards(), prefetch_batches=True)
    try:
        feed.next_batch(4)
        feed.prefetch(4)
        assert dataset.reading.wait(10)
        readers = [t for t in threading.enumerate() if t.name == "data-prefetch" and t.is_alive()]
        assert readers and all(t.daemon for t in readers)
        feed.close()  # returns at once, the read still blocked
    finally:
        dataset.release.set()
