"""``fault.on_nonfinite``: a worker's NaN/Inf step stops the job (naming step and worker) or is skipped.

The coordinator side as a plain Job and over real gRPC; then ``pstrain local`` end to end with a
dataset whose sample 24 is NaN (read at step 3, see ``job_file``).
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from pathlib import Path

import torch

from pstrain.coordinator import job as job_module
from pstrain.coordinator.job import JobState
from pstrain.coordinator.ledger import StepRecord, StepReport
from pstrain.protos import pstrain_pb2 as pb
from tests.helpers import pids_with_marker, run_local, write_job
from tests.test_job import RAW, make_job, report, served, start

STOP_MESSAGE = "worker 1 computed a non-finite loss or gradient at step 1; fault.on_nonfinite: stop"


def nonfinite(worker: int, step: int) -> StepReport:
    return StepReport(worker_id=worker, step=step, loss=math.nan, samples=8, step_s=0.1, nonfinite=True)


def strict_json(line: str) -> dict[str, object]:
    """``json.loads`` that refuses NaN and Infinity, which are not JSON."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} in metrics.jsonl is not valid JSON")

    return json.loads(line, parse_constant=refuse)


def metrics_of(out: Path) -> list[dict[str, object]]:
    return [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the coordinator's Job


def test_a_nonfinite_report_under_stop_fails_the_job_naming_step_and_worker(tmp_path):
    job, _, _, _ = make_job(tmp_path)  # no fault section: stop is the default
    assert job.spec.on_nonfinite == "stop"
    start(job)
    job.report_step(report(0, 0))
    job.report_step(report(1, 0))
    job.report_step(report(0, 1))
    directive = job.report_step(nonfinite(1, 1))
    assert directive.stop and directive.state == JobState.FAILED and directive.reason == STOP_MESSAGE
    assert job.state == JobState.FAILED and job.message == STOP_MESSAGE
    assert [r.step for r in job.records] == [0], "the non-finite step must not be recorded"
    assert job.report_step(report(0, 2)).stop and job.heartbeat("worker", 0).stop
    assert len(metrics_of(tmp_path)) == 1
    job.close()


def test_a_stop_one_step_ahead_of_a_slower_peer_records_every_step_before_it(tmp_path):
    """Worker 1 reports step 2 non-finite before worker 0's report of step 1 arrives (it pipelines):
    the stop waits for that report, so steps 0 and 1 are recorded however the reports interleave."""
    job, _, _, _ = make_job(tmp_path)
    start(job)
    for worker in (0, 1):
        job.report_step(report(worker, 0))
    job.report_step(report(1, 1))
    waiting = threading.Event()
    real_wait = job._cond.wait

    def wait(timeout: float | None = None) -> bool:
        waiting.set()  # the stop released the lock to wait for step 1
        return real_wait(timeout)

    job._cond.wait = wait
    stopped: list[object] = []
    stopper = threading.Thread(target=lambda: stopped.append(job.report_step(nonfinite(1, 2))))
    stopper.start()
    assert waiting.wait(10.0) and not job.state.over and job.ledger.completed == 1
    job.report_step(report(0, 1))
    stopper.join(timeout=30)
    assert not stopper.is_alive() and stopped[0].stop
    assert job.state == JobState.FAILED and "at step 2" in job.message
    assert [r.step for r in job.records] == [0, 1]
    assert [line["step"] for line in metrics_of(tmp_path)] == [0, 1]
    job.close()


def test_a_stop_stands_in_for_a_peer_report_that_never_comes(tmp_path, monkeypatch):
    monkeypatch.setattr(job_module, "NONFINITE_SETTLE_S", 0.2)
    job, _, _, _ = make_job(tmp_path)
    start(job)
    for worker in (0, 1):
        job.report_step(report(worker, 0))
    job.report_step(report(1, 1))
    assert job.report_step(nonfinite(1, 2)).stop
    assert job.state == JobState.FAILED and [r.step for r in job.records] == [0, 1]
    assert job.records[1].global_batch == 16  # worker 0's share was pushed (worker 1 trained on version 2)
    job.close()


def test_a_nonfinite_report_under_skip_records_a_skipped_step_and_the_job_goes_on(tmp_path):
    job, _, calls, _ = make_job(tmp_path, raw={**RAW, "fault": {"on_nonfinite": "skip"}})
    start(job)
    job.report_step(report(0, 0, loss=1.0))
    directive = job.report_step(nonfinite(1, 0))  # one worker's NaN skips the step for everyone
    assert not directive.stop and job.state == JobState.RUNNING
    assert job.records[0].skipped and math.isnan(job.records[0].loss) and job.records[0].global_batch == 16
    assert job.status().skipped_steps == 1
    for step in (1, 2):
        job.report_step(report(0, step, loss=1.0))
        job.report_step(report(1, step, loss=3.0))
    assert job.wait_over(10) and job.state == JobState.FINISHED and len(calls) == 1
    lines = metrics_of(tmp_path)
    assert lines[0]["loss"] is None and lines[0]["skipped"] is True
    assert [(m["loss"], m["skipped"]) for m in lines[1:]] == [(2.0, False), (2.0, False)]
    assert job.status().skipped_steps == 1
    job.close()


def test_a_metrics_line_reads_back_into_its_record():
    skipped = StepRecord(step=3, loss=math.nan, lr=0.1, global_batch=16, samples_per_s=5.0, step_s=0.5, skipped=True)
    line = skipped.to_json()
    assert strict_json(line)["loss"] is None
    back = StepRecord.from_json(line)
    assert back.skipped and math.isnan(back.loss) and back.step == 3
    trained = StepRecord(step=4, loss=0.25, lr=0.1, global_batch=16, samples_per_s=5.0, step_s=0.5)
    assert StepRecord.from_json(trained.to_json()) == trained


def test_the_servicer_passes_nonfinite_through_and_reports_skipped_steps(tmp_path):
    job, _, _, _ = make_job(tmp_path, raw={**RAW, "fault": {"on_nonfinite": "skip"}})
    with served(job) as stub:
        start(job)
        for worker in range(2):
            step_report = pb.StepReport(worker_id=worker, step=0, loss=math.nan, samples=8, step_s=0.1, nonfinite=True)
            assert not stub.ReportStep(step_report).stop
        for worker in range(2):
            stub.ReportStep(pb.StepReport(worker_id=worker, step=1, loss=2.0, samples=8, step_s=0.1))
        status = stub.GetJobStatus(pb.JobStatusRequest())
        assert status.step == 2 and status.skipped_steps == 1
        events = stub.WatchProgress(pb.WatchProgressRequest(from_step=0), timeout=10)
        first, second = next(events), next(events)
        events.cancel()
        assert math.isnan(first.loss) and second.loss == 2.0


# ------------------------------------------------------------------ end to end: pstrain local

NAN_STEP = 3


def job_file(tmp_path: Path, on_nonfinite: str) -> Path:
    """Two workers of one device, 8 samples a step in data shards of 4, in order: sample 24 is read at step 3."""
    return write_job(
        tmp_path / "job.yaml",
        data={
            "factory": "tests.helpers:nan_set",
            "kwargs": {"n": 48, "nan_at": 8 * NAN_STEP},
            "shard_size": 4,
            "shuffle": False,
        },
        batch={"per_device": 4, "lr_scaling": "linear"},
        cluster={"ps_shards": 2, "workers": 2, "devices_per_worker": 1},
        fault={"on_nonfinite": on_nonfinite, "max_restarts": 0},  # no restart: a failure is reported as it is
    )


def test_pstrain_local_stops_at_the_nonfinite_step_and_names_it(tmp_path):
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    result = run_local(job_file(tmp_path, "stop"), out, marker)
    assert result.returncode != 0, result.stdout[-2000:]
    named = re.search(r"worker ([01]) computed a non-finite loss or gradient at step (\d+)", result.stderr)
    assert named is not None, result.stderr[-3000:]
    assert int(named.group(2)) == NAN_STEP
    assert not (out / "model.pt").exists(), "a job stopped for a NaN must not write a model"
    assert [m["step"] for m in metrics_of(out)] == list(range(NAN_STEP))
    worker_logs = "".join(path.read_text() for path in (out / "logs").glob("worker-*.log"))
    assert "fault.on_nonfinite: stop: nothing was pushed" in worker_logs
    assert not pids_with_marker(marker)


def test_pstrain_local_skips_the_nonfinite_step_and_finishes(tmp_path):
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    result = run_local(job_file(tmp_path, "skip"), out, marker)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = metrics_of(out)
    assert [m["step"] for m in lines] == list(range(6))
    assert [m["step"] for m in lines if m["skipped"]] == [NAN_STEP]
    assert lines[NAN_STEP]["loss"] is None
    assert all(isinstance(m["loss"], float) and math.isfinite(m["loss"]) for m in lines if not m["skipped"])
    state = torch.load(out / "model.pt", weights_only=True)
    assert state and all(torch.isfinite(tensor).all() for tensor in state.values())
    worker_logs = "".join(path.read_text() for path in (out / "logs").glob("worker-*.log"))
    assert f"non-finite loss or gradient at step {NAN_STEP}; skipping the step" in worker_logs
    assert not pids_with_marker(marker)
