"""The probe session trusts nothing it did not ask for (S2.1-S2.3).

* A report must be the iteration the coordinator asked the master to run: the batch of the last verdict's
  spec, under the limit the last verdict set, with non-negative figures. Anything else is refused with
  ``InvalidRequest`` (INVALID_ARGUMENT over gRPC) and changes nothing, so the next correct report is
  judged as if the refused one had never come.
* An iterative estimate's limit never grows past the device's memory: it stops there, with a warning.
* ``memory.max_probe_rounds: N`` lets the batch shrink N times (README: "has the master probe again, at
  most N times"); the next overflow fails the job, as does an overflow at batch 1, which cannot shrink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import InvalidRequest, ProbeFailed
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import Plan, job_spec, make_plan
from pstrain.coordinator.planning import plan_job, probe_setup
from pstrain.coordinator.probe import Judgement, ProbeSession, ProbeSetup
from pstrain.coordinator.service import CoordinatorServicer
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy, IterativeEstimate, Probe
from pstrain.planner.profiler import ModelProfile
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.transport import open_channel, start_server
from tests.helpers import classification_set

MiB = 1 << 20
DEVICE = 100 * MiB
BATCH = 64
ITERATIVE = EstimatePolicy(EstimateMode.ITERATIVE, increment_bytes=40 * MiB, target_utilization=0.5, max_trials=8)
CFG = parse_config({"model": {"factory": "m:f"}, "data": {"factory": "d:f"}})


def replan(batch: int) -> tuple[Plan, pb.JobSpec]:
    """A coordinator's re-plan: the spec names the batch the master probes next."""
    return make_plan(CFG, batch), pb.JobSpec(per_device_batch=batch)


FACTOR = EstimatePolicy()


def setup(policy: EstimatePolicy = FACTOR, max_rounds: int = 4, **kwargs: object) -> ProbeSetup:
    return replace(ProbeSetup(DEVICE, 0.1, policy, replan, max_rounds, batch=BATCH), **kwargs)


# ------------------------------------------------------------------ 1. a report must be the one asked for


def first(_: ProbeSession) -> Probe:
    return Probe(BATCH, 10 * MiB, 10 * MiB)


def shrunk(session: ProbeSession) -> Probe:
    """After a probe that overflowed: the master must probe the shrunk batch, under no limit."""
    return Probe(session.expected_batch, 10 * MiB, 10 * MiB)


def trial(session: ProbeSession) -> Probe:
    """During an iterative estimate: the master must probe under the limit the last verdict set."""
    return Probe(BATCH, 30 * MiB, 10 * MiB, limit_bytes=session.expected_limit)


STAGES: dict[str, tuple[EstimatePolicy, list[Probe], Callable[[ProbeSession], Probe]]] = {
    "first": (EstimatePolicy(), [], first),
    "after a shrink": (EstimatePolicy(), [Probe(BATCH, 4 * DEVICE, 10 * MiB)], shrunk),
    "in an iterative trial": (ITERATIVE, [Probe(BATCH, 10 * MiB, 10 * MiB)], trial),
}

BAD: list[tuple[str, Callable[[Probe], Probe], str]] = [
    ("first", lambda p: replace(p, batch=63), "per_device_batch 63 is not 64, the batch the coordinator asked"),
    ("first", lambda p: replace(p, batch=0), "per_device_batch must be at least 1, got 0"),
    ("first", lambda p: replace(p, batch=-4), "per_device_batch must be at least 1, got -4"),
    ("first", lambda p: replace(p, device_peak_bytes=-1), "device_peak_bytes must be non-negative, got -1"),
    ("first", lambda p: replace(p, host_peak_bytes=-1), "host_peak_bytes must be non-negative, got -1"),
    ("first", lambda p: replace(p, limit_bytes=-1), "limit_bytes must be non-negative, got -1"),
    ("first", lambda p: replace(p, limit_bytes=MiB), "limit_bytes 1048576 is not 0, the limit the last verdict set"),
    ("after a shrink", lambda p: replace(p, batch=BATCH), "per_device_batch 64 is not "),
    ("in an iterative trial", lambda p: replace(p, limit_bytes=0), "limit_bytes 0 is not 52428800"),
    ("in an iterative trial", lambda p: replace(p, limit_bytes=p.limit_bytes + 1), "limit_bytes 52428801 is not"),
    ("in an iterative trial", lambda p: replace(p, batch=32), "per_device_batch 32 is not 64"),
]


def staged(stage: str, calls: list[int]) -> tuple[ProbeSession, Callable[[ProbeSession], Probe]]:
    """A session advanced to ``stage`` by correct reports, and the correct next report for it."""
    policy, before, correct = STAGES[stage]

    def adopt(profile: ModelProfile, worker_id: int) -> None:
        calls.append(worker_id)  # a refused report must not reach the planner either

    session = ProbeSession(setup(policy, adopt=adopt))
    for probe in before:
        session.judge(probe)
    return session, correct


def summary(judgement: Judgement, session: ProbeSession) -> tuple[object, ...]:
    spec = judgement.replanned[1] if judgement.replanned else None
    return (
        judgement.done,
        judgement.limit_bytes,
        judgement.message,
        spec,
        session.expected_batch,
        session.expected_limit,
        session.rounds,
        session.worker_device_bytes,
        session.worker_host_bytes,
    )


@pytest.mark.parametrize("stage, spoil, match", BAD, ids=[f"{s}: {m[:40]}" for s, _, m in BAD])
def test_a_report_that_is_not_the_probe_asked_for_is_refused_and_changes_nothing(stage, spoil, match):
    calls: list[int] = []
    session, correct = staged(stage, calls)
    fresh, _ = staged(stage, [])
    with_profile = replace(spoil(correct(session)), profile=ModelProfile((), 8, "cuda:0", device_total_bytes=DEVICE))
    with pytest.raises(InvalidRequest, match=match):
        session.judge(with_profile)
    assert calls == [] and session.reported_device_bytes == 0 and not session.done
    # the next correct report is judged exactly as if the refused one had never come
    assert summary(session.judge(correct(session)), session) == summary(fresh.judge(correct(fresh)), fresh)


def test_the_expected_batch_follows_every_verdict():
    session = ProbeSession(setup(ITERATIVE))
    shrink = session.judge(Probe(BATCH, 4 * DEVICE, MiB))  # overflow: shrink, probe again under no limit
    assert shrink.replanned is not None and session.expected_batch == shrink.replanned[1].per_device_batch < BATCH
    started = session.judge(Probe(session.expected_batch, 10 * MiB, MiB))
    assert (session.expected_batch, session.expected_limit) == (shrink.replanned[1].per_device_batch, 50 * MiB)
    assert not started.done and started.limit_bytes == 50 * MiB


def test_without_the_first_batch_the_first_report_needs_only_a_positive_batch():
    """``ProbeSetup.batch`` 0 (a setup that does not name the plan's batch): any batch >= 1 is taken at first."""
    session = ProbeSession(setup(batch=0))
    with pytest.raises(InvalidRequest, match="at least 1"):
        session.judge(Probe(0, MiB, MiB))
    assert session.judge(Probe(7, MiB, MiB)).done


def test_the_coordinators_probe_setup_names_the_batch_it_asks_for():
    _, _, job_plan, made = planned()
    assert made.batch == job_plan.plan.per_device_batch == BATCH


RAW = {
    "model": {"factory": "tests.helpers:odd_mlp", "kwargs": {"inputs": 64, "hidden": 256, "classes": 4}},
    "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 4096, "inputs": 64}},
    "batch": {"per_device": BATCH, "lr_scaling": "none"},
    "cluster": {"workers": 1, "devices_per_worker": ["cpu"]},
    "memory": {"probe": True, "device_memory": "1GiB", "estimate": "iterative", "increment": "64MiB"},
}


def planned():
    """The coordinator's plan and probe setup for RAW, as ``pstrain-coordinator`` makes them."""
    cfg = parse_config(RAW)
    model = ModelState(cfg)
    job_plan = plan_job(cfg, model.model, classification_set(4096, inputs=64), model.layout.total)

    def spec_for(plan: Plan, policies: dict[str, str]) -> pb.JobSpec:
        return job_spec(cfg, plan, model.layout, "job", policies)

    made = probe_setup(cfg, job_plan, spec_for)
    assert made is not None
    return cfg, model, job_plan, made


def test_a_report_that_is_not_the_probe_asked_for_is_invalid_argument_over_grpc(tmp_path):
    cfg, model, job_plan, made = planned()
    spec = job_spec(cfg, job_plan.plan, model.layout, "job", job_plan.layer_policies())
    job = Job(
        "job", job_plan.plan, spec, model, DataShardTracker(4096, 64, True, 0), tmp_path, lambda a, v: None, 30.0,
        probe=replace(made, batch=job_plan.plan.per_device_batch),
    )  # fmt: skip
    for shard in range(cfg.cluster.ps_shards):
        job.register_ps(shard, f"127.0.0.1:{5000 + shard}")
        job.ps_ready(shard)
    assert job.register_worker("127.0.0.1:6000", [], "h") == 0 and job.state == JobState.PROBING
    server = start_server(
        "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], ["Coordinator"]
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    good = pb.ProbeReport(worker_id=0, per_device_batch=BATCH, device_peak_bytes=MiB, host_peak_bytes=10 * MiB)
    bad = {
        "per_device_batch 63 is not 64": {"per_device_batch": 63},
        "per_device_batch must be at least 1, got 0": {"per_device_batch": 0},
        "device_peak_bytes must be non-negative, got -5": {"device_peak_bytes": -5},
        "limit_bytes 4096 is not 0, the limit the last verdict set (0: none)": {"limit_bytes": 4096},
    }
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        for message, fields in bad.items():
            report = pb.ProbeReport()
            report.CopyFrom(good)
            for name, value in fields.items():
                setattr(report, name, value)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ReportProbe(report, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"probe report: {message}" in refused.value.details()
            assert job.state == JobState.PROBING and job.spec == spec
        verdict = stub.ReportProbe(good, timeout=30)  # the iterative estimate's first trial, as ever
        assert not verdict.done and verdict.limit_bytes == MiB + 64 * MiB
        stale = pb.ProbeReport()
        stale.CopyFrom(good)  # a repeat of the first report, not run under the trial's limit
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportProbe(stale, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit_bytes 0 is not {65 * MiB}" in refused.value.details()
        good.limit_bytes = verdict.limit_bytes
        assert stub.ReportProbe(good, timeout=30).done and job.worker_device_bytes == 65 * MiB
    finally:
        channel.close()
        server.stop(0)
        job.close()


# ------------------------------------------------------------------ 2. the iterative limit stops at the device


def test_the_iterative_limit_never_grows_past_the_cap(caplog):
    policy = EstimatePolicy(EstimateMode.ITERATIVE, increment_bytes=10, target_utilization=0.5, max_trials=8)
    loop = IterativeEstimate(policy, actual_bytes=100, cap_bytes=125)
    limits = []
    with caplog.at_level(logging.WARNING, logger="pstrain.planner.memory_estimate"):
        limit: int | None = loop.limit
        while limit is not None:  # every trial uses the whole limit: over the target each time
            limits.append(limit)
            limit = loop.next_limit(Probe(64, limit, 0, limit_bytes=limit))
    assert limits == [110, 120] and loop.limit == 125 and loop.capped and loop.trials == 2
    assert [r.getMessage() for r in caplog.records] == [
        "iterative memory estimate: the limit reached the device's memory (125 B) after 2 trial(s); the peak "
        "120 B uses 96% of it, target 50%; accepting 125 B (lower batch.per_device for headroom, or raise "
        "memory.target_utilization)"
    ]


def run_iterative(session: ProbeSession, first_peak: int) -> list[int]:
    """Drive the estimate, every trial using its whole limit; the limits the verdicts set."""
    judgement = session.judge(Probe(BATCH, first_peak, MiB))
    limits = []
    while not judgement.done:
        limits.append(judgement.limit_bytes)
        limit = judgement.limit_bytes
        judgement = session.judge(Probe(BATCH, limit, MiB, limit_bytes=limit))
    return limits


def test_an_iterative_estimate_stops_at_the_device_and_accepts_it_with_a_warning(caplog):
    session = ProbeSession(setup(ITERATIVE))
    with caplog.at_level(logging.WARNING):
        limits = run_iterative(session, 10 * MiB)
    assert limits == [50 * MiB, 90 * MiB] and session.worker_device_bytes == DEVICE and session.done
    assert "the limit reached the device's memory (104857600 B)" in caplog.text


def test_a_first_limit_past_the_device_is_the_device_without_a_trial(caplog):
    """Peak + increment is past the device: a trial there would repeat the first probe, which had the whole device."""
    session = ProbeSession(setup(ITERATIVE))
    with caplog.at_level(logging.WARNING):
        limits = run_iterative(session, 90 * MiB)
    assert limits == [] and session.worker_device_bytes == DEVICE
    assert "after 0 trial(s); the peak 94371840 B uses 90% of it, target 50%" in caplog.text


def test_the_masters_device_caps_the_limit_when_it_is_smaller_than_the_budget():
    session = ProbeSession(setup(ITERATIVE))
    reported = ModelProfile((), 8, "cuda:0", device_total_bytes=80 * MiB)  # memory.device_memory was set too high
    judgement = session.judge(Probe(BATCH, 10 * MiB, MiB, profile=reported))
    assert judgement.limit_bytes == 50 * MiB and session.reported_device_bytes == 80 * MiB
    assert session.judge(Probe(BATCH, 50 * MiB, MiB, limit_bytes=50 * MiB)).done  # 100%: the next would be 90 MiB
    assert session.worker_device_bytes == 80 * MiB


# ------------------------------------------------------------------ 4. max_probe_rounds: N shrinks


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_max_probe_rounds_lets_the_batch_shrink_that_many_times(rounds):
    session = ProbeSession(setup(max_rounds=rounds, batch=1024))
    batch, shrinks = 1024, 0
    with pytest.raises(ProbeFailed) as failed:
        while True:
            judgement = session.judge(Probe(batch, 4 * DEVICE, MiB))  # never fits
            assert judgement.replanned is not None and not judgement.done
            batch, shrinks = judgement.replanned[1].per_device_batch, shrinks + 1
    assert shrinks == rounds
    assert f"after {rounds + 1} probes, the batch shrunk {rounds} time(s) (memory.max_probe_rounds: {rounds})" in str(
        failed.value
    )


def test_the_last_allowed_shrink_still_gets_its_probe():
    session = ProbeSession(setup(max_rounds=1))
    judgement = session.judge(Probe(BATCH, 2 * DEVICE, MiB))
    assert judgement.replanned is not None
    batch = judgement.replanned[1].per_device_batch
    assert session.judge(Probe(batch, DEVICE // 2, MiB)).done  # the shrunk batch fits: accepted


def test_an_overflow_at_batch_1_fails_at_once():
    session = ProbeSession(setup(max_rounds=10, batch=1))
    with pytest.raises(ProbeFailed, match="batch 1 still needs .* after 1 probes: not even one sample per device"):
        session.judge(Probe(1, 2 * DEVICE, MiB))
