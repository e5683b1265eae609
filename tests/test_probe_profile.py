"""Plans measured where they run (issue 10): the master's device profile replaces the coordinator's.

With ``memory.probe: true`` worker 0 profiles the model per layer on its device with the planner's
profiler and sends it with its first probe report; the coordinator re-plans from it (swap/recompute
decisions, an auto batch) and the spec names the profile it was made from. On CPU stand-ins the
same path runs with a CPU "device" profile.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec
from pstrain.coordinator.planning import plan_job, probe_setup
from pstrain.coordinator.probe import ProbeSession
from pstrain.coordinator.service import _probe_report
from pstrain.planner.memory_estimate import Probe
from pstrain.planner.profile_wire import profile_from_pb, profile_to_pb
from pstrain.planner.profiler import ModelProfile
from pstrain.protos import pstrain_pb2 as pb
from pstrain.worker.probe import device_profile
from tests.helpers import classification_set, pids_with_marker, run_local, write_job

MiB = 1 << 20

RAW = {
    "model": {"factory": "tests.helpers:odd_mlp", "kwargs": {"inputs": 64, "hidden": 256, "classes": 4}},
    "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 4096, "inputs": 64}},
    "batch": {"per_device": 64, "lr_scaling": "none"},
    "cluster": {"workers": 1, "devices_per_worker": ["cpu"]},  # a stand-in on any host: budgets come from the tests
}


def setup_for(memory: dict[str, object], batch: object = 64):
    cfg = parse_config({**RAW, "batch": {"per_device": batch, "lr_scaling": "none"}, "memory": memory})
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
    profile = replace(job_plan.profile, device="cuda:3", device_total_bytes=80 << 30)
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
    _, job_plan, setup = setup_for(TIGHT)
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
