"""S2.5: a dead worker is replaced in place; the step waits for it and nobody rolls back.

Protocol cases run on a plain ``Job`` with a fake clock; the end-to-end case kills a worker of a
real ``pstrain local`` cluster and checks the model against a fault-free run, the journal's
record of the replacement, and that no data shard was completed twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import uuid
from collections import Counter

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import NoFreeSlot, WrongState
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.journal import read_journal
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.coordinator.service import address_answers
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.security import INSECURE
from pstrain.runtime.transport import start_server
from pstrain.worker.service import WorkerServicer
from tests.helpers import metrics_lines, pids_with_marker, run_local, start_local, wait_for, write_job
from tests.test_chaos import child_pid
from tests.test_job import RAW, Clock

SAMPLES_PER_WORKER = 8  # RAW: 4 per device x 2 devices


def replacing_job(tmp_path, reachable=None, replace_timeout_s=30.0):
    cfg = parse_config(RAW)
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "test-job")
    clock = Clock()
    tracker = DataShardTracker(64, 8, True, 0, slots=2)
    job = Job(
        "test-job",
        plan,
        spec,
        model,
        tracker,
        tmp_path,
        lambda addresses, version: torch.zeros(model.layout.total),
        30.0,
        clock,
        replace_timeout_s=replace_timeout_s,
        reachable=reachable,
    )
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    for i in range(2):
        job.register_worker(f"127.0.0.1:{6000 + i}", ["cpu", "cpu"], "h")
    assert job.state == JobState.RUNNING
    return job, clock, tracker


def report(worker, step, loss=1.0):
    return StepReport(worker_id=worker, step=step, loss=loss, samples=SAMPLES_PER_WORKER, step_s=0.1)


def test_a_silent_worker_is_vacated_the_step_held_and_its_replacement_redoes_it(tmp_path):
    job, clock, tracker = replacing_job(tmp_path)
    for w in range(2):  # step 0: one data shard of 8 samples each
        job.complete_data_shard(w, job.request_data_shard(w).data_shard_id)
        job.report_step(report(w, 0))
    first = job.request_data_shard(1)  # worker 1 holds step 1's data shard when it dies
    job.report_step(report(0, 1))  # worker 0 is done with step 1; worker 1 dies before reporting it
    clock.now += 20
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    clock.now += 20
    job.check_liveness()
    assert job.state == JobState.RUNNING and job.ledger.completed == 1  # held, not failed
    assert tracker.outstanding(1) == [] and tracker.counts().todo >= 1  # its data shard was requeued
    assert job.heartbeat("worker", 1).stop  # the cut-off process is told to restart and rejoin
    replacement = job.register_worker("10.0.0.9:7000", [], "other-host")
    assert replacement == 1
    slot = job.worker_slot(1)
    assert slot.replacement and slot.devices == ["cpu", "cpu"] and slot.start_step == 1
    assert not job.rejoin_at(1, 1).stop
    again = job.request_data_shard(1)
    assert again.data_shard_id == first.data_shard_id  # the same samples as the fault-free run
    record = job.report_step(report(1, 1))
    assert not record.stop and job.ledger.completed == 2
    events = [e["event"] for e in read_journal(tmp_path / "journal.jsonl")]
    assert events.count("worker_failed") == 1 and "worker_rejoined" in events
    job.close()


def test_a_replacement_for_a_worker_that_pushed_but_never_reported_stands_in_for_its_report(tmp_path):
    job, clock, _ = replacing_job(tmp_path)
    job.report_step(report(0, 0, loss=2.0))
    clock.now += 31  # worker 1 died: silent past the heartbeat timeout (a live one's address is no restart)
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    job.register_worker("127.0.0.1:6001", [], "h")  # worker 1 restarted at its own address
    assert job.worker_slot(1).start_step == 0
    assert not job.rejoin_at(1, 1).stop  # it pulled version 1: its dead predecessor had pushed step 0
    assert job.ledger.completed == 1 and job.records[0].loss == 2.0 and job.records[0].global_batch == 16
    job.close()


def test_a_replacement_that_rejoins_after_the_last_step_is_done_and_its_silence_fails_nothing(tmp_path):
    """Its predecessor pushed the last step everywhere and died before reporting it: the replacement pulls version
    ``steps``, has nothing to train and exits. The export may take longer than a heartbeat timeout; the job ends
    FINISHED, not FAILED for the replacement's silence."""
    job, clock, _ = replacing_job(tmp_path)
    last = job.plan.steps - 1
    for step in range(last):
        job.report_step(report(0, step)), job.report_step(report(1, step))
    job.report_step(report(0, last))  # worker 1 pushed the last step, then died before reporting it
    clock.now += 31
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    job.check_liveness()
    assert job.membership.worker(1).failed
    replacement = job.register_worker("10.0.0.9:7000", [], "other-host")
    assert not job.rejoin_at(replacement, job.plan.steps).stop
    assert job.state == JobState.EXPORTING and job.membership.worker(replacement).done
    clock.now += 31  # the export is slow; the replacement has exited
    [job.heartbeat("ps", i) for i in range(3)]
    job.check_liveness()
    assert job.state in (JobState.EXPORTING, JobState.FINISHED), job.message
    assert job.wait_over(30) and job.state == JobState.FINISHED
    job.close()


def test_replacement_when_every_slot_is_taken_probes_the_holders(tmp_path):
    probed = []

    def reachable(address):
        probed.append(address)
        return address != "127.0.0.1:6001"

    job, _, _ = replacing_job(tmp_path, reachable)
    assert job.register_worker("127.0.0.1:7777", [], "h2") == 1
    assert probed == ["127.0.0.1:6000", "127.0.0.1:6001"]
    with pytest.raises(NoFreeSlot):
        job.register_worker("127.0.0.1:7778", [], "h3")  # everyone answers now
    job.close()


def test_shards_at_different_versions_or_no_replacement_in_time_roll_back(tmp_path):
    job, clock, _ = replacing_job(tmp_path / "a")
    clock.now += 31  # worker 1 died: silent past the heartbeat timeout
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    job.register_worker("127.0.0.1:6001", [], "h")  # and restarted at its own address
    directive = job.rejoin_at(1, -1, "shards returned different versions [3, 4]")
    assert directive.stop and directive.retryable and job.state == JobState.FAILED
    job.close()

    job, clock, _ = replacing_job(tmp_path / "b", replace_timeout_s=5.0)
    clock.now += 31
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    job.check_liveness()
    assert job.state == JobState.RUNNING
    clock.now += 6
    job.heartbeat("worker", 0), [job.heartbeat("ps", i) for i in range(3)]
    job.check_liveness()
    assert job.state == JobState.FAILED and "no replacement for failed worker 1" in job.message
    assert job.failure_retryable
    job.close()


def test_reposition_puts_a_slot_where_an_uninterrupted_run_is():
    for step in range(0, 12):
        reference = DataShardTracker(37, 3, True, 5, slots=2)
        reference.resume(step, SAMPLES_PER_WORKER)
        tracker = DataShardTracker(37, 3, True, 5, slots=2)
        held = [tracker.dispatch(1) for _ in range(random.Random(step).randrange(0, 6))]
        for data_shard in held[: len(held) // 2]:
            tracker.complete(1, data_shard.data_shard_id)
        tracker.reposition(1, step, SAMPLES_PER_WORKER)
        for _ in range(5):
            assert tracker.dispatch(1) == reference.dispatch(1)
        assert len(set(tracker.completed_ids())) == len(tracker.completed_ids())


def test_reposition_counts_done_the_data_shards_a_failed_worker_pushed_but_never_completed():
    """The failed worker pushed the step that exhausted a data shard and died before completing it; the
    coordinator requeued its data shards when it declared it failed, before the replacement rejoined."""
    for step in range(1, 12):
        for completed_upto in range(step + 1):
            tracker = DataShardTracker(37, 3, True, 5, slots=2)
            consumed, held = 0, []
            while consumed < (step + 1) * SAMPLES_PER_WORKER:  # up to the step it died in
                data_shard = tracker.dispatch(1)
                held.append((data_shard.data_shard_id, consumed + len(data_shard.indices)))
                consumed += len(data_shard.indices)
            for data_shard_id, end in held:  # completed after the push of each step, up to ``completed_upto``
                if end <= completed_upto * SAMPLES_PER_WORKER:
                    tracker.complete(1, data_shard_id)
            tracker.requeue(1)
            tracker.reposition(1, step, SAMPLES_PER_WORKER)
            behind = [data_shard_id for data_shard_id, end in held if end <= step * SAMPLES_PER_WORKER]
            assert sorted(tracker.completed_ids()) == sorted(behind), (step, completed_upto)


STEPS = 24


def replacement_job(path):
    return write_job(
        path,
        # Paced: 8 samples x 20 ms a step per worker, so the kill lands while the job still runs.
        data={"factory": "tests.helpers:PacedDataset", "kwargs": {"n": 37, "sample_s": 0.02}, "shard_size": 3},
        job={"steps": STEPS, "seed": 11},
        checkpoint={"every_steps": 0},  # no checkpoint compacts the journal: it keeps the whole run's ledger
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 5.0},
        fault={"max_restarts": 2, "replace_timeout_s": 60.0},
    )


def test_pstrain_local_restarts_only_a_killed_worker_and_the_model_equals_the_fault_free_run(tmp_path):
    reference_out = tmp_path / "reference"
    marker = uuid.uuid4().hex
    done = run_local(replacement_job(tmp_path / "job.yaml"), reference_out, marker)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = torch.load(reference_out / "model.pt", weights_only=True)

    out = tmp_path / "out"
    marker = uuid.uuid4().hex
    kill_after = random.Random("replacement").randrange(4, STEPS - 6)
    proc = start_local(replacement_job(tmp_path / "job.yaml"), out, marker)
    try:
        wait_for(lambda: metrics_lines(out) >= kill_after, 120, f"{kill_after} steps")
        coordinator = child_pid(marker, "pstrain.coordinator")
        os.kill(child_pid(marker, "pstrain.worker"), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "exited with code -9; restarting it alone" in stderr, stderr[-3000:]
    assert "restarting the cluster" not in stderr, stderr[-3000:]
    assert coordinator not in pids_with_marker(marker)  # it finished: the same process ran the whole job
    state = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    events = read_journal(out / "journal.jsonl")
    kinds = Counter(e["event"] for e in events)
    assert kinds["worker_failed"] == 1 and kinds["worker_rejoined"] == 1, kinds
    completed = [e["data_shard"] for e in events if e["event"] == "data_shard_completed"]
    completed += [d for e in events if e["event"] == "worker_rejoined" for d in e["data_shards_done"]]
    assert len(completed) == len(set(completed))  # no data shard trained twice
    reference_completed = [
        e["data_shard"] for e in read_journal(reference_out / "journal.jsonl") if e["event"] == "data_shard_completed"
    ]
    assert sorted(completed) == sorted(reference_completed)  # and the same ones as the fault-free run
    wait_for(lambda: not pids_with_marker(marker), 30, "every child to be gone")


def test_a_worker_may_report_one_step_ahead_of_a_slower_peer(tmp_path):
    """A worker that overlaps its next pull reports step t + 1 before a slower peer's report of t arrives."""
    job, _, _ = replacing_job(tmp_path)
    job.report_step(report(0, 0))
    job.report_step(report(0, 1))  # pending behind step 0
    with pytest.raises(WrongState, match="reported step 2 before step 0 completed"):
        job.report_step(report(0, 2))
    job.report_step(report(1, 0))
    assert job.ledger.completed == 1
    job.report_step(report(1, 1))
    assert [r.step for r in job.records] == [0, 1]
    job.close()


def test_a_worker_address_that_refuses_the_connection_is_gone_and_a_serving_one_is_not():
    live = start_server("127.0.0.1:0", [(pb_grpc.add_WorkerServicer_to_server, WorkerServicer(["cpu"]))], ["Worker"])
    dead = start_server("127.0.0.1:0", [(pb_grpc.add_WorkerServicer_to_server, WorkerServicer(["cpu"]))], ["Worker"])
    dead.stop(0)
    try:
        answers = address_answers(INSECURE)
        assert answers(f"127.0.0.1:{live.port}")
        assert not answers(f"127.0.0.1:{dead.port}")
    finally:
        live.stop(0)
