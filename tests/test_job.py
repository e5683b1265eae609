"""The coordinator's job protocol as a plain object: a fake clock, an in-memory exporter."""

import json

import pytest
import torch

from coordinator.config import parse_config
from coordinator.data_shards import DataShardTracker
from coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from coordinator.job import Job, JobState
from coordinator.model_state import ModelState
from coordinator.plan import job_spec, make_plan
from protos import pstrain_pb2 as pb
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


def make_job(tmp_path, raw=RAW, exported=None):
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
    job = Job("test-job", plan, spec, model, DataShardTracker(16, 8, True, 0), tmp_path, exporter, 30.0, clock)
    return job, clock, calls, final


def start(job):
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    return [job.register_worker("127.0.0.1:0", [], "h") for _ in range(2)]


def report(worker, step, loss=1.0):
    return pb.StepReport(worker_id=worker, step=step, loss=loss, samples=8, step_s=0.1)


def test_membership_and_start(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    assert job.state == JobState.WAITING
    assert [(r.start, r.end) for r in job.ranges] == [(0, 25), (25, 50), (50, 74)]
    with pytest.raises(InvalidRequest, match="shards 0..2"):
        job.register_ps(3, "x:1")
    with pytest.raises(UnknownMember):
        job.initial_parameters(0)
    assert start(job) == [0, 1]
    assert job.state == JobState.RUNNING
    assert job.wait_for_cluster(1) == ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]
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


def test_watch_streams_records_then_the_final_state(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    for step in range(3):
        job.report_step(report(0, step))
        job.report_step(report(1, step))
    events = list(job.watch(1, lambda: True))
    assert [e[0].step for e in events[:-1]] == [1, 2]
    assert events[-1][0] is None and events[-1][1] == JobState.FINISHED


def test_status_counts(tmp_path):
    job, _, _, _ = make_job(tmp_path)
    start(job)
    job.request_data_shard(0)
    status = job.status()
    assert status.state == pb.RUNNING and status.global_batch == 16 and status.data_shards_doing == 1
    assert len(status.members) == 5 and all(m.alive for m in status.members)
