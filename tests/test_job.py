"""The coordinator's job protocol as a plain object: a fake clock, an in-memory exporter."""

import contextlib
import json
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.journal import read_journal
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.membership import HolderAlive
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.protos import pstrain_pb2 as pb
from tests.helpers import odd_mlp

RAW = {
    "model": {"factory": "tests.helpers:odd_mlp"},
    "data": {"factory": "tests.helpers:classification_set", "shard_size": 8},
    "job": {"steps": 3, "seed": 0},
    "batch": {"per_device": 4},
    "cluster": {"ps_shards": 3, "workers": 2, "devices_per_worker": 2},
}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_job(tmp_path, raw=RAW, exported=None, probe_for=None):
    cfg = parse_config(raw)
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "test-job")
    final = exported if exported is not None else torch.arange(model.layout.total, dtype=torch.float32)
    calls = []

    def exporter(addresses, version):
        calls.append((addresses, version))
        return final

    clock = Clock()
    probe = probe_for(model) if probe_for is not None else None
    tracker = DataShardTracker(16, 8, True, 0)
    job = Job("test-job", plan, spec, model, tracker, tmp_path, exporter, 30.0, clock, probe=probe)
    return job, clock, calls, final


def start(job):
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    return [job.register_worker(f"127.0.0.1:{6000 + i}", [], "h") for i in range(2)]


def report(worker, step, loss=1.0):
    return StepReport(worker_id=worker, step=step, loss=loss, samples=8, step_s=0.1)


def test_membership_and_start(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    assert job.state == JobState.WAITING
    assert [(r.start, r.end) for r in job.shard_ranges] == [(0, 25), (25, 50), (50, 74)]
    with pytest.raises(InvalidRequest, match="shards 0..2"):
        job.register_ps(3, "x:1")
    with pytest.raises(UnknownMember):
        job.initial_parameters(0)
    assert start(job) == [0, 1]
    assert job.state == JobState.RUNNING
    assert job.wait_for_cluster(1).ps_addresses == ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]
    assert torch.equal(job.initial_parameters(1), job.model.initial[25:50])
    with pytest.raises(NoFreeSlot, match="all 2 worker slots"):
        job.register_worker("x:1", [], "h")
    with pytest.raises(AlreadyRegistered, match="already served by 127.0.0.1:5001"):
        job.register_ps(1, "10.0.0.9:1")


def test_initial_parameters_come_from_the_seeded_factory(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    torch.manual_seed(0)
    expected = torch.cat([p.detach().reshape(-1) for p in odd_mlp().parameters()])
    assert torch.equal(job.model.initial, expected)


def test_wrong_device_count_is_rejected(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    with pytest.raises(InvalidRequest, match="needs 2 per worker"):
        job.register_worker("x:1", ["cuda:0"], "h")


def test_steps_aggregate_into_metrics_and_the_last_one_exports(tmp_path):
    job, clock, calls, final = make_job(tmp_path)
    start(job)
    with pytest.raises(UnknownMember):
        job.report_step(report(5, 0))
    with pytest.raises(WrongState, match="before step 0 completed"):
        job.report_step(report(0, 1))
    with pytest.raises(InvalidRequest, match="outside this job's steps"):
        job.report_step(report(0, 3))
    for step in range(3):
        job.report_step(report(0, step, loss=1.0))
        clock.now += 0.5
        assert len(job.records) == step
        job.report_step(report(0, step, loss=9.0))  # a retry replaces, never double counts
        directive = job.report_step(report(1, step, loss=2.0))
        assert len(job.records) == step + 1
    assert job.wait_over(10) and job.state == JobState.FINISHED and not directive.stop
    assert calls == [(["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"], 3)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert lines[1]["loss"] == pytest.approx(5.5) and lines[1]["global_batch"] == 16
    assert lines[1]["samples_per_s"] == pytest.approx(16 / 0.5) and lines[0]["lr"] == pytest.approx(0.4)
    model = odd_mlp()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), final)
    assert job.heartbeat("ps", 0).stop and job.heartbeat("worker", 1).stop
    job.close()


def test_buffers_are_checked_and_exported(tmp_path):
    raw = {**RAW, "model": {"factory": "tests.helpers:bn_mlp"}}
    job, _, _, _ = make_job(tmp_path, raw)
    start(job)
    with pytest.raises(InvalidRequest, match="no buffer 'nope'"):
        job.upload_buffers({"nope": torch.zeros(1)})
    with pytest.raises(InvalidRequest, match="buffer '1.running_mean'"):
        job.upload_buffers({"1.running_mean": torch.zeros(7)})
    mean = torch.arange(6, dtype=torch.float32)
    job.upload_buffers({"1.running_mean": mean})
    for step in range(3):
        job.report_step(report(0, step))
        job.report_step(report(1, step))
    assert job.wait_over(10) and job.state == JobState.FINISHED
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(state["1.running_mean"], mean)


def test_a_silent_member_fails_the_job(tmp_path):
    job, clock, _, _ = make_job(tmp_path)
    start(job)
    clock.now += 20
    job.heartbeat("ps", 0), job.heartbeat("ps", 1), job.heartbeat("ps", 2), job.heartbeat("worker", 0)
    clock.now += 20
    job.check_liveness()
    assert job.state == JobState.FAILED and "worker 1" in job.message and "silent for 40s" in job.message
    directive = job.heartbeat("worker", 0)
    assert directive.stop and directive.state == JobState.FAILED
    with pytest.raises(WrongState, match="FAILED"):
        job.request_data_shard(0)
    with pytest.raises(InvalidRequest, match="unknown role"):
        job.heartbeat("gpu", 0)


def test_export_failure_fails_the_job(tmp_path):
    job, _, _, _ = make_job(tmp_path, exported=torch.zeros(3))
    start(job)
    for step in range(3):
        job.report_step(report(0, step))
        job.report_step(report(1, step))
    assert job.wait_over(10) and job.state == JobState.FAILED and "export" in job.message


def test_a_job_that_failed_while_its_export_ran_stays_failed(tmp_path):
    """A job failed during EXPORTING (a member lost) was set FINISHED once the export completed: its members had
    been told it failed, and the journal recorded two ends."""
    job, _, _, final = make_job(tmp_path)
    pulling, release = threading.Event(), threading.Event()

    def slow_pull(addresses, version):
        pulling.set()
        assert release.wait(10)
        return final

    job.export._pull = slow_pull
    start(job)
    for step in range(3):
        job.report_step(report(0, step))
        job.report_step(report(1, step))
    assert pulling.wait(10) and job.state == JobState.EXPORTING
    exporting = [t for t in threading.enumerate() if t.name == "export"]
    job.fail("PS shard 1 missed its heartbeats")
    release.set()
    for thread in exporting:
        thread.join(10)
    assert (tmp_path / "model.pt").exists() and not any(t.is_alive() for t in exporting)
    job.close()
    assert job.state == JobState.FAILED and job.message == "PS shard 1 missed its heartbeats"
    ends = [e for e in read_journal(tmp_path / "journal.jsonl") if e["event"] == "job_over"]
    assert [e["state"] for e in ends] == ["FAILED"]


def test_watch_streams_records_then_the_final_state(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    for step in range(3):
        job.report_step(report(0, step))
        job.report_step(report(1, step))
    events = list(job.watch(1, lambda: True))
    assert [e.record.step for e in events[:-1]] == [1, 2]
    assert events[-1].record is None and events[-1].state == JobState.FINISHED


def test_status_counts(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    job.request_data_shard(0)
    status = job.status()
    assert status.state == pb.RUNNING and status.global_batch == 16 and status.data_shards.doing == 1
    assert len(status.members) == 5 and all(m.alive for m in status.members)


# ------------------------------------------------------------------ the master's probe (S2.1-S2.3)

from pstrain.coordinator.plan import make_plan as plan_with_batch  # noqa: E402
from pstrain.coordinator.probe import ProbeReport, ProbeSetup  # noqa: E402
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy, Probe  # noqa: E402

MiB = 1 << 20


def probing_job(tmp_path, mode=EstimateMode.FACTOR, device_bytes=100 * MiB, max_rounds=4):
    cfg = parse_config(RAW)
    replans = []
    policy = EstimatePolicy(mode, factor=1.5, increment_bytes=10 * MiB, target_utilization=0.8)

    def probe_for(model):
        def replan(batch):
            replans.append(batch)
            plan = plan_with_batch(cfg, batch)
            return plan, job_spec(cfg, plan, model.layout, "test-job", {"0": "swap"})

        return ProbeSetup(device_bytes, 0.1, policy, replan, max_rounds)

    job, _, _, _ = make_job(tmp_path, probe_for=probe_for)
    return job, replans


def probe(batch, device, host=500 * MiB, limit=0):
    return ProbeReport(0, Probe(batch, device_peak_bytes=device, host_peak_bytes=host, limit_bytes=limit))


def test_probe_gates_the_other_workers_and_shrinks_until_it_fits(tmp_path):
    job, replans = probing_job(tmp_path)
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    assert job.register_worker("a:1", [], "h") == 0
    assert job.state == JobState.PROBING
    view = job.wait_for_cluster(1, worker_id=0)
    assert view.probe and view.spec.per_device_batch == 4
    job.register_worker("b:1", [], "h")
    with pytest.raises(WrongState, match="the probe is not done"):
        job.wait_for_cluster(0.05, worker_id=1)
    with pytest.raises(WrongState, match="no probe expected from worker 1"):
        job.report_probe(ProbeReport(1, Probe(4, 0, 0)))
    outcome = job.report_probe(probe(4, device=200 * MiB))  # twice the budget: shrink
    assert not outcome.done and replans == [1] and outcome.spec.per_device_batch == 1
    assert outcome.spec.layer_policies == {"0": "swap"} and outcome.spec.global_batch == 4
    outcome = job.report_probe(probe(1, device=60 * MiB))
    assert outcome.done and job.state == JobState.RUNNING
    assert job.worker_device_bytes == 90 * MiB and job.worker_host_bytes == 750 * MiB  # factor 1.5
    view = job.wait_for_cluster(1, worker_id=1)
    assert not view.probe and view.spec.per_device_batch == 1
    assert job.status().worker_device_memory_bytes == 90 * MiB


def test_a_worker_registering_again_before_the_start_keeps_its_slot(tmp_path):
    """A worker whose process restarted (a unit's restart, at its fixed port) or whose registration's reply was lost
    registers again before the job starts: it gets its own slot back, not a second one that would leave a ghost
    (the job would then start without the real last worker, or fail when the ghost goes silent)."""
    job, clock, _, _ = make_job(tmp_path)
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    assert job.register_worker("127.0.0.1:6000", [], "hostA") == 0
    assert job.register_worker("127.0.0.1:6000", [], "hostA", proven=0) == 0  # its own process, credential in hand
    with pytest.raises(HolderAlive, match="worker 0 at 127.0.0.1:6000 .* heard from 0.0 s ago"):
        job.register_worker("127.0.0.1:6000", [], "hostA")  # no proof while worker 0 is heard from: it retries
    clock.now += 31  # a restarted process: its predecessor fell silent
    for i in range(3):
        job.heartbeat("ps", i)
    assert job.register_worker("127.0.0.1:6000", [], "hostA") == 0 and job.state == JobState.WAITING
    assert job.register_worker("127.0.0.1:6000", [], "hostB") == 1  # another host advertising the same address
    assert job.state == JobState.RUNNING
    assert [job.membership.worker(w).hostname for w in (0, 1)] == ["hostA", "hostB"]
    job.close()


def test_a_checkpoint_records_the_batch_the_probe_chose_and_a_resume_trains_at_it(tmp_path):
    """The probe shrinks the batch before the job starts: the manifests say so, and a resume from one trains at that
    batch (the one that fits the device) and positions its data there, not at the batch first planned."""
    from pstrain.coordinator.main import build_job

    raw = {
        "model": {"factory": "tests.helpers:odd_mlp"},
        "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 256}, "shard_size": 8},
        "job": {"steps": 6, "seed": 0},
        "batch": {"per_device": 16},
        "cluster": {"ps_shards": 1, "workers": 1, "devices_per_worker": 1},
        "memory": {"probe": True, "device_memory": "100MiB", "margin": 0.1},
        "checkpoint": {"every_steps": 2},
    }
    cfg = parse_config(raw)
    job = build_job(cfg, tmp_path)
    job.register_ps(0, "127.0.0.1:5000")
    job.ps_ready(0)
    job.register_worker("127.0.0.1:6000", [], "h")
    assert not job.report_probe(probe(16, device=400 * MiB, host=MiB)).done  # 4x the budget: shrink
    batch = job.plan.per_device_batch
    assert batch < 16 and job.report_probe(probe(batch, device=50 * MiB, host=MiB)).done
    for step in range(2):
        job.report_step(StepReport(0, step, 1.0, batch, 0.1))
    job.checkpoint_written(0, 2)
    manifest = json.loads((tmp_path / "checkpoints" / "manifest-000000002.json").read_text())
    assert manifest["per_worker_batch"] == batch
    job.close()
    resumed = build_job(cfg, tmp_path, recover=False)
    try:
        assert resumed.resume_step == 2 and resumed.plan.per_device_batch == batch
    finally:
        resumed.close()


def test_increment_mode(tmp_path):
    job, _ = probing_job(tmp_path, EstimateMode.INCREMENT)
    start(job)
    assert job.report_probe(probe(4, device=60 * MiB)).done
    assert job.worker_device_bytes == 70 * MiB and job.worker_host_bytes == 510 * MiB


def test_iterative_mode_raises_the_limit_until_utilisation_is_under_target(tmp_path):
    job, _ = probing_job(tmp_path, EstimateMode.ITERATIVE)
    start(job)
    first = job.report_probe(probe(4, device=60 * MiB))
    assert not first.done and first.limit_bytes == 70 * MiB
    second = job.report_probe(probe(4, device=60 * MiB, limit=70 * MiB))  # 86% > 80% target: raise
    assert not second.done and second.limit_bytes == 80 * MiB
    third = job.report_probe(probe(4, device=60 * MiB, limit=80 * MiB))  # 75%: accept
    assert third.done and job.worker_device_bytes == 80 * MiB and job.state == JobState.RUNNING


def test_a_probe_that_never_fits_fails_the_job(tmp_path):
    job, _ = probing_job(tmp_path, max_rounds=2)
    start(job)
    assert not job.report_probe(probe(4, device=200 * MiB)).done
    with pytest.raises(WrongState, match="after 2 probes"):
        job.report_probe(probe(1, device=200 * MiB))
    assert job.state == JobState.FAILED


def test_job_states_are_the_wire_enum():
    assert {s.name: int(s) for s in JobState} == {s.name: pb.JobState.Value(s.name) for s in JobState}
    assert {s for s in JobState if s.over} == {JobState.FINISHED, JobState.FAILED}


# ------------------------------------------------------------------ the parts, each on its own

import queue  # noqa: E402
from dataclasses import asdict  # noqa: E402

from pstrain.coordinator.errors import ProbeFailed  # noqa: E402
from pstrain.coordinator.export import ModelExport  # noqa: E402
from pstrain.coordinator.ledger import StepLedger, StepRecord  # noqa: E402
from pstrain.coordinator.membership import Membership  # noqa: E402
from pstrain.coordinator.probe import ProbeSession  # noqa: E402


def membership(clock):
    return Membership("j", ps_shards=2, workers=2, devices_per_worker=1, heartbeat_timeout_s=30.0, clock=clock)


def test_membership_refuses_a_second_live_registration_until_the_holder_is_silent():
    clock = Clock()
    members = membership(clock)
    members.register_ps(0, "a:1")
    members.register_ps(0, "a:1", proven=True)  # the same process again, with its current credential
    with pytest.raises(HolderAlive, match="ps shard 0 at a:1 was heard from 0.0 s ago"):
        members.register_ps(0, "a:1")  # no proof: anyone may name a:1
    clock.now += 30
    with pytest.raises(AlreadyRegistered, match="shard 0 is already served by a:1"):
        members.register_ps(0, "b:1")
    clock.now += 1  # a:1 is silent past the timeout: a restarted shard may take its id
    assert members.register_ps(0, "b:1").address == "b:1"
    members.ps_ready(0)
    assert not members.all_ps_ready() and members.missing_ps() == [1]
    with pytest.raises(UnknownMember, match="shard 1 never registered"):
        members.ps_ready(1)


def test_membership_liveness_names_the_first_silent_member_with_work_left():
    clock = Clock()
    members = membership(clock)
    members.register_ps(0, "a:1")
    assert [members.register_worker(f"w:{i}", ["cpu"], "h").id for i in range(2)] == [0, 1]
    with pytest.raises(NoFreeSlot):
        members.register_worker("w:2", [], "h")
    clock.now += 20
    members.heard_from("ps", 0)
    members.heard_from("worker", 0).done = True
    assert members.silent() is None and members.alive_count("worker") == 2
    clock.now += 20
    assert members.silent() == "worker 1 at w:1 silent for 40s"  # worker 0 is done: its silence is fine
    assert members.alive_count("ps") == 1 and members.alive_count("worker") == 1
    views = {(v.role, v.id): v for v in members.views()}
    assert views["ps", 0].alive and views["ps", 0].last_seen_s_ago == 20 and not views["worker", 1].alive
    with pytest.raises(UnknownMember, match="worker 2 is not registered in job j"):
        members.worker(2)
    with pytest.raises(UnknownMember, match="ps 1 is not registered"):
        members.heard_from("ps", 1)


def test_a_resume_keeps_the_metrics_of_the_steps_before_it_by_step_not_by_line(tmp_path):
    """metrics.jsonl lost its tail (lines are flushed, not fsynced, and the host crashed), the job resumed from a
    later checkpoint and trained on: at the next resume the records kept are one per step up to the resume, not
    the first lines of the file."""
    path = tmp_path / "metrics.jsonl"

    def train(start: int, upto: int) -> int:
        ledger = StepLedger(
            1, lambda step: 0.1, path, Clock(), threading.Condition(threading.RLock()), start_step=start
        )
        ledger.start()
        with ledger._cond:
            for step in range(start, upto):
                ledger.add(StepReport(0, step, loss=1.0, samples=4, step_s=0.1))
        completed = ledger.completed
        ledger.close()
        return completed

    train(0, 5)
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:3]))  # steps 3 and 4 lost
    assert train(10, 20) == 20  # resumed from the checkpoint of step 10
    with path.open("a") as torn:
        torn.write('{"step": 20, "lo')  # and the next crash tore a line
    assert train(12, 14) == 14
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [0, 1, 2, 10, 11, 12, 13]  # one record per step, in order; the torn line skipped
    assert train(5, 6) == 6  # a resume just after a gap: the records before it stay in the file
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 5]


def test_ledger_writes_metrics_lines_and_watch_streams_them_as_they_complete(tmp_path):
    clock, cond, phase = Clock(), threading.Condition(threading.RLock()), [JobState.RUNNING, "training"]
    ledger = StepLedger(2, lambda step: 0.1 * (step + 1), tmp_path / "metrics.jsonl", clock, cond)
    ledger.start()
    got: queue.Queue = queue.Queue()

    def watch():
        for progress in ledger.watch(0, lambda: True, lambda: tuple(phase)):
            got.put(progress)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with cond:
        assert ledger.add(StepReport(0, 0, loss=1.0, samples=4, step_s=0.1)) is None
        with pytest.raises(WrongState, match="reported step 1 before step 0 completed"):
            ledger.add(StepReport(0, 1, loss=1.0, samples=4, step_s=0.1))
        clock.now += 2
        first = ledger.add(StepReport(1, 0, loss=4.0, samples=12, step_s=0.1))
    assert first == StepRecord(step=0, loss=3.25, lr=0.1, global_batch=16, samples_per_s=8.0, step_s=2.0)
    seen = got.get(timeout=10)
    assert seen.record == first and seen.completed == 1 and seen.state == JobState.RUNNING
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [asdict(first)]  # on disk as soon as the step completes
    with cond:
        assert ledger.add(StepReport(1, 0, loss=9.0, samples=1, step_s=0.1)) is None  # a late retry: ignored
        ledger.add(StepReport(0, 1, loss=1.0, samples=8, step_s=0.1))
        clock.now += 4
        second = ledger.add(StepReport(1, 1, loss=1.0, samples=8, step_s=0.1))
        phase[:] = [JobState.FINISHED, "finished"]
        cond.notify_all()
    rest = [got.get(timeout=10), got.get(timeout=10)]
    watcher.join(10)
    assert not watcher.is_alive() and got.empty()
    assert rest[0].record == second and second.samples_per_s == 4.0 and second.lr == pytest.approx(0.2)
    assert rest[1].record is None and rest[1].completed == 2 and rest[1].state == JobState.FINISHED
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert list(ledger.watch(0, lambda: False, lambda: tuple(phase))) == []  # the watcher left
    ledger.close()


def test_export_without_an_upload_keeps_the_initial_buffers_and_raises_a_failed_pull(tmp_path):
    cfg = parse_config({**RAW, "model": {"factory": "tests.helpers:bn_mlp"}})
    model = ModelState(cfg)
    initial_mean = model.model.get_buffer("1.running_mean").clone()
    final = torch.arange(model.layout.total, dtype=torch.float32)
    pulls = []

    def pull(addresses, version):
        pulls.append((addresses, version))
        return final

    ModelExport(model, tmp_path, pull, 0.0, threading.Condition()).run(["a:1"], 7)
    assert pulls == [(["a:1"], 7)]
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(state["1.running_mean"], initial_mean)

    def broken(addresses, version):
        raise ConnectionError("shard 1 is gone")

    with pytest.raises(ConnectionError, match="shard 1 is gone"):
        ModelExport(model, tmp_path / "other", broken, 0.0, threading.Condition()).run(["a:1"], 7)
    assert not (tmp_path / "other" / "model.pt").exists()


def test_probe_session_without_a_budget_accepts_any_peak_and_judges_once():
    def replan(batch):
        raise AssertionError("no budget, no re-plan")

    session = ProbeSession(ProbeSetup(None, 0.1, EstimatePolicy(EstimateMode.FACTOR, factor=2.0), replan))
    judgement = session.judge(Probe(64, device_peak_bytes=10 * MiB, host_peak_bytes=3 * MiB))
    assert judgement.done and judgement.replanned is None and judgement.limit_bytes == 0
    assert session.worker_device_bytes == 20 * MiB and session.worker_host_bytes == 6 * MiB
    with pytest.raises(ProbeFailed, match="already accepted"):
        session.judge(Probe(64, 1, 1))


# ------------------------------------------------------------------ the servicer converts, over real gRPC

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from pstrain.coordinator.service import CoordinatorServicer  # noqa: E402
from pstrain.protos import pstrain_pb2_grpc as pb_grpc  # noqa: E402
from pstrain.runtime.transport import open_channel, start_server  # noqa: E402


@contextlib.contextmanager
def served(job: Job) -> Iterator[pb_grpc.CoordinatorStub]:
    """``job`` behind a real coordinator servicer on an ephemeral port; the job is closed with the server."""
    server = start_server(
        "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], ["Coordinator"]
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        yield pb_grpc.CoordinatorStub(channel)
    finally:
        channel.close()
        server.stop(0)
        job.close()


def test_servicer_translates_messages_and_errors(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    with served(job) as stub:
        for i in range(3):
            reply = stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=i, address=f"127.0.0.1:{5000 + i}"))
            assert (reply.start, reply.end) == (job.shard_ranges[i].start, job.shard_ranges[i].end)
            stub.ParameterServerReady(pb.PsReadyRequest(shard_id=i))
        for _ in range(2):
            stub.RegisterWorker(pb.RegisterWorkerRequest(address="127.0.0.1:0", hostname="h"))
        view = stub.WaitForCluster(pb.WaitForClusterRequest(worker_id=1), timeout=10)
        assert view.state == pb.RUNNING and list(view.ps_addresses)[0] == "127.0.0.1:5000" and not view.probe
        data_shard = stub.RequestDataShard(pb.DataShardRequest(worker_id=1))
        stub.CompleteDataShard(pb.CompleteDataShardRequest(worker_id=1, data_shard_id=data_shard.data_shard_id))
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportStep(pb.StepReport(worker_id=7, step=0, loss=1.0, samples=8, step_s=0.1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for step in range(3):
            for worker in range(2):
                directive = stub.ReportStep(pb.StepReport(worker_id=worker, step=step, loss=2.0, samples=8, step_s=0.1))
        assert directive.state in (pb.EXPORTING, pb.FINISHED) and not directive.stop
        events = list(stub.WatchProgress(pb.WatchProgressRequest(from_step=0), timeout=10))
        assert [e.step for e in events] == [0, 1, 2, 3] and events[1].loss == 2.0 and events[1].global_batch == 16
        assert events[-1].state == pb.FINISHED and events[-1].message == "finished"
        status = stub.GetJobStatus(pb.JobStatusRequest())
        assert status.state == pb.FINISHED and status.step == 3 and status.data_shards_done == 1
        assert sorted((m.role, m.id) for m in status.members) == [
            ("ps", 0),
            ("ps", 1),
            ("ps", 2),
            ("worker", 0),
            ("worker", 1),
        ]
        assert stub.Heartbeat(pb.HeartbeatRequest(role="worker", id=0)).stop


def test_waiting_for_the_cluster_ends_when_the_caller_is_gone_or_the_coordinator_stops(tmp_path):
    """A WaitForCluster handler must not outlive its caller or the process: it would hold the coordinator's
    exit after SIGTERM until the caller's deadline (600 s by default)."""
    job, _, _, _ = make_job(tmp_path)
    caller = threading.Event()
    caller.set()
    with ThreadPoolExecutor(2) as pool:
        gone = pool.submit(job.wait_for_cluster, 60.0, -1, caller.is_set)
        stopped = pool.submit(job.wait_for_cluster, 60.0)
        caller.clear()  # the caller cancelled, or the server cancelled the call after its grace period
        with pytest.raises(WrongState, match="the caller is gone"):
            gone.result(timeout=5)
        assert not stopped.done()
        job.close()  # the coordinator stops
        with pytest.raises(WrongState, match="the coordinator is stopping"):
            stopped.result(timeout=5)


def test_a_stopping_server_ends_a_pending_wait_for_the_cluster_after_its_grace(tmp_path):
    """The servicer hands the call's liveness to the job: the handler returns once the server cancels the call,
    so its thread does not keep the coordinator process alive after the grace period."""
    job, _, _, _ = make_job(tmp_path)
    waiting, left = threading.Event(), threading.Event()
    wait_for_cluster = job.wait_for_cluster

    def spied(*args, **kwargs):
        waiting.set()
        try:
            return wait_for_cluster(*args, **kwargs)
        finally:
            left.set()

    job.wait_for_cluster = spied  # type: ignore[method-assign]
    servicer = CoordinatorServicer(job)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], ["Coordinator"])
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        call = pb_grpc.CoordinatorStub(channel).WaitForCluster.future(pb.WaitForClusterRequest(), timeout=30)
        assert waiting.wait(10)
        server.stop(0.2)
        assert left.wait(5), "the handler still waits for PS shards after the server stopped"
        with pytest.raises(grpc.RpcError):
            call.result(timeout=5)
    finally:
        channel.close()
        server.stop(0)
        job.close()


def test_a_member_that_restarts_mid_job_rolls_the_cluster_back(tmp_path):
    """Under systemd a restarted PS shard (its state lost) or worker re-registers: the job fails
    retryably, every member is told so (and exits 1 for its unit to restart it), and the restarted
    coordinator resumes from the last committed checkpoint."""
    job, clock, _, _ = make_job(tmp_path)
    start(job)
    with pytest.raises(HolderAlive, match="ps shard 1 at 127.0.0.1:5001 was heard from"):
        job.register_ps(1, "127.0.0.1:5001")  # the old process may still be alive: not yet a restart
    assert job.state == JobState.RUNNING
    clock.now += 31
    with pytest.raises(WrongState, match="PS shard 1 restarted at 127.0.0.1:5001"):
        job.register_ps(1, "127.0.0.1:5001")
    assert job.state == JobState.FAILED and job.failure_retryable
    directive = job.heartbeat("worker", 0)
    assert directive.stop and directive.retryable and "last committed checkpoint" in directive.reason

    job, clock, _, _ = make_job(tmp_path / "w")
    start(job)
    clock.now += 31
    job.heartbeat("worker", 0)  # only worker 1 fell silent
    with pytest.raises(WrongState, match="worker 1 on host h restarted"):
        job.register_worker("127.0.0.1:6001", [], "h")
    assert job.heartbeat("ps", 0).retryable


def test_a_job_that_a_restart_would_not_mend_says_so(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    job.fail("non-finite loss", retryable=False)
    directive = job.heartbeat("worker", 0)
    assert directive.stop and not directive.retryable
