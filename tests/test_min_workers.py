"""cluster.min_workers (issue 11): a failed worker not replaced in time is dropped; the job goes on with fewer.

The shard's contributor set (sum and divisor from the new set, a dropped worker's push refused and
changing nothing), the pieced shard forwarding it, and the coordinator's decision with an injected
clock, real shards behind its ``set_ps_workers`` and a real data-shard tracker (every data shard
dispatched and completed once).
"""

import json
import threading

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import ConfigError, NoFreeSlot, WrongState
from pstrain.coordinator.job import GROW_AHEAD_STEPS, Job, JobState
from pstrain.coordinator.journal import JOURNAL_NAME, read_journal, recovery
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument, StepConflict
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.shard_map import ShardRange

SGD = pb.OptimizerSpec(name="sgd")
LR = pb.LrSchedule(base_lr=0.1, scaled_lr=0.3, scaling="linear")


def make_shard(workers=3, numel=4):
    return ParameterShard(0, 0, numel, torch.zeros(numel), SGD, LR, workers)


def grad(value, numel=4):
    return torch.full((numel,), float(value))


# ------------------------------------------------------------------ the shard


def test_a_dropped_worker_is_not_waited_for_and_the_sum_and_lr_follow_the_new_set():
    shard = make_shard()
    for w in range(3):
        shard.push(w, 0, grad(w + 1), 1)
    assert shard.version == 1  # step 0 had all three: mean 2, lr 0.3
    assert torch.allclose(shard.parameters()[1], torch.full((4,), -0.6))
    shard.push(0, 1, grad(1), 1)
    assert shard.set_workers(1, [0, 2], 0.2) is False  # worker 1 had not pushed step 1
    assert shard.version == 1 and shard.snapshot().workers_expected == 2
    result = shard.push(2, 1, grad(5), 1)
    assert result.completed and shard.version == 2
    assert torch.allclose(shard.parameters()[1], torch.full((4,), -0.6 - 0.2 * 3.0))  # (1 + 5) / 2 devices, lr 0.2


def test_a_push_from_a_dropped_worker_is_refused_and_changes_nothing():
    shard = ParameterShard(0, 0, 4, torch.zeros(4), pb.OptimizerSpec(name="sgd", momentum=0.9), LR, 3)
    for w in range(3):
        shard.push(w, 0, grad(1), 1)
    shard.set_workers(1, [0, 2], 0.2)
    before = shard.checkpoint_state()
    with pytest.raises(StepConflict, match="worker 1 does not contribute to step 1"):
        shard.push(1, 1, grad(7), 1)
    with pytest.raises(StepConflict, match="does not contribute"):
        shard.check_push(0, 1, 1, 1, pb.FLOAT32, 4)
    after = shard.checkpoint_state()
    assert after.version == before.version == 1 and torch.equal(after.params, before.params)
    assert shard.snapshot().pushes_waiting == 0
    assert torch.equal(after.optimizer["state"][0]["momentum_buffer"], before.optimizer["state"][0]["momentum_buffer"])


def test_a_contribution_that_arrived_before_the_drop_is_kept_and_summed_in_order():
    shard = make_shard()
    shard.push(2, 0, grad(3), 1)  # held: worker 0 has not pushed yet
    shard.push(1, 0, grad(2), 1)
    assert shard.set_workers(0, [0, 2], 0.2) is True  # worker 1 pushed step 0 before it was dropped
    assert shard.version == 0
    shard.push(0, 0, grad(1), 1)  # completes step 0 with 0, 1, 2: mean 2 at the LR it began with (0.3)
    assert shard.version == 1
    assert torch.allclose(shard.parameters()[1], torch.full((4,), -0.6))
    shard.push(0, 1, grad(1), 1)
    assert shard.push(2, 1, grad(1), 1).completed  # step 1 has workers 0 and 2 only


def test_a_drop_that_completes_the_step_in_flight_applies_it_at_once():
    shard = make_shard()
    shard.push(0, 0, grad(1), 1)
    shard.push(2, 0, grad(3), 1)
    shard.set_workers(0, [0, 2], 0.2)
    assert shard.version == 1 and torch.allclose(shard.parameters()[1], torch.full((4,), -0.4))


def test_a_change_for_a_later_step_waits_for_it_and_an_addition_must_come_before_its_step():
    shard = make_shard()
    shard.set_workers(1, [0, 1], 0.2)
    for w in range(3):
        shard.push(w, 0, grad(1), 1)  # step 0 still has all three
    assert shard.version == 1 and shard.contributors == (0, 1)
    with pytest.raises(StepConflict, match="does not contribute"):
        shard.push(2, 1, grad(1), 1)
    shard.push(0, 1, grad(1), 1)
    with pytest.raises(StepConflict, match="too late to add workers \\[2\\]"):
        shard.set_workers(1, [0, 1, 2], 0.3)  # step 1 collects pushes already
    assert shard.contributors == (0, 1)
    shard.push(1, 1, grad(1), 1)
    shard.set_workers(2, [0, 1, 2], 0.3)  # a worker back (a later registration) from a step not begun
    for w in range(2):
        assert not shard.push(w, 2, grad(1), 1).completed
    assert shard.push(2, 2, grad(1), 1).completed
    with pytest.raises(InvalidArgument, match="non-empty subset of 0..2"):
        shard.set_workers(3, [0, 3], 0.3)


def test_the_pieced_shard_forwards_the_set_and_says_which_pieces_kept_a_push():
    ranges = [ShardRange(0, 0, 2), ShardRange(0, 2, 4)]
    shard = PiecedShard.build(ranges, torch.zeros(4), SGD, LR, 3)
    shard.pieces[0].push(1, 0, grad(1, 2), 1)  # worker 1 pushed the first piece only, then died
    assert shard.set_workers(0, [0, 2], 0.2) == (False, True)
    for w in (0, 2):
        shard.push(w, 0, grad(1), 1)
    assert shard.version == 1 and [p.contributors for p in shard.pieces] == [(0, 2), (0, 2)]


# ------------------------------------------------------------------ the config


def test_min_workers_is_validated_and_defaults_to_workers():
    base = {"model": {"factory": "tests.helpers:odd_mlp"}, "data": {"factory": "tests.helpers:classification_set"}}
    assert parse_config({**base, "cluster": {"workers": 3}}).cluster.least_workers == 3
    assert parse_config({**base, "cluster": {"workers": 3, "min_workers": 2}}).cluster.least_workers == 2
    for bad in (0, 4):
        with pytest.raises(ConfigError, match="cluster.min_workers"):
            parse_config({**base, "cluster": {"workers": 3, "min_workers": bad}})
    # A sparse table's step waits for every worker's rows: a job with embeddings cannot go on with fewer.
    tables = {"embeddings": {"ids": {"rows": 100, "dim": 4}}}
    assert parse_config({**base, **tables, "cluster": {"workers": 3, "min_workers": 3}}).cluster.least_workers == 3
    with pytest.raises(ConfigError, match=r"cluster.min_workers.*sparse tables \(ids\) need every worker"):
        parse_config({**base, **tables, "cluster": {"workers": 3, "min_workers": 2}})


# ------------------------------------------------------------------ the coordinator

RAW = {
    "model": {"factory": "tests.helpers:odd_mlp"},
    "data": {"factory": "tests.helpers:classification_set", "shard_size": 4},
    "job": {"steps": 6, "seed": 0},
    "batch": {"per_device": 4},
    "cluster": {"ps_shards": 2, "workers": 3, "devices_per_worker": 1},
    "optimizer": {"name": "sgd", "lr": 0.1},
}
DATASET = 96


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class RealShards:
    """``set_ps_workers`` over real in-memory shards (one per PS address)."""

    def __init__(self, job_spec_):
        self.calls = []
        self.shards = [ParameterShard(i, 0, 4, torch.zeros(4), SGD, job_spec_.lr_schedule, 3) for i in range(2)]
        for shard in self.shards:  # at step 1, as the test's reports have it
            for w in range(3):
                shard.push(w, 0, grad(1), 1)

    def __call__(self, addresses, from_step, ids, scaled_lr):
        self.calls.append((list(addresses), from_step, list(ids), scaled_lr))
        return [(kept, kept) for kept in (s.set_workers(from_step, ids, scaled_lr) for s in self.shards)]


def make_job(tmp_path, min_workers, recovered=None, shards=None, steps=6, resume_workers=None):
    cfg = parse_config({**RAW, "job": {"steps": steps, "seed": 0}})
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "shrink-job")
    shards = shards if shards is not None else RealShards(spec)
    clock = Clock()
    tracker = DataShardTracker(DATASET, 4, True, 0, slots=3)
    job = Job(
        "shrink-job",
        plan,
        spec,
        model,
        tracker,
        tmp_path,
        lambda addresses, version: torch.zeros(model.layout.total),
        30.0,
        clock,
        replace_timeout_s=5.0,
        min_workers=min_workers,
        set_ps_workers=shards,
        recovery=recovered,
        resume_workers=resume_workers,
    )
    return job, clock, shards


def start(job):
    for i in range(2):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    return [job.register_worker(f"127.0.0.1:{6000 + i}", [], f"h{i}") for i in range(3)]


def train_step(job, workers, step):
    """Each worker takes one data shard (a step's 4 samples), reports the step, completes the data shard."""
    for w in workers:
        data_shard = job.request_data_shard(w)
        job.report_step(StepReport(worker_id=w, step=step, loss=1.0, samples=4, step_s=0.1))
        job.complete_data_shard(w, data_shard.data_shard_id)


def fail_worker_1(job, clock):
    train_step(job, [0, 1, 2], 0)
    job.request_data_shard(1)  # worker 1 holds a data shard of step 1 when it dies
    train_step(job, [0, 2], 1)
    assert job.ledger.completed == 1  # step 1 is held for worker 1
    clock.now += 31
    job.heartbeat("worker", 0)
    job.heartbeat("worker", 2)
    for i in range(2):
        job.heartbeat("ps", i)
    job.check_liveness()
    assert job.membership.vacant_slots() == [1]
    clock.now += 6  # past replace_timeout_s
    for i in range(2):
        job.heartbeat("ps", i)
    job.heartbeat("worker", 0)
    job.heartbeat("worker", 2)
    job.check_liveness()


def test_without_min_workers_a_slot_left_vacant_fails_the_job(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=None)
    start(job)
    fail_worker_1(job, clock)
    assert job.state == JobState.FAILED and "no replacement for failed worker 1" in job.message
    assert shards.calls == []


def test_a_slot_left_vacant_is_dropped_and_the_batch_and_lr_follow_the_live_workers(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2)
    start(job)
    fail_worker_1(job, clock)
    assert job.state == JobState.RUNNING
    lr_two = 0.1 * 2  # linear scaling for 2 devices
    assert shards.calls == [(["127.0.0.1:5000", "127.0.0.1:5001"], 1, [0, 2], pytest.approx(lr_two))]
    assert all(s.contributors == (0, 2) for s in shards.shards)
    assert job.ledger.completed == 2  # step 1 completed with workers 0 and 2 as soon as the set changed
    for step in range(2, 6):
        train_step(job, [0, 2], step)
    with pytest.raises(Exception, match="not among step"):
        job.ledger.add(StepReport(worker_id=1, step=job.ledger.completed, loss=1.0, samples=4, step_s=0.1))
    assert job.wait_over(10) and job.state == JobState.FINISHED
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["workers"], m["global_batch"]) for m in lines] == [(3, 12)] + [(2, 8)] * 5
    assert lines[0]["lr"] == pytest.approx(0.3) and all(m["lr"] == pytest.approx(lr_two) for m in lines[1:])
    status = job.status()
    assert status.global_batch == 8 and status.global_lr == pytest.approx(lr_two)
    # Every data shard once: slot 1 stopped after step 0 (one data shard), worker 0 took its next ones.
    completed = job.data_shards.completed_ids()
    assert len(completed) == len(set(completed)) == 3 + 2 * 5
    changed = [e for e in read_journal(tmp_path / JOURNAL_NAME) if e["event"] == "workers_changed"]
    assert changed and changed[0]["from_step"] == 1 and changed[0]["ids"] == [0, 2] and changed[0]["adopter"] == 0
    assert changed[0]["global_batch"] == 8


def test_too_few_live_workers_fail_the_job_instead(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=3)
    start(job)
    fail_worker_1(job, clock)
    assert job.state == JobState.FAILED and shards.calls == []


def test_a_restarted_coordinator_keeps_the_smaller_worker_set(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2)
    start(job)
    fail_worker_1(job, clock)
    train_step(job, [0, 2], 2)
    job.request_data_shard(0)
    job.close()
    again, _, _ = make_job(tmp_path, min_workers=2, recovered=recovery(tmp_path / JOURNAL_NAME), shards=shards)
    assert (
        again.ledger.completed == 3 and again.ledger.workers_at(3) == (0, 2) and again.ledger.workers_at(0) == (0, 1, 2)
    )
    assert again.membership.vacant_slots() == []  # the dropped slot waits for no replacement
    train_step(again, [0, 2], 3)
    assert again.ledger.completed == 4 and again.records[-1].global_batch == 8
    completed = again.data_shards.completed_ids()
    assert len(completed) == len(set(completed))


def test_a_worker_that_registers_later_takes_the_dropped_slot_back_and_scales_it_up(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2, steps=20)
    start(job)
    fail_worker_1(job, clock)
    train_step(job, [0, 2], 2)
    assert job.register_worker("10.0.0.5:7000", [], "new-host") == 1
    back = 3 + GROW_AHEAD_STEPS  # past the last recorded step: no shard can have begun it
    assert shards.calls[-1] == (["127.0.0.1:5000", "127.0.0.1:5001"], back, [0, 1, 2], pytest.approx(0.3))
    slot = job.worker_slot(1)
    assert slot.replacement and slot.start_step == back
    assert job.ledger.workers_at(back - 1) == (0, 2) and job.ledger.workers_at(back) == (0, 1, 2)
    with pytest.raises(NoFreeSlot):
        job.register_worker("10.0.0.6:7000", [], "another-host")
    assert not job.rejoin_at(1, back).stop
    for step in range(3, back):
        train_step(job, [0, 2], step)
    for step in range(back, 20):
        train_step(job, [0, 1, 2], step)
    assert job.wait_over(10) and job.state == JobState.FINISHED
    records = job.records
    assert [r.workers for r in records] == [3] + [2] * (back - 1) + [3] * (20 - back)
    assert records[-1].global_batch == 12 and records[-1].lr == pytest.approx(0.3)
    completed = job.data_shards.completed_ids()
    assert len(completed) == len(set(completed)) == 3 + 2 * (back - 1) + 3 * (20 - back)
    kinds = [e["event"] for e in read_journal(tmp_path / JOURNAL_NAME)]
    assert kinds.count("workers_changed") == 2 and "worker_returned" in kinds


def test_a_returning_worker_that_pulled_another_version_fails_the_job(tmp_path):
    job, clock, _ = make_job(tmp_path, min_workers=2, steps=20)
    start(job)
    fail_worker_1(job, clock)
    job.register_worker("10.0.0.5:7000", [], "new-host")
    assert (
        job.rejoin_at(1, 4).stop
        and job.state == JobState.FAILED
        and f"cannot join at step {2 + GROW_AHEAD_STEPS}" in job.message
    )


def test_no_worker_joins_a_job_too_close_to_its_end(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2, steps=6)
    start(job)
    fail_worker_1(job, clock)
    with pytest.raises(NoFreeSlot, match="ends before a worker could join"):
        job.register_worker("10.0.0.5:7000", [], "new-host")
    assert len(shards.calls) == 1


def test_step_reports_are_answered_only_once_the_shards_know_of_the_returning_worker(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2, steps=20)
    start(job)
    fail_worker_1(job, clock)
    entered, release = threading.Event(), threading.Event()

    def slow(addresses, from_step, ids, scaled_lr):
        entered.set()
        assert release.wait(30)
        return shards(addresses, from_step, ids, scaled_lr)

    job._set_ps_workers = slow
    joiner = threading.Thread(target=job.register_worker, args=("10.0.0.5:7000", [], "new-host"))
    joiner.start()
    assert entered.wait(30)
    answered = threading.Event()
    reporter = threading.Thread(target=lambda: (train_step(job, [0], 2), answered.set()))
    reporter.start()
    assert not answered.wait(0.5)  # held: worker 0 may not start step 3 before the shards know
    release.set()
    assert answered.wait(30)
    joiner.join(30)
    reporter.join(30)
    assert shards.calls[-1][1:3] == (2 + GROW_AHEAD_STEPS, [0, 1, 2])


def heartbeat_all(job, workers):
    for i in range(2):
        job.heartbeat("ps", i)
    for w in workers:
        job.heartbeat("worker", w)


def drop_both_1_and_2(job, clock):
    """Workers 1 and 2 fall silent after step 0 (worker 2 reported step 1); both slots are dropped."""
    train_step(job, [0, 1, 2], 0)
    train_step(job, [0, 2], 1)
    clock.now += 31
    heartbeat_all(job, [0])
    job.check_liveness()
    assert job.membership.vacant_slots() == [1, 2]
    clock.now += 6
    heartbeat_all(job, [0])
    job.check_liveness()


def test_a_drop_keeps_another_slot_that_waits_for_its_replacement_and_drops_it_in_turn(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=1)
    start(job)
    drop_both_1_and_2(job, clock)
    assert job.state == JobState.RUNNING
    # Worker 1 first: slot 2 still waited for its replacement, it stays in the set (its data its own).
    assert [call[1:3] for call in shards.calls] == [(1, [0, 2]), (2, [0])]
    assert job.ledger.workers_at(1) == (0, 2) and job.ledger.workers_at(2) == (0,)
    assert job.membership.dropped_slots() == [1, 2]
    changed = [e for e in read_journal(tmp_path / JOURNAL_NAME) if e["event"] == "workers_changed"]
    assert [(e["worker"], e["from_step"], e["ids"], e["adopter"]) for e in changed] == [
        (1, 1, [0, 2], 0),
        (2, 2, [0], 0),
    ]
    for step in range(2, 6):
        train_step(job, [0], step)
    assert job.wait_over(10) and job.state == JobState.FINISHED
    completed = job.data_shards.completed_ids()
    assert len(completed) == len(set(completed)) == 3 + 2 + 4


def test_a_drop_leaves_out_a_worker_back_from_a_later_step_until_that_step(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=1, steps=20)
    start(job)
    fail_worker_1(job, clock)
    train_step(job, [0, 2], 2)
    assert job.register_worker("10.0.0.5:7000", [], "new-host") == 1
    back = 3 + GROW_AHEAD_STEPS
    clock.now += 31  # worker 2 falls silent before worker 1 is back
    heartbeat_all(job, [0, 1])
    job.check_liveness()
    clock.now += 6
    heartbeat_all(job, [0, 1])
    job.check_liveness()
    assert job.state == JobState.RUNNING
    assert [call[1:] for call in shards.calls[-2:]] == [
        (3, [0], pytest.approx(0.1)),
        (back, [0, 1], pytest.approx(0.2)),
    ]
    assert all(s._changes[back][0] == (0, 1) for s in shards.shards)
    assert [job.ledger.workers_at(step) for step in (2, 3, back - 1, back)] == [(0, 2), (0,), (0,), (0, 1)]
    assert not job.rejoin_at(1, back).stop
    for step in range(3, back):
        train_step(job, [0], step)
    for step in range(back, 20):
        train_step(job, [0, 1], step)
    assert job.wait_over(10) and job.state == JobState.FINISHED
    assert [r.workers for r in job.records] == [3, 2, 2] + [1] * (back - 3) + [2] * (20 - back)
    completed = job.data_shards.completed_ids()
    assert len(completed) == len(set(completed))


def gated(shards):
    """``set_ps_workers`` whose first call waits for ``release`` (``entered`` says it is in flight)."""
    entered, release = threading.Event(), threading.Event()
    first = []

    def slow(addresses, from_step, ids, scaled_lr):
        if not first:
            first.append(True)
            entered.set()
            assert release.wait(30)
        return shards(addresses, from_step, ids, scaled_lr)

    return slow, entered, release


def test_no_worker_takes_a_slot_back_while_a_drop_tells_the_shards(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2, steps=20)
    start(job)
    slow, entered, release = gated(shards)
    job._set_ps_workers = slow
    dropper = threading.Thread(target=fail_worker_1, args=(job, clock))
    dropper.start()
    assert entered.wait(30)
    with pytest.raises(WrongState, match="changing its worker set"):  # retried by the member's join
        job.register_worker("10.0.0.5:7000", [], "new-host")
    release.set()
    dropper.join(30)
    assert job.ledger.workers_at(1) == (0, 2) and job.ledger.completed == 2
    assert job.register_worker("10.0.0.5:7000", [], "new-host") == 1  # the retry takes it back
    assert shards.calls[-1][1:3] == (2 + GROW_AHEAD_STEPS, [0, 1, 2])


def test_a_second_return_waits_while_the_first_one_tells_the_shards(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=1, steps=20)
    start(job)
    drop_both_1_and_2(job, clock)
    slow, entered, release = gated(shards)
    job._set_ps_workers = slow
    first = threading.Thread(target=job.register_worker, args=("10.0.0.5:7000", [], "new-host"))
    first.start()
    assert entered.wait(30)
    with pytest.raises(WrongState, match="changing its worker set"):
        job.register_worker("10.0.0.6:7000", [], "another-host")
    answered = threading.Event()
    reporter = threading.Thread(target=lambda: (train_step(job, [0], 2), answered.set()))
    reporter.start()
    assert not answered.wait(0.5)  # held until the shards know of the first return
    release.set()
    assert answered.wait(30)
    first.join(30)
    reporter.join(30)
    assert job.register_worker("10.0.0.6:7000", [], "another-host") == 2
    assert job._holding == 0 and job.ledger.workers_at(3 + GROW_AHEAD_STEPS) == (0, 1, 2)


def test_a_worker_dropped_after_pushing_part_of_a_step_rolls_the_job_back(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2)
    shards.shards[0].push(1, 1, grad(1), 1)  # worker 1 pushed step 1 to one shard only, then died
    start(job)
    fail_worker_1(job, clock)
    assert job.state == JobState.FAILED and job.failure_retryable
    assert "pushed part of step 1" in job.message
    assert not [e for e in read_journal(tmp_path / JOURNAL_NAME) if e["event"] == "workers_changed"]


def test_a_return_in_progress_survives_a_coordinator_restart(tmp_path):
    job, clock, shards = make_job(tmp_path, min_workers=2, steps=20)
    start(job)
    fail_worker_1(job, clock)
    train_step(job, [0, 2], 2)
    assert job.register_worker("10.0.0.5:7000", [], "new-host") == 1
    back = 3 + GROW_AHEAD_STEPS
    job.close()
    fresh = RealShards(job.spec)  # shards that may not have heard of the return: told again at recovery
    again, _, _ = make_job(tmp_path, min_workers=2, steps=20, recovered=recovery(tmp_path / JOURNAL_NAME), shards=fresh)
    assert [call[1:3] for call in fresh.calls] == [(back, [0, 1, 2])]
    assert again.worker_slot(1).start_step == back and again._holding == 0
    again.close()  # twice: the recovery compacted the journal, the snapshot keeps the return
    third, _, _ = make_job(tmp_path, min_workers=2, steps=20, recovered=recovery(tmp_path / JOURNAL_NAME), shards=fresh)
    assert third.worker_slot(1).start_step == back
    assert not third.rejoin_at(1, back).stop and third.state == JobState.RUNNING
    third.close()  # it trains in its slot: no return is pending any more
    fourth, _, _ = make_job(
        tmp_path, min_workers=2, steps=20, recovered=recovery(tmp_path / JOURNAL_NAME), shards=fresh
    )
    assert fourth._joining == {} and len(fresh.calls) == 2


def test_a_resumed_job_waiting_for_its_members_asks_an_extra_worker_to_retry(tmp_path):
    job, _, _ = make_job(tmp_path, min_workers=2, steps=20, resume_workers=[0, 2])
    assert [job.register_worker(f"127.0.0.1:{6000 + i}", [], f"h{i}") for i in (0, 2)] == [0, 2]
    assert job.state == JobState.WAITING
    with pytest.raises(WrongState, match="waits for its members"):  # retried, not NoFreeSlot (the worker exits)
        job.register_worker("10.0.0.5:7000", [], "new-host")


def test_the_status_reports_the_lr_of_the_smaller_set(tmp_path):
    job, clock, _ = make_job(tmp_path, min_workers=2)
    start(job)
    fail_worker_1(job, clock)
    assert job.status().lr == pytest.approx(0.2) and job.plan.lr_at(2) == pytest.approx(0.3)


# ------------------------------------------------------------------ a rollback after a shrink


class Feed:
    """One worker's data feed as ``worker/data_feed.py`` consumes it: a step's samples in dispatch order, a
    data shard completed after the step that took its last sample; every sample taken is logged."""

    def __init__(self, job, worker_id, taken):
        self.job, self.worker_id, self.taken = job, worker_id, taken
        self.queue, self.left, self.exhausted = [], {}, []

    def step(self, step, samples=4):
        while len(self.queue) < samples:
            shard = self.job.request_data_shard(self.worker_id)
            self.queue += [(shard.epoch, index, shard.data_shard_id) for index in shard.indices]
            self.left[shard.data_shard_id] = len(shard.indices)
        batch, self.queue = self.queue[:samples], self.queue[samples:]
        for epoch, index, data_shard_id in batch:
            self.taken.append((step, epoch, index))
            self.left[data_shard_id] -= 1
            if not self.left[data_shard_id]:
                self.exhausted.append(data_shard_id)

    def report(self, step):
        self.job.report_step(StepReport(worker_id=self.worker_id, step=step, loss=1.0, samples=4, step_s=0.1))
        for data_shard_id in self.exhausted:
            self.job.complete_data_shard(self.worker_id, data_shard_id)
        self.exhausted = []


def run_steps(job, feeds, steps):
    """Each step: every worker takes its samples, then reports (a worker takes the next step's data first)."""
    for step in steps:
        for feed in feeds:
            feed.step(step)
        for feed in feeds:
            feed.report(step)


def test_a_rollback_after_a_shrink_resumes_with_the_smaller_set_and_trains_every_sample_once(tmp_path):
    from pstrain.coordinator.checkpoints import committed_steps, read_manifest
    from pstrain.coordinator.main import build_job

    steps, checkpoint = 16, 4
    raw = {
        **RAW,
        "data": {**RAW["data"], "shard_size": 3},  # a step's 4 samples span data shards
        "job": {"steps": steps, "seed": 0},
        "cluster": {**RAW["cluster"], "min_workers": 2},
        "checkpoint": {"every_steps": checkpoint, "keep": 3},
        "fault": {"replace_timeout_s": 5},
    }
    cfg = parse_config(raw)
    clock = Clock()
    job = build_job(cfg, tmp_path)
    shards = RealShards(job.spec)
    job._set_ps_workers, job._clock, job.membership._clock = shards, clock, clock
    start(job)
    taken: list[tuple[int, int, int]] = []
    feeds = {w: Feed(job, w, taken) for w in range(3)}
    run_steps(job, feeds.values(), [0])
    feeds[1].step(1)  # worker 1 takes step 1's samples and dies before it pushes
    taken[:] = [t for t in taken if t[0] < 1]  # (what it took is trained by nobody)
    run_steps(job, [feeds[0], feeds[2]], [1])
    clock.now += 31
    for role, ids in (("ps", (0, 1)), ("worker", (0, 2))):
        for i in ids:
            job.heartbeat(role, i)
    job.check_liveness()
    clock.now += 6
    for role, ids in (("ps", (0, 1)), ("worker", (0, 2))):
        for i in ids:
            job.heartbeat(role, i)
    job.check_liveness()
    assert job.state == JobState.RUNNING and job.ledger.workers_at(1) == (0, 2) and job.ledger.completed == 2
    run_steps(job, [feeds[0], feeds[2]], range(2, 6))
    feeds[0].step(6)  # ahead of the checkpoint's commit: its samples are not the checkpoint's
    for shard_id in range(2):
        job.checkpoint_written(shard_id, checkpoint)
    assert committed_steps(tmp_path / "checkpoints") == [checkpoint]
    manifest = read_manifest(tmp_path / "checkpoints", checkpoint)
    assert manifest.worker_ids == [0, 2] and manifest.tracker is not None
    # A PS shard dies: the cluster rolls back to step 4; what was trained from step 4 on is lost with it.
    job.fail("PS shard 1 restarted and lost its state")
    job.close()
    taken[:] = [t for t in taken if t[0] < checkpoint]

    again = build_job(cfg, tmp_path)
    shards_again = RealShards(again.spec)
    again._set_ps_workers, again._clock, again.membership._clock = shards_again, clock, clock
    again._reachable = None  # the test's worker addresses answer nothing
    again.export._pull = lambda addresses, version: torch.zeros(again.model.layout.total)
    assert again.resume_step == checkpoint and again.ledger.workers_at(checkpoint) == (0, 2)
    assert again.membership.dropped_slots() == [1]
    for i in range(2):
        again.register_ps(i, f"127.0.0.1:{5000 + i}")
        again.ps_ready(i)
    lr_two = 0.1 * 2
    assert [call[1:] for call in shards_again.calls] == [(checkpoint, [0, 2], pytest.approx(lr_two))] * 2
    assert [again.register_worker(f"127.0.0.1:{6000 + i}", [], f"h{i}") for i in (0, 2)] == [0, 2]
    assert again.state == JobState.RUNNING
    status = again.status()
    assert status.global_batch == 8 and status.global_lr == pytest.approx(lr_two)
    feeds = {w: Feed(again, w, taken) for w in (0, 2)}
    run_steps(again, feeds.values(), range(checkpoint, 8))
    # A worker that registers now takes the dropped slot back, as it would have without the rollback.
    assert again.register_worker("10.0.0.5:7000", [], "new-host") == 1
    back = 8 + GROW_AHEAD_STEPS
    assert shards_again.calls[-1][1:3] == (back, [0, 1, 2])
    assert not again.rejoin_at(1, back).stop
    run_steps(again, feeds.values(), range(8, back))
    feeds[1] = Feed(again, 1, taken)
    run_steps(again, [feeds[0], feeds[1], feeds[2]], range(back, steps))
    assert again.wait_over(10) and again.state == JobState.FINISHED
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["workers"] for m in lines] == [3] + [2] * (back - 1) + [3] * (steps - back)
    assert [m["global_batch"] for m in lines] == [4 * m["workers"] for m in lines]
    # Every sample once per epoch: no (epoch, index) twice, and none skipped in each slot's sequence.
    pairs = [(epoch, index) for _, epoch, index in taken]
    assert len(pairs) == len(set(pairs)) == 12 + 8 * (back - 1) + 12 * (steps - back)
    order = DataShardTracker(again.data_shards.dataset_size, 3, True, 0, slots=3)
    per_epoch = order.data_shards_per_epoch
    for slot in range(3):
        sequence = []
        for data_shard_id in range(slot, 3 * per_epoch * 2, 3):
            epoch, k = divmod(data_shard_id, per_epoch)
            sequence += [(epoch, int(i)) for i in order._order(epoch)[k * 3 : (k + 1) * 3]]
        took = [i for i, pair in enumerate(sequence) if pair in set(pairs)]
        assert took == list(range(len(took))), f"slot {slot} skipped samples"
