"""The master worker's probe measures what this iteration took (SPEC S2.1), and an out-of-memory is unmistakable.

The CPU stand-in figures are per-iteration peaks: a process's lifetime peak (``ru_maxrss``) would report an
earlier, bigger probe's (or the parent's) memory and the coordinator's shrink loop would never converge. The
CUDA out-of-memory decision is a plain function, so the path a GPU takes is tested here too.
"""

from __future__ import annotations

import torch
from torch import nn

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.plan import Plan, make_plan
from pstrain.coordinator.probe import ProbeSession, ProbeSetup
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy, Probe
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.layout import ParamLayout
from pstrain.worker.probe import IterationPeak, oom_device_peak, run_probe
from pstrain.worker.replicas import ReplicaSet

MiB = 1 << 20
GiB = 1 << 30


def touched(nbytes: int) -> torch.Tensor:
    """A tensor whose pages are all resident; past 32 MiB (glibc's largest mmap threshold) always fresh pages,
    so the RSS grows by its size even where freed memory is still resident."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def recording(replans: list[int]):
    """A coordinator's re-plan that records the batches it was asked for."""
    cfg = parse_config({"model": {"factory": "m:f"}, "data": {"factory": "d:f"}})

    def replan(batch: int) -> tuple[Plan, pb.JobSpec]:
        replans.append(batch)
        return make_plan(cfg, batch), pb.JobSpec(per_device_batch=batch)

    return replan


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))


def test_an_out_of_memory_first_probe_reports_more_than_the_device_and_the_coordinator_shrinks():
    peak = oom_device_peak(0, allocated_peak_bytes=79 * GiB, device_total_bytes=80 * GiB)
    assert peak > 80 * GiB and oom_device_peak(0, 0, 80 * GiB) > 80 * GiB  # an OOM before any allocation too
    replans: list[int] = []
    session = ProbeSession(ProbeSetup(80 * GiB, 0.1, EstimatePolicy(), replan=recording(replans)))
    judgement = session.judge(Probe(4096, peak, 10 * GiB))
    assert not judgement.done and session.worker_device_bytes == 0  # not accepted at a peak of 0
    assert replans == [1843]  # about half (twice the device reported), less the 10% margin


def test_an_out_of_memory_iterative_trial_reports_its_limit_so_the_limit_grows():
    assert oom_device_peak(12 * GiB, allocated_peak_bytes=11 * GiB, device_total_bytes=80 * GiB) == 12 * GiB
    policy = EstimatePolicy(EstimateMode.ITERATIVE, increment_bytes=1 * GiB, target_utilization=0.85)
    session = ProbeSession(ProbeSetup(80 * GiB, 0.1, policy, replan=recording([])))
    first = session.judge(Probe(64, 10 * GiB, 1 * GiB))
    trial = session.judge(Probe(64, oom_device_peak(first.limit_bytes, 0, 80 * GiB), 1 * GiB, first.limit_bytes))
    assert not trial.done and trial.limit_bytes == first.limit_bytes + 1 * GiB


def test_the_iteration_peak_ignores_an_earlier_bigger_peak():
    big = touched(256 * MiB)
    del big  # the process's lifetime peak is now at least 256 MiB over its RSS
    with IterationPeak() as meter:
        held = touched(64 * MiB)
        del held
    assert meter.resets  # this kernel has /proc/self/clear_refs
    assert 56 * MiB <= meter.growth_bytes < 192 * MiB  # the block's own peak, not the 256 MiB one before it


def test_without_clear_refs_the_sampled_peak_ignores_an_earlier_bigger_peak(tmp_path):
    big = touched(256 * MiB)
    del big
    with IterationPeak(clear_refs=str(tmp_path / "no" / "clear_refs")) as meter:
        assert not meter.resets
        held = touched(64 * MiB)
        meter.sample()  # the sampling thread takes these too; one taken now makes the test deterministic
        del held
    assert 56 * MiB <= meter.growth_bytes < 192 * MiB


def test_a_probe_after_a_bigger_one_reports_its_own_peak():
    replicas = ReplicaSet(build, [torch.device("cpu")], ParamLayout.of(build()))
    loss = nn.functional.cross_entropy
    try:
        inputs = torch.randn(1 << 17, 64)  # activations of about 100 MiB
        big, big_host = run_probe(replicas, inputs, torch.randint(0, 4, (1 << 17,)), loss)
        del inputs
        small, host = run_probe(replicas, torch.randn(16, 64), torch.randint(0, 4, (16,)), loss)
    finally:
        replicas.close()
    assert big > 64 * MiB
    assert small < 16 * MiB  # not the earlier probe's peak, which ru_maxrss kept
    assert 0 < host < big_host  # the host figure is this iteration's RSS peak, not the bigger one's
