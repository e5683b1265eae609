"""cluster.min_workers (issue 11), review fixes: the shard keeps changes scheduled for later steps when a removal
arrives, finishes a step in flight with a kept push at the LR it began with, a pieced shard changes no piece when
one refuses, and a commit folds the data-shard tracker's streams (bounded; no state computed while positional).
"""

import pytest
import torch

from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.ps_server.errors import StepConflict
from pstrain.ps_server.pieces import PiecedShard
from pstrain.runtime.shard_map import ShardRange
from tests.test_min_workers import LR, SGD, grad, make_job, make_shard, start, train_step

# ------------------------------------------------------------------ the shard


def test_a_removal_keeps_a_return_scheduled_for_a_later_step_less_the_removed_workers():
    shard = make_shard()
    shard.set_workers(0, [0, 1], 0.2)  # worker 2 dropped
    shard.set_workers(2, [0, 1, 2], 0.3)  # ... and back from step 2
    shard.set_workers(0, [0], 0.1)  # worker 1 dropped late, at the step in flight
    assert shard.push(0, 0, grad(1), 1).completed
    assert shard.push(0, 1, grad(1), 1).completed
    assert shard.contributors == (0, 2)  # the return stands, without worker 1
    assert not shard.push(0, 2, grad(1), 1).completed
    assert shard.push(2, 2, grad(1), 1).completed


def test_a_kept_push_finishes_its_step_at_the_old_lr_on_every_piece_and_the_new_lr_follows():
    ranges = [ShardRange(0, 0, 2), ShardRange(0, 2, 4)]
    shard = PiecedShard.build(ranges, torch.zeros(4), SGD, LR, 3)
    for w in range(3):
        shard.pieces[0].push(w, 0, grad(1, 2), 1)  # the first piece finished step 0 at lr 0.3
    shard.pieces[1].push(1, 0, grad(1, 2), 1)  # worker 1 pushed the second piece's step 0, then died
    assert shard.set_workers(0, [0, 2], 0.2) == (True, True)
    for w in (0, 2):
        shard.pieces[1].push(w, 0, grad(1, 2), 1)
    assert [p.version for p in shard.pieces] == [1, 1]
    assert torch.allclose(torch.cat([p.parameters()[1] for p in shard.pieces]), torch.full((4,), -0.3))
    for w in (0, 2):
        shard.push(w, 1, grad(1), 1)
    assert torch.allclose(torch.cat([p.parameters()[1] for p in shard.pieces]), torch.full((4,), -0.5))


def test_a_newer_change_is_not_undone_by_an_lr_change_put_off_by_an_earlier_one():
    shard = make_shard()
    shard.push(1, 0, grad(1), 1)
    shard.set_workers(0, [0, 2], 0.2)  # worker 1's push is kept: lr 0.2 from step 1
    shard.set_workers(0, [0], 0.1)  # worker 2 dropped too, nothing of it kept: lr 0.1 at once
    assert shard.push(0, 0, grad(1), 1).completed
    assert torch.allclose(shard.parameters()[1], torch.full((4,), -0.1))
    assert shard.push(0, 1, grad(1), 1).completed
    assert torch.allclose(shard.parameters()[1], torch.full((4,), -0.2))


def test_a_pieced_shard_whose_piece_refuses_an_addition_changes_no_piece():
    ranges = [ShardRange(0, 0, 2), ShardRange(0, 2, 4)]
    shard = PiecedShard.build(ranges, torch.zeros(4), SGD, LR, 3)
    shard.set_workers(0, [0, 1], 0.2)
    for w in (0, 1):
        shard.push(w, 0, grad(1), 1)
    shard.pieces[1].push(0, 1, grad(1, 2), 1)  # the second piece collects step 1 already
    with pytest.raises(StepConflict, match="too late to add workers \\[2\\]"):
        shard.set_workers(1, [0, 1, 2], 0.3)
    assert [p.contributors for p in shard.pieces] == [(0, 1), (0, 1)]
    shard.pieces[0].push(0, 1, grad(1, 2), 1)
    assert shard.pieces[0].push(1, 1, grad(1, 2), 1).completed  # not waiting for worker 2
    assert torch.allclose(shard.pieces[0].parameters()[1], torch.full((2,), -0.4))  # lr 0.2 both steps


# ------------------------------------------------------------------ the tracker's streams


def feed(tracker, steps, fold_every=None, samples=4):
    """Workers 0 and 1 each take ``samples`` a step in dispatch order and complete a data shard once consumed;
    every ``fold_every`` steps the tracker is folded at the step reached."""
    queue = {0: [], 1: []}
    longest = 0
    for step in steps:
        for w in (0, 1):
            while sum(n for _, n in queue[w]) < samples:
                data_shard = tracker.dispatch(w)
                queue[w].append((data_shard.data_shard_id, len(data_shard.indices)))
            left = samples
            while left:
                dsid, n = queue[w][0]
                taken = min(n, left)
                left -= taken
                if taken == n:
                    queue[w].pop(0)
                    tracker.complete(w, dsid)
                else:
                    queue[w][0] = (dsid, n - taken)
        if fold_every and (step + 1) % fold_every == 0:
            tracker.fold(step + 1, lambda w, begun, at=step + 1: (at - begun) * samples)
        longest = max(longest, *(len(s) for s in tracker._streams.values()))
    return longest


def test_folding_at_commits_keeps_the_streams_bounded_and_changes_no_rewind():
    folded = DataShardTracker(1000, 3, True, 0, slots=2)
    kept = DataShardTracker(1000, 3, True, 0, slots=2)
    assert feed(folded, range(300), fold_every=4) <= 8
    assert feed(kept, range(300)) > 300
    assert len(folded.snapshot()["streams"][0][2]) <= 8
    at = 302
    feed(folded, range(300, at))
    feed(kept, range(300, at))
    for tracker in (folded, kept):
        tracker.positional = False  # as after an adoption: a repositioning rewinds the stream
        tracker.reposition(0, at - 1, 4, lambda w, begun: (at - 1 - begun) * 4)
    assert folded.completed_ids() == kept.completed_ids()
    assert folded.snapshot()["requeued"] == kept.snapshot()["requeued"]
    assert folded.counts() == kept.counts()


def test_a_positional_commit_computes_no_state_and_folds_the_streams(tmp_path, monkeypatch):
    job, _, _ = make_job(tmp_path, min_workers=2, steps=60)
    start(job)
    calls = []
    state_at = job.data_shards.state_at
    monkeypatch.setattr(job.data_shards, "state_at", lambda *a: calls.append(a) or state_at(*a))
    longest = 0
    for step in range(40):
        train_step(job, [0, 1, 2], step)
        if (step + 1) % 4 == 0:
            assert job._resume_state(step + 1) == {"worker_ids": [0, 1, 2], "tracker": None}
        longest = max(longest, *(len(s) for s in job.data_shards._streams.values()))
    assert calls == [] and longest <= 4
