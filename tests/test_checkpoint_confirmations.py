"""Issue 11: the PS shards' checkpoint confirmations survive a coordinator restart (the journal keeps them).

A shard confirms a step once. A coordinator killed after every shard confirmed the final step but before
that step was recorded (so before the commit) must commit it after the restart from its journal, without
the shards confirming again; else no final manifest is written and ``wait_stopped`` waits out its timeout.
"""

from __future__ import annotations

import pytest

from pstrain.coordinator.checkpoints import committed_steps
from pstrain.coordinator.job import JobState
from pstrain.coordinator.journal import JOURNAL_NAME, Journal, JournalUnusable, read_journal, recovery
from pstrain.coordinator.ledger import StepReport
from tests.test_buffers_commit import RAW, WORKERS, make_job, start

NO_BUFFERS = {**RAW, "model": {"factory": "tests.helpers:odd_mlp"}}  # no buffers: shards alone gate a commit
STEPS, SHARDS = 6, 3  # checkpoints at steps 3 and 6 (the final one)


def report(worker: int, step: int) -> StepReport:
    return StepReport(worker_id=worker, step=step, loss=1.0, samples=8, step_s=0.1)


def test_a_restarted_coordinator_commits_the_final_checkpoint_its_shards_confirmed_before_it_died(tmp_path):
    first = make_job(tmp_path, raw=NO_BUFFERS)
    start(first)
    for step in range(3):
        for worker in range(WORKERS):
            first.report_step(report(worker, step))
    first.checkpoint_written(0, 3)
    first.checkpoint_written(1, 3)  # shard 2 is slow to write checkpoint 3
    for step in range(3, STEPS):
        for worker in range(WORKERS):
            if (step, worker) != (STEPS - 1, 0):  # worker 0's report of the last step comes after the restart
                first.report_step(report(worker, step))
    first.checkpoint_written(0, STEPS)
    first.checkpoint_written(1, STEPS)
    first.checkpoint_written(2, 3)  # commits 3 and compacts the journal: 0 and 1's confirmations of 6 are pending
    assert first.checkpoint_step == 3
    first.checkpoint_written(2, STEPS)
    assert first.checkpoint_step == 3  # every shard confirmed 6, but the last step is not recorded
    # the coordinator dies here (kill -9: nothing more is written) and is started again on its journal
    taken_back = recovery(tmp_path / JOURNAL_NAME)
    assert sorted(taken_back.confirmations) == [(0, STEPS), (1, STEPS), (2, STEPS)]
    second = make_job(tmp_path, taken_back=taken_back, raw=NO_BUFFERS)
    assert second.recovered and second.checkpoint_step == 3
    second.report_step(report(0, STEPS - 1))  # the worker's retry; no shard confirms again
    assert second.checkpoint_step == STEPS and committed_steps(tmp_path / "ckpt")[-1] == STEPS
    assert second.wait_over(10.0) and second.state == JobState.FINISHED
    for shard in range(SHARDS):
        assert second.heartbeat("ps", shard).stop  # told to stop: the job is over
    assert second.wait_stopped(10.0)  # without the journaled confirmations: no final manifest, the timeout
    second.close()
    first.close()


def test_a_commit_drops_the_confirmations_it_took_and_a_new_job_starts_without_any(tmp_path):
    first = make_job(tmp_path, raw=NO_BUFFERS)
    start(first)
    for step in range(3):
        for worker in range(WORKERS):
            first.report_step(report(worker, step))
    first.checkpoint_written(0, 3)
    first.checkpoint_written(1, 3)
    taken_back = recovery(tmp_path / JOURNAL_NAME)
    assert taken_back.confirmations == [(0, 3), (1, 3)]
    second = make_job(tmp_path, taken_back=taken_back, raw=NO_BUFFERS)  # compacts: the snapshot carries them
    assert [e["event"] for e in read_journal(tmp_path / JOURNAL_NAME)][:2] == ["checkpoint", "snapshot"]
    assert recovery(tmp_path / JOURNAL_NAME).confirmations == [(0, 3), (1, 3)]
    second.checkpoint_written(2, 3)  # the third shard: the step was recorded before the restart, it commits
    assert second.checkpoint_step == 3
    assert recovery(tmp_path / JOURNAL_NAME).confirmations == []  # committed: the compaction dropped them
    second.close()
    first.close()

    rolled_back = make_job(tmp_path, start_step=3, raw=NO_BUFFERS)  # a rollback / fresh start: a new journal
    assert "checkpoint_confirmed" not in {e["event"] for e in read_journal(tmp_path / JOURNAL_NAME)}
    with pytest.raises(JournalUnusable):
        recovery(tmp_path / JOURNAL_NAME)
    rolled_back.close()


def test_a_coordinator_killed_between_the_last_confirmation_and_the_commit_commits_when_it_restarts(tmp_path):
    first = make_job(tmp_path, raw=NO_BUFFERS)
    start(first)
    for step in range(3):
        for worker in range(WORKERS):
            first.report_step(report(worker, step))
    first.checkpoint_written(0, 3)
    first.checkpoint_written(1, 3)
    first.journal.append("checkpoint_confirmed", False, shard=2, step=3)  # type: ignore[union-attr]
    # ... and the coordinator dies before the ledger took shard 2's confirmation: nothing committed
    assert first.checkpoint_step == -1 and committed_steps(tmp_path / "ckpt") == []
    second = make_job(tmp_path, taken_back=recovery(tmp_path / JOURNAL_NAME), raw=NO_BUFFERS)
    assert second.checkpoint_step == 3 and committed_steps(tmp_path / "ckpt") == [3]  # at the restart itself
    second.close()
    first.close()


def test_recovery_takes_the_snapshots_confirmations_and_those_after_it_until_a_commit(tmp_path):
    path = tmp_path / JOURNAL_NAME
    journal = Journal(path)
    journal.append("checkpoint_confirmed", False, shard=0, step=3)  # before the snapshot: in it, or committed
    snapshot = {
        "job_id": "j",
        "per_device_batch": 4,
        "start_step": 0,
        "completed": 4,
        "members": [{"role": "ps", "id": 0}],
        "incarnations": [],
        "tracker": None,
        "reports": [],
        "replacements": 0,
        "confirmations": [[1, 6]],
    }
    journal.compact(3, snapshot)
    journal.append("checkpoint_confirmed", False, shard=0, step=6)
    assert recovery(path).confirmations == [(1, 6), (0, 6)]
    journal.append("checkpoint_committed", step=6)
    journal.append("checkpoint_confirmed", False, shard=0, step=9)
    assert recovery(path).confirmations == [(0, 9)]
    journal.close()
