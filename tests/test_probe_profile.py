"""Plans measured where they run (issue 10): the master's device profile replaces the coordinator's.

With ``memory.probe: true`` worker 0 profiles the model per layer on its device with the planner's
profiler and sends it with its first probe report; the coordinator re-plans from it (swap/recompute
decisions, an auto batch) and the spec names the profile it was made from. On CPU stand-ins the
same path runs with a CPU "device" profile.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import grpc
import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import InvalidRequest
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec
from pstrain.coordinator.planning import ProbePlanner, describe, plan_job, probe_setup
from pstrain.coordinator.probe import ProbeSession
from pstrain.coordinator.service import CoordinatorServicer, _probe_report
from pstrain.planner.memory_estimate import Probe
from pstrain.planner.profile_wire import profile_from_pb, profile_to_pb
from pstrain.planner.profiler import LayerInput, ModelProfile
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.transport import open_channel, start_server
from pstrain.worker.probe import device_profile
from tests.helpers import classification_set, pids_with_marker, run_local, write_job

MiB = 1 << 20
CE = torch.nn.functional.cross_entropy

RAW = {
    "model": {"factory": "tests.helpers:odd_mlp", "kwargs": {"inputs": 64, "hidden": 256, "classes": 4}},
    "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 4096, "inputs": 64}},
    "batch": {"per_device": 64, "lr_scaling": "none"},
    "cluster": {"workers": 1, "devices_per_worker": ["cpu"]},  # a stand-in on any host: budgets come from the tests
}


BLOCKED = {"factory": "tests.helpers:blocked_mlp", "kwargs": {"inputs": 64, "hidden": 128, "classes": 4}}


def setup_for(memory: dict[str, object], batch: object = 64, model: dict[str, object] | None = None):
    raw = {**RAW, "model": model or RAW["model"]}
    cfg = parse_config({**raw, "batch": {"per_device": batch, "lr_scaling": "none"}, "memory": memory})
    model = ModelState(cfg)
    job_plan = plan_job(cfg, model.model, classification_set(4096, inputs=64), model.layout.total)

    def spec_for(plan, policies):
        return job_spec(cfg, plan, model.layout, "job", policies)

    return cfg, job_plan, probe_setup(cfg, job_plan, spec_for)


def timed(profile: ModelProfile, forward_s: float, backward_s: float, device: str = "cuda:0") -> ModelProfile:
    """The coordinator's profile with other layer times, as a faster or slower device would measure them."""
    layers = tuple(replace(la, forward_s=forward_s, backward_s=backward_s) for la in profile.layers)
    return replace(profile, layers=layers, device=device, device_total_bytes=0)


# Device memory this small, the 64-batch plan must swap or recompute the layers that save activations.
TIGHT = {"probe": True, "device_memory": "200KiB", "bandwidth": "1GB/s", "policy": "auto"}


def test_the_profile_survives_the_wire():
    _, job_plan, _ = setup_for(TIGHT)
    assert job_plan.profile is not None
    profile = replace(
        job_plan.profile,
        device="cuda:3",
        device_total_bytes=80 << 30,
        unprofiled_param_bytes=768,
        unprofiled_saved_per_sample=2112.0,
        unprofiled_saved_fixed=64.0,
    )
    assert any(i.saved_by and i.saved_here for la in profile.layers for i in la.inputs)  # a Linear after a ReLU
    message = pb.ProbeReport(worker_id=0, per_device_batch=64, profile=profile_to_pb(profile))
    assert profile_from_pb(pb.ProbeReport.FromString(message.SerializeToString()).profile) == profile
    assert _probe_report(message).probe.profile == profile  # the servicer hands it to the session
    assert _probe_report(pb.ProbeReport(worker_id=0, per_device_batch=64)).probe.profile is None


@pytest.mark.parametrize(
    "forward_s, backward_s, chosen",
    [
        (10.0, 10.0, "swap"),  # slow compute: every copy hides behind it, recomputing would cost seconds
        (1e-9, 1e-9, "recompute"),  # fast compute: no copy can hide, recomputing is nearly free
    ],
)
def test_the_decisions_follow_the_reported_times(forward_s, backward_s, chosen):
    # Blocks: recomputing one frees what it saves inside; a lone Linear or Tanh would free nothing.
    _, job_plan, setup = setup_for({**TIGHT, "blocks": ["0", "1"]}, model=BLOCKED)
    assert setup is not None and job_plan.profile is not None
    session = ProbeSession(setup)
    reported = timed(job_plan.profile, forward_s, backward_s)
    judgement = session.judge(Probe(64, 100 * 1024, 10 * MiB, profile=reported))
    assert judgement.replanned is not None
    _, spec = judgement.replanned
    assert spec.memory_profile == "cuda:0 on worker 0 (probe)" and session.profile_source == spec.memory_profile
    changed = {name: p for name, p in spec.layer_policies.items()}
    assert changed and set(changed.values()) == {chosen}
    if dict(spec.layer_policies) != job_plan.layer_policies():
        assert not judgement.done and "re-planned from the cuda:0 on worker 0 (probe) profile" in judgement.message
        judgement = session.judge(Probe(64, 100 * 1024, 10 * MiB))  # the probe again, under the new plan
    assert judgement.done


def test_an_unchanged_plan_is_judged_at_once_and_still_names_its_profile():
    _, job_plan, setup = setup_for({"probe": True, "device_memory": "1GiB"})
    assert setup is not None and job_plan.profile is not None and not job_plan.layer_policies()
    session = ProbeSession(setup)
    judgement = session.judge(Probe(64, 1 * MiB, 10 * MiB, profile=replace(job_plan.profile, device="cpu")))
    assert judgement.done and judgement.replanned is not None
    assert judgement.replanned[1].memory_profile == "cpu on worker 0 (probe)"


def test_an_auto_batch_is_re_chosen_from_the_device_profile_and_later_shrinks_use_it():
    _, job_plan, setup = setup_for({"probe": True, "device_memory": "2MiB", "policy": "keep"}, batch="auto")
    assert setup is not None and job_plan.profile is not None
    before = job_plan.plan.per_device_batch
    doubled = replace(
        job_plan.profile,
        layers=tuple(
            replace(la, saved_bytes_per_sample=2 * la.saved_bytes_per_sample) for la in job_plan.profile.layers
        ),
        device="cuda:0",
    )
    session = ProbeSession(setup)
    judgement = session.judge(Probe(before, 1 * MiB, 10 * MiB, profile=doubled))
    assert judgement.replanned is not None and not judgement.done
    after = judgement.replanned[1].per_device_batch
    assert 0 < after < before  # twice the activations per sample: a smaller batch fits
    shrink = session.judge(Probe(after, 4 * MiB, 10 * MiB))  # overflowed anyway: shrink, still from the new profile
    assert shrink.replanned is not None and shrink.replanned[1].memory_profile == "cuda:0 on worker 0 (probe)"


@pytest.mark.parametrize("job_file_host", [None, "64GiB"])
def test_an_auto_batch_is_planned_for_the_masters_host_memory_unless_the_job_file_names_one(job_file_host):
    """Without ``memory.host_memory`` the coordinator's own host memory is only a stand-in for the workers' (right
    for pstrain local); the probing master reports its host's, and the swap plan's host limit uses that."""
    memory = {"probe": True, "device_memory": "1MiB", "policy": "swap", "host_memory": job_file_host}
    _, job_plan, setup = setup_for({k: v for k, v in memory.items() if v is not None}, batch="auto")
    assert setup is not None and job_plan.profile is not None and job_plan.memory is not None
    before = job_plan.plan.per_device_batch
    small_host = int(job_plan.memory.host_bytes / 4)  # the master's host holds a quarter of what the plan needs
    reported = replace(job_plan.profile, device="cuda:0", host_total_bytes=small_host)
    judgement = ProbeSession(setup).judge(Probe(before, 1 * MiB, 10 * MiB, profile=reported))
    assert judgement.replanned is not None
    after = judgement.replanned[1].per_device_batch
    if job_file_host is None:
        assert 0 < after < before  # the host limit binds, at the master's host
    else:
        assert after == before  # the job file's figure stands


def test_a_plan_whose_batch_the_coordinators_own_host_memory_binds_says_so(monkeypatch):
    import pstrain.coordinator.planning as planning

    monkeypatch.setattr(planning, "host_memory_for_offload", lambda: 1 * MiB)  # a coordinator on a small host
    _, job_plan, _ = setup_for({"device_memory": "64MiB", "policy": "swap"}, batch="auto")
    assert job_plan.limits is not None and job_plan.limits.binding == "host"
    assert any("this coordinator's" in w and "memory.host_memory" in w for w in job_plan.warnings)
    _, named, _ = setup_for({"device_memory": "64MiB", "policy": "swap", "host_memory": "1MiB"}, batch="auto")
    assert named.limits is not None and named.limits.binding == "host"
    assert not any("this coordinator's" in w for w in named.warnings)  # the job file named it: nothing to say


def test_the_worker_reports_its_hosts_memory_with_its_profile():
    cfg, job_plan, _ = setup_for(TIGHT)
    spec = job_spec(cfg, job_plan.plan, ModelState(cfg).layout, "job")
    data = classification_set(64, inputs=64)
    message = device_profile(
        spec, torch.device("cpu"), lambda n: (data.tensors[0][:n].clone(), data.tensors[1][:n].clone()), CE
    )
    assert message.host_total_bytes > 0  # /proc/meminfo, or the cgroup's memory.max


def test_a_cpu_stand_in_profile_without_a_budget_leaves_the_plan_alone():
    _, job_plan, setup = setup_for({"probe": True})
    assert setup is not None and job_plan.memory is None
    session = ProbeSession(setup)
    profile = ModelProfile((), 8, "cpu")
    judgement = session.judge(Probe(64, 1 * MiB, 10 * MiB, profile=profile))
    assert judgement.done and judgement.replanned is None and session.profile_source == ""


def test_the_worker_profiles_the_plans_layers_on_its_device():
    cfg, job_plan, _ = setup_for(TIGHT)
    spec = job_spec(cfg, job_plan.plan, ModelState(cfg).layout, "job")
    data = classification_set(64, inputs=64)

    def sample(n):  # fresh tensors, as the worker's feed collates them (a view would share one storage)
        return data.tensors[0][:n].clone(), data.tensors[1][:n].clone()

    message = device_profile(spec, torch.device("cpu"), sample, torch.nn.functional.cross_entropy)
    profile = profile_from_pb(message)
    assert profile.device == "cpu" and profile.device_total_bytes == 0 and profile.batch == 8
    assert job_plan.profile is not None
    assert [la.name for la in profile.layers] == [la.name for la in job_plan.profile.layers]
    assert [la.saved_bytes_per_sample for la in profile.layers] == [
        la.saved_bytes_per_sample for la in job_plan.profile.layers
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_worker_profiles_on_cuda_with_the_device_size():
    cfg, job_plan, setup = setup_for(TIGHT)
    spec = job_spec(cfg, job_plan.plan, ModelState(cfg).layout, "job")
    data = classification_set(64, inputs=64)
    device = torch.device("cuda", 0)
    message = device_profile(
        spec,
        device,
        lambda n: (data.tensors[0][:n].clone(), data.tensors[1][:n].clone()),
        torch.nn.functional.cross_entropy,
    )
    assert message.device == "cuda:0" and message.device_total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert setup is not None
    judgement = ProbeSession(setup).judge(Probe(64, 100 * 1024, 10 * MiB, profile=profile_from_pb(message)))
    assert judgement.replanned is not None and judgement.replanned[1].memory_profile == "cuda:0 on worker 0 (probe)"


def test_a_probing_job_re_plans_from_the_masters_profile(tmp_path):
    """The whole path on CPU stand-ins: worker 0 profiles, reports over gRPC, the coordinator re-plans."""
    marker = uuid.uuid4().hex
    job = write_job(
        tmp_path / "job.yaml",
        batch={"per_device": 4, "lr_scaling": "none"},
        cluster={"ps_shards": 1, "workers": 1, "devices_per_worker": 1},
        memory={"probe": True, "device_memory": "1GiB"},
    )
    result = run_local(job, tmp_path / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "out" / "logs" / "coordinator.log").read_text()
    assert "memory plan re-made from the cpu on worker 0 (probe) profile" in log
    assert not pids_with_marker(marker)


def _bad_profiles(profile: ModelProfile) -> dict[str, tuple[ModelProfile, str]]:
    """Malformed device profiles (a worker built from another proto, a bug) and what the refusal says."""
    first = profile.layers[0]
    renamed = tuple(replace(la, name=f"no_such_layer_{i}") for i, la in enumerate(profile.layers))
    return {
        "batch 0": (replace(profile, batch=0), "batch must be at least 1, got 0"),
        "no layers": (replace(profile, layers=()), "it has no layers"),
        "unknown layers": (replace(profile, layers=renamed), r"unknown: \['no_such_layer_0'"),
        "a layer missing": (replace(profile, layers=profile.layers[1:]), r"missing: \['0'\]"),
        "a repeated layer": (replace(profile, layers=(first, *profile.layers)), r"layer names repeat: \['0'\]"),
        "NaN time": (
            replace(profile, layers=(replace(first, forward_s=float("nan")), *profile.layers[1:])),
            "layer '0': forward_s must be a finite non-negative number, got nan",
        ),
        "negative bytes": (
            replace(profile, layers=(replace(first, saved_bytes_per_sample=-1.0), *profile.layers[1:])),
            "layer '0': saved_bytes_per_sample must be a finite non-negative number",
        ),
        "an unknown input owner": (
            replace(profile, layers=(replace(first, inputs=(LayerInput(4.0, 0.0, "nope"),)), *profile.layers[1:])),
            "layer '0': an input's saved_by must name another of its layers or be empty, got 'nope'",
        ),
        "its own input owner": (
            replace(profile, layers=(replace(first, inputs=(LayerInput(4.0, 0.0, "0"),)), *profile.layers[1:])),
            "layer '0': an input's saved_by must name another",
        ),
        "negative input bytes": (
            replace(profile, layers=(replace(first, inputs=(LayerInput(-4.0),)), *profile.layers[1:])),
            "layer '0': an input's bytes_per_sample must be a finite non-negative number, got -4.0",
        ),
        "infinite unprofiled bytes": (
            replace(profile, unprofiled_saved_per_sample=float("inf")),
            "unprofiled_saved_per_sample must be a finite non-negative number, got inf",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "batch 0",
        "no layers",
        "unknown layers",
        "a layer missing",
        "a repeated layer",
        "NaN time",
        "negative bytes",
        "an unknown input owner",
        "its own input owner",
        "negative input bytes",
        "infinite unprofiled bytes",
    ],
)
def test_a_malformed_device_profile_is_refused_and_changes_nothing(case):
    _, job_plan, setup = setup_for(TIGHT)
    _, _, fresh_setup = setup_for(TIGHT)
    assert setup is not None and fresh_setup is not None and job_plan.profile is not None
    bad, match = _bad_profiles(replace(job_plan.profile, device="cuda:0"))[case]
    session = ProbeSession(setup)
    with pytest.raises(InvalidRequest, match=match):
        session.judge(Probe(64, 100 * 1024, 10 * MiB, profile=bad))
    assert session.profile_source == "" and session.policies == fresh_setup.policies
    # the next report is judged exactly as if the bad one had never come: same shrink, same plan, same profile
    judged = session.judge(Probe(64, 10 * MiB, 10 * MiB))
    expected = ProbeSession(fresh_setup).judge(Probe(64, 10 * MiB, 10 * MiB))
    assert judged.replanned is not None and expected.replanned is not None
    assert (judged.message, judged.replanned[1]) == (expected.message, expected.replanned[1])
    assert judged.replanned[1].memory_profile == ""  # still the coordinator's own profile


def test_a_malformed_device_profile_is_invalid_argument_over_grpc_and_the_job_keeps_probing(tmp_path):
    cfg = parse_config({**RAW, "memory": TIGHT})
    model = ModelState(cfg)
    job_plan = plan_job(cfg, model.model, classification_set(4096, inputs=64), model.layout.total)
    assert job_plan.profile is not None

    def spec_for(plan, policies):
        return job_spec(cfg, plan, model.layout, "job", policies)

    spec = spec_for(job_plan.plan, job_plan.layer_policies())
    job = Job(
        "job", job_plan.plan, spec, model, DataShardTracker(4096, 64, True, 0), tmp_path, lambda a, v: None, 30.0,
        probe=probe_setup(cfg, job_plan, spec_for),
    )  # fmt: skip
    for shard in range(cfg.cluster.ps_shards):
        job.register_ps(shard, f"127.0.0.1:{5000 + shard}")
        job.ps_ready(shard)
    assert job.register_worker("127.0.0.1:6000", [], "h") == 0 and job.state == JobState.PROBING
    server = start_server(
        "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], ["Coordinator"]
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        bad = profile_to_pb(replace(job_plan.profile, batch=0, device="cuda:0"))
        report = pb.ProbeReport(
            worker_id=0, per_device_batch=64, device_peak_bytes=100 * 1024, host_peak_bytes=10 * MiB, profile=bad
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportProbe(report, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cuda:0 profile: batch must be at least 1, got 0" in refused.value.details()
        assert job.state == JobState.PROBING and job.spec == spec
        report.ClearField("profile")
        verdict = stub.ReportProbe(report, timeout=30)  # a well-formed report is judged as ever
        assert verdict.done and verdict.job.per_device_batch == 64
    finally:
        channel.close()
        server.stop(0)


def test_a_local_runs_workers_plan_with_their_share_of_this_hosts_memory(monkeypatch):
    """pstrain local (``--colocated``): every worker and shard runs on this host, so the default host memory is
    shared; planned whole for each worker, the host-fit batch was about ``workers`` times too large."""
    import pstrain.coordinator.planning as planning

    monkeypatch.setattr(planning, "host_memory_for_offload", lambda: 64 * MiB)
    memory = {"probe": True, "device_memory": "64MiB", "policy": "swap"}
    raw = {**RAW, "cluster": {"workers": 2, "devices_per_worker": ["cpu"], "ps_shards": 2}, "memory": memory}
    cfg = parse_config({**raw, "batch": {"per_device": "auto", "lr_scaling": "none"}})
    model = ModelState(cfg)
    data = classification_set(4096, inputs=64)
    alone = plan_job(cfg, model.model, data, model.layout.total)
    local = plan_job(cfg, model.model, data, model.layout.total, colocated=True)
    assert alone.memory is not None and local.memory is not None and local.host_share is not None
    share = local.host_share
    assert share.workers == 2 and share.shards_bytes == 2 * local.ps_bytes_per_shard
    assert local.memory.budget.host_bytes == (64 * MiB - share.shards_bytes) // 2
    assert alone.limits is not None and local.limits is not None and local.limits.host < alone.limits.host
    assert "every member runs on this host" in describe(local) and "every member" not in describe(alone)
    assert not any("this coordinator's" in w for w in local.warnings)  # this host's memory is right here

    def spec_for(plan, policies):
        return job_spec(cfg, plan, model.layout, "job", policies)

    planner = ProbePlanner(cfg, local, spec_for)
    assert local.profile is not None
    planner.adopt(replace(local.profile, device="cuda:0", host_total_bytes=32 * MiB))  # the master: this host too
    assert planner.budget is not None and planner.budget.host_bytes == share.of(32 * MiB)
    named = parse_config({**raw, "memory": {**memory, "host_memory": "1GiB"}, "batch": {"per_device": 8}})
    kept = plan_job(named, ModelState(named).model, data, model.layout.total, colocated=True)
    assert kept.host_share is None and kept.memory is not None and kept.memory.budget.host_bytes == 1 << 30
