"""The coordinator's journal and data-shard tracker stay bounded when no checkpoint commits.

Before, only a committed checkpoint compacted the journal and folded the tracker's streams: with
``checkpoint.every_steps: 0`` (or commits that stall) the journal grew by some 750 bytes a step with two
workers (15 MB at 20k steps, all of it read back into memory by a restarted coordinator) and the tracker
kept every data shard's sample list it ever dispatched. Real ``Job`` objects, real journal files, real
PS shards behind ``set_ps_workers`` (``tests.test_min_workers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.job import Job
from pstrain.coordinator.journal import JOURNAL_NAME, read_journal, recovery
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.main import build_job, job_keys
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from tests import test_min_workers as mw
from tests.helpers import write_job
from tests.test_job import RAW, Clock

LIMIT = 16_000  # bytes of events between compactions: some 20 steps of a two-worker job


def two_worker_job(out: Path, steps: int) -> Job:
    cfg = parse_config({**RAW, "job": {"steps": steps, "seed": 0}})
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "growth-job")
    tracker = DataShardTracker(64, 8, True, 0, slots=plan.workers)
    final = torch.zeros(model.layout.total)
    job = Job("growth-job", plan, spec, model, tracker, out, lambda addresses, version: final, 30.0, Clock())
    job.journal_compact_bytes = LIMIT
    for shard in range(3):
        job.register_ps(shard, f"127.0.0.1:{5000 + shard}")
        job.ps_ready(shard)
    for worker in range(2):
        job.register_worker(f"127.0.0.1:{6000 + worker}", [], "h")
    return job


def test_without_checkpoints_the_journal_and_the_tracker_stay_bounded_over_many_steps(tmp_path: Path) -> None:
    job = two_worker_job(tmp_path, 500)
    samples = job.plan.per_device_batch * job.plan.devices_per_worker
    largest = 0
    try:
        for step in range(400):
            for worker in range(2):
                data_shard = job.request_data_shard(worker, step + 1)
                job.complete_data_shard(worker, data_shard.data_shard_id)
                job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=samples, step_s=0.1))
            largest = max(largest, (tmp_path / JOURNAL_NAME).stat().st_size)
        streams = job.data_shards.snapshot()["streams"]
    finally:
        job.close()
    assert largest < LIMIT + 4_000, f"the journal reached {largest} bytes (400 steps, no checkpoint)"
    events = read_journal(tmp_path / JOURNAL_NAME)
    assert events[0]["event"] == "checkpoint" and events[0]["step"] == -1 and events[1]["event"] == "snapshot"
    assert recovery(tmp_path / JOURNAL_NAME).completed == 400
    assert max(len(refs) for _, _, refs in streams) <= 2, "the tracker kept every data shard it dispatched"


def run_with_a_dropped_worker(out: Path, limit: int) -> tuple[Job, mw.RealShards]:
    """Three workers, worker 1 dropped at step 1 (its slot adopted: the tracker rewinds streams from then on),
    100 steps with two, then a data shard held and a report of step 102 pending when the coordinator dies."""
    job, clock, shards = mw.make_job(out, min_workers=2, steps=200)
    job.journal_compact_bytes = limit
    mw.start(job)
    for role, member_id, incarnation in [("ps", 0, 0), ("ps", 1, 2), ("worker", 0, 1), ("worker", 2, 3)]:
        job.credential_issued(role, member_id, incarnation)
    mw.fail_worker_1(job, clock)
    for step in range(2, 102):
        mw.train_step(job, [0, 2], step)
    job.request_data_shard(0)
    job.report_step(StepReport(worker_id=2, step=102, loss=1.0, samples=4, step_s=0.1))
    return job, shards


def taken_back(out: Path, shards: mw.RealShards) -> Job:
    return mw.make_job(out, min_workers=2, steps=200, recovered=recovery(out / JOURNAL_NAME), shards=shards)[0]


FOLDED = ("streams", "starts", "skips", "settled")
"""How a tracker's streams were folded: a data shard completed after the fold that consumed it is still in its
worker's stream, with what was consumed of it as a skip, where a replay folds it away (the same samples to give
back either way, and the next recorded step folds both alike); where a compaction fell decides which."""


def state(job: Job, folds: bool = True) -> dict[str, object]:
    tracker = job.data_shards.snapshot()
    return {
        "status": job.status(),
        "members": job.membership.snapshot(),
        "incarnations": job.incarnations,
        "tracker": tracker if folds else {k: v for k, v in tracker.items() if k not in FOLDED},
        "reports": job.ledger.pending_reports(),
        "worker_sets": job.ledger.worker_sets(),
        "completed": job.ledger.completed,
        "records": [(r.step, r.workers, r.global_batch) for r in job.records],
    }


def test_a_job_taken_back_after_a_compaction_equals_one_taken_back_from_the_whole_journal(tmp_path: Path) -> None:
    whole, compacted = tmp_path / "whole", tmp_path / "compacted"
    first, whole_shards = run_with_a_dropped_worker(whole, 1 << 40)
    before = state(first, folds=False)["tracker"]
    first.close()
    second, compacted_shards = run_with_a_dropped_worker(compacted, LIMIT)
    second.close()
    assert read_journal(compacted / JOURNAL_NAME)[1]["event"] == "snapshot", "no compaction without a checkpoint"
    assert (compacted / JOURNAL_NAME).stat().st_size < LIMIT + 4_000 < (whole / JOURNAL_NAME).stat().st_size
    jobs = [taken_back(whole, whole_shards), taken_back(compacted, compacted_shards)]
    try:
        assert state(jobs[0], folds=False) == state(jobs[1], folds=False)
        assert state(jobs[1], folds=False)["tracker"] == before  # as the job was before its coordinator died
        assert jobs[0].ledger.completed == 102 and len(jobs[0].ledger.pending_reports()) == 1
        assert jobs[1].incarnations == {("ps", 0): 0, ("ps", 1): 2, ("worker", 0): 1, ("worker", 2): 3}
        # Both go on alike: the lost reply's retry, the pending step, and worker 1 back (a rewind of its slot).
        for job in jobs:
            assert not job.report_step(StepReport(worker_id=0, step=102, loss=1.0, samples=4, step_s=0.1)).stop
            assert job.register_worker("10.0.0.5:7000", [], "new-host") == 1
            back = job.worker_slot(1).start_step
            assert not job.rejoin_at(1, back).stop
            for step in range(103, back):
                mw.train_step(job, [0, 2], step)
            for step in range(back, back + 5):
                mw.train_step(job, [0, 1, 2], step)
        assert state(jobs[0]) == state(jobs[1])
        completed = jobs[1].data_shards.completed_ids()
        assert len(completed) == len(set(completed)), "a data shard was trained twice"
    finally:
        for job in jobs:
            job.close()


def test_with_checkpoints_commits_compact_as_before_and_a_stalled_commit_compacts_without_a_fold(
    tmp_path: Path,
) -> None:
    path = write_job(
        tmp_path / "job.yaml",
        cluster={"ps_shards": 1, "workers": 2, "devices_per_worker": 1},
        job={"steps": 200, "seed": 0},
        checkpoint={"every_steps": 5, "keep": 2},
    )
    cfg = parse_config(yaml.safe_load(path.read_text()))
    out = tmp_path / "out"
    job = build_job(cfg, out)
    job_keys(out, False)
    job.journal_compact_bytes = LIMIT
    job.register_ps(0, "127.0.0.1:5000")
    job.ps_ready(0)
    for worker in range(2):
        job.register_worker(f"127.0.0.1:{6000 + worker}", [], f"h{worker}")
    batch = job.plan.per_device_batch

    def train(steps: range) -> None:
        for step in steps:
            for worker in range(2):
                data_shard = job.request_data_shard(worker, step + 1)
                job.complete_data_shard(worker, data_shard.data_shard_id)
                job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=batch, step_s=0.1))

    def head() -> tuple[str, int]:
        first = json.loads((out / JOURNAL_NAME).read_text().splitlines()[0])
        return first["event"], first.get("step", -2)

    try:
        train(range(5))
        job.checkpoint_written(0, 5)
        assert job.checkpoint_step == 5 and head() == ("checkpoint", 5)  # the commit compacted it, as before
        train(range(5, 80))  # shard 0 confirms nothing more: no commit
        assert (out / JOURNAL_NAME).stat().st_size < LIMIT + 4_000 and head() == ("checkpoint", 5)
        assert job.data_shards.snapshot()["settled"] == 5  # not folded past the commit: checkpoints still need it
        job.checkpoint_written(0, 10)
        assert job.checkpoint_step == 10 and head() == ("checkpoint", 10)
        before = (job.ledger.completed, job.data_shards.snapshot(), job.ledger.pending_reports(), job.incarnations)
    finally:
        job.close()
    again = build_job(cfg, out, recover=True)
    try:
        assert again.recovered and again.checkpoint_step == 10
        assert (again.ledger.completed, again.data_shards.snapshot(), again.ledger.pending_reports()) == before[:3]
        assert again.incarnations == before[3] and again.status().step == 80
    finally:
        again.close()


def test_a_compaction_that_fails_fails_no_step_report_and_is_tried_again_later(tmp_path: Path, monkeypatch) -> None:
    """A compaction past the size limit ran inside the step's report: on a directory that takes no new file (full,
    out of inodes) the recorded step's report failed, and the worker exited for a step that had counted."""
    from pstrain.coordinator import journal as journal_module

    def refused(path: Path, write: object) -> None:
        raise OSError(28, "No space left on device")

    job = two_worker_job(tmp_path, 200)
    samples = job.plan.per_device_batch * job.plan.devices_per_worker
    try:
        monkeypatch.setattr(journal_module, "atomic_write", refused)
        for step in range(60):  # past the limit twice: each try fails
            for worker in range(2):
                job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=samples, step_s=0.1))
        assert job.ledger.completed == 60 and read_journal(tmp_path / JOURNAL_NAME)[0]["event"] != "checkpoint"
        monkeypatch.undo()
        for step in range(60, 120):
            for worker in range(2):
                job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=samples, step_s=0.1))
    finally:
        job.close()
    assert read_journal(tmp_path / JOURNAL_NAME)[0]["event"] == "checkpoint"  # compacted once the disk took it
    assert recovery(tmp_path / JOURNAL_NAME).completed == 120
