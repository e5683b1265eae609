"""The coordinator's job protocol as a plain object: a fake clock, an in-memory exporter."""

import json

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.coordinator.job import Job, JobState
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
    assert job.wait_for_cluster(1)[0] == ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]
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


# ------------------------------------------------------------------ the master's probe (S2.1-S2.3)

from pstrain.coordinator.job import ProbeSetup  # noqa: E402
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy  # noqa: E402
from pstrain.coordinator.plan import make_plan as plan_with_batch  # noqa: E402

MiB = 1 << 20


def probing_job(tmp_path, mode=EstimateMode.FACTOR, device_bytes=100 * MiB, max_rounds=4):
    job, clock, calls, final = make_job(tmp_path)
    cfg = parse_config(RAW)
    replans = []

    def replan(batch):
        replans.append(batch)
        plan = plan_with_batch(cfg, batch)
        return plan, job_spec(cfg, plan, job.model.layout, "test-job", {"0": "swap"})

    policy = EstimatePolicy(mode, factor=1.5, increment_bytes=10 * MiB, target_utilization=0.8)
    job._probe = ProbeSetup(device_bytes, 0.1, policy, replan, max_rounds)
    job._probe_done = False
    return job, replans


def probe(batch, device, host=500 * MiB, limit=0):
    return pb.ProbeReport(
        worker_id=0, per_device_batch=batch, device_peak_bytes=device, host_peak_bytes=host, limit_bytes=limit
    )


def test_probe_gates_the_other_workers_and_shrinks_until_it_fits(tmp_path):
    job, replans = probing_job(tmp_path)
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    assert job.register_worker("a:1", [], "h") == 0
    assert job.state == JobState.PROBING
    addresses, spec, must_probe = job.wait_for_cluster(1, worker_id=0)
    assert must_probe and spec.per_device_batch == 4
    job.register_worker("b:1", [], "h")
    with pytest.raises(WrongState, match="the probe is not done"):
        job.wait_for_cluster(0.05, worker_id=1)
    with pytest.raises(WrongState, match="no probe expected from worker 1"):
        job.report_probe(pb.ProbeReport(worker_id=1))
    outcome = job.report_probe(probe(4, device=200 * MiB))  # twice the budget: shrink
    assert not outcome.done and replans == [1] and outcome.spec.per_device_batch == 1
    assert outcome.spec.layer_policies == {"0": "swap"} and outcome.spec.global_batch == 4
    outcome = job.report_probe(probe(1, device=60 * MiB))
    assert outcome.done and job.state == JobState.RUNNING
    assert job.worker_device_bytes == 90 * MiB and job.worker_host_bytes == 750 * MiB  # factor 1.5
    _, spec, must_probe = job.wait_for_cluster(1, worker_id=1)
    assert not must_probe and spec.per_device_batch == 1
    assert job.status().worker_device_memory_bytes == 90 * MiB


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
