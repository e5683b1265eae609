"""A dead coordinator without a rollback: the restarted one takes the job back from its journal.

The unit tests rebuild a ``Job`` from the journal another ``Job`` wrote (members, credentials,
data shards, pending step reports) and check it goes on exactly where the first one was; the
end-to-end test kill -9s the coordinator of a ``pstrain local`` job mid-run: only the coordinator
is restarted, the PS shards and workers ride out the outage, and the model equals the fault-free run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import uuid

import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.journal import JOURNAL_NAME, JournalUnusable, recovery
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.main import journal_recovery
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from tests.helpers import metrics_lines, pids_with_marker, run_local, start_local, wait_for, write_job
from tests.test_chaos import child_pid
from tests.test_job import RAW, Clock

RECOVERY_RAW = {**RAW, "data": {"factory": "tests.helpers:classification_set", "shard_size": 3}, "job": {"steps": 12}}


def journaled_job(tmp_path, taken_back=None, clock=None):
    cfg = parse_config(RECOVERY_RAW)
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "recovery-job")
    tracker = DataShardTracker(37, 3, True, 5, slots=plan.workers)
    job = Job(
        "recovery-job",
        plan,
        spec,
        model,
        tracker,
        tmp_path,
        lambda addresses, version: torch.zeros(model.layout.total),
        30.0,
        clock or Clock(),
        recovery=taken_back,
    )
    return job


def report(worker, step):
    return StepReport(worker_id=worker, step=step, loss=0.5 + step + worker, samples=8, step_s=0.1)


def run_until_crash(job):
    """Register everyone, train 3 steps with data shards, leave step 3 half reported and a shard held."""
    for shard in range(3):
        job.register_ps(shard, f"127.0.0.1:{5000 + shard}")
        job.credential_issued("ps", shard, 0)
        job.ps_ready(shard)
    for w in range(2):
        assert job.register_worker(f"127.0.0.1:{6000 + w}", [], "h") == w
        job.credential_issued("worker", w, 1)  # a second registration of the slot
    assert job.state == JobState.RUNNING
    seq = {0: 0, 1: 0}
    for step in range(3):
        for w in range(2):
            seq[w] += 1
            shard = job.request_data_shard(w, seq[w])
            job.complete_data_shard(w, shard.data_shard_id)
            job.report_step(report(w, step))
    seq[0] += 1
    held = job.request_data_shard(0, seq[0])  # its reply is "lost": worker 0 asks again after the restart
    job.report_step(report(1, 3))  # pending: worker 0 has not reported step 3
    return held, seq


def test_a_restarted_coordinator_takes_the_job_back_where_it_was(tmp_path):
    first = journaled_job(tmp_path)
    held, seq = run_until_crash(first)
    expected_next = first.data_shards.snapshot()
    # the first coordinator dies here (no close: a kill -9 flushes nothing more)
    taken_back = recovery(tmp_path / JOURNAL_NAME)
    assert taken_back.job_id == "recovery-job" and taken_back.completed == 3
    assert taken_back.incarnations == {("ps", 0): 0, ("ps", 1): 0, ("ps", 2): 0, ("worker", 0): 1, ("worker", 1): 1}
    second = journaled_job(tmp_path, taken_back)
    assert second.recovered and second.state == JobState.RUNNING
    assert second.status().message.startswith("recovering")
    for role, member_id in [("ps", 0), ("ps", 1), ("ps", 2), ("worker", 0), ("worker", 1)]:
        assert second.heartbeat(role, member_id).stop is False  # re-admitted, not NOT_FOUND
    assert second.status().message == "training"  # every member reattached: the recovery is over
    assert second.ledger.completed == 3
    assert second.data_shards.snapshot() == expected_next
    assert second.membership.all_ps_ready() and second.membership.ps_addresses()[2] == "127.0.0.1:5002"
    assert second.request_data_shard(0, seq[0]) == held  # the retry of the lost reply: the same data shard
    assert second.request_data_shard(1, seq[1] + 1) == first.request_data_shard(1, seq[1] + 1)
    assert second.report_step(report(0, 3)).stop is False  # worker 1's pending report of step 3 was kept
    assert second.ledger.completed == 4
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]  # every step once
    assert lines[3]["loss"] == (0.5 + 3 + 0.5 + 3 + 1) / 2


def test_the_reattach_window_opens_when_the_restarted_coordinator_serves(tmp_path):
    """Reading the journal, loading the model and starting the server can take longer than the
    heartbeat timeout on a loaded host: that time must not count against the members."""
    run_until_crash(journaled_job(tmp_path))
    clock = Clock()
    second = journaled_job(tmp_path, recovery(tmp_path / JOURNAL_NAME), clock)
    clock.now += 31.0  # the heartbeat timeout (30 s) passed before the server answered
    second.serving()
    second.check_liveness()
    assert second.state == JobState.RUNNING and second.status().message.startswith("recovering")
    for _ in range(2):  # worker 1 never comes back: silent past the window, the others heard from
        clock.now += 20.0
        for role, member_id in [("ps", 0), ("ps", 1), ("ps", 2), ("worker", 0)]:
            second.heartbeat(role, member_id)
        second.check_liveness()
    assert second.state == JobState.FAILED and "worker 1" in second.status().message


def test_the_journal_survives_compaction_and_a_finished_job_is_not_taken_back(tmp_path):
    first = journaled_job(tmp_path)
    held, seq = run_until_crash(first)
    with first._cond:
        first._compact()  # what a committed checkpoint does: one snapshot line after the checkpoint line
    assert [e for e in json.loads("[" + ",".join((tmp_path / JOURNAL_NAME).read_text().splitlines()) + "]")][1][
        "event"
    ] == "snapshot"
    second = journaled_job(tmp_path, recovery(tmp_path / JOURNAL_NAME))
    assert second.request_data_shard(0, seq[0]) == held
    assert second.ledger.completed == 3 and second.report_step(report(0, 3)) is not None
    assert second.ledger.completed == 4
    second.fail("stopped")
    try:
        recovery(tmp_path / JOURNAL_NAME)
    except JournalUnusable as exc:
        assert "over" in str(exc)
    else:
        raise AssertionError("a job that is over was taken back")


STEPS = 30


def recovery_job(path):
    return write_job(
        path,
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": 37}, "shard_size": 3},
        job={"steps": STEPS, "seed": 11},
        checkpoint={"every_steps": 4, "keep": 2},  # commits compact the journal mid-run
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 10.0},
        fault={"max_restarts": 2, "restart_backoff_s": 0.2, "replace_timeout_s": 60.0, "coordinator_timeout_s": 60.0},
    )


def test_pstrain_local_restarts_only_a_killed_coordinator_and_the_job_goes_on_without_a_rollback(tmp_path):
    reference_out = tmp_path / "reference"
    done = run_local(recovery_job(tmp_path / "job.yaml"), reference_out, uuid.uuid4().hex)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = torch.load(reference_out / "model.pt", weights_only=True)

    out = tmp_path / "out"
    marker = uuid.uuid4().hex
    kill_after = random.Random("coordinator").randrange(5, STEPS - 10)
    proc = start_local(recovery_job(tmp_path / "job.yaml"), out, marker)
    try:
        wait_for(lambda: metrics_lines(out) >= kill_after, 120, f"{kill_after} steps")
        coordinator = child_pid(marker, "pstrain.coordinator")
        members = set(pids_with_marker(marker)) - {coordinator}  # the launcher, the PS shards, the workers
        os.kill(coordinator, signal.SIGKILL)
        wait_for(lambda: metrics_lines(out) >= kill_after + 3, 120, "training to go on after the restart")
        assert members <= set(pids_with_marker(marker))  # the same processes: none was restarted
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "the coordinator was killed (signal 9); restarting it alone" in stderr
    assert "restarting the cluster" not in stderr and "restarting it alone to take its slot back" not in stderr
    coordinator_log = (out / "logs" / "coordinator.log").read_text()
    assert "recovered job" in coordinator_log and "resuming from the committed checkpoint" not in coordinator_log
    for shard in range(3):  # each PS shard started once (its log appends across restarts)
        assert (out / "logs" / f"ps-{shard}.log").read_text().count("listening on") == 1
    state = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))  # every step once, in order
    wait_for(lambda: not pids_with_marker(marker), 30, "every child to be gone")


def test_a_journal_that_disagrees_or_has_no_key_is_not_taken_back(tmp_path):
    first = journaled_job(tmp_path)
    run_until_crash(first)
    assert journal_recovery(tmp_path) is None  # no job.key: the members' credentials could not be checked
    path = tmp_path / JOURNAL_NAME
    events = [json.loads(line) for line in path.read_text().splitlines()]
    dispatched = next(e for e in events if e["event"] == "data_shard_dispatched")
    dispatched["data_shard"] += 1000  # a journal that does not match what the tracker does
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    try:
        journaled_job(tmp_path, recovery(path))
    except JournalUnusable as exc:
        assert "dispatched data shard" in str(exc)
    else:
        raise AssertionError("a journal that disagrees with the tracker was taken back")
