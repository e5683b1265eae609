"""The planner as someone who will run the job: data-set cap, host memory as a limit, whole-layer offload,
the pinned cap, and the large-batch LR warning (issue 10)."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from examples import ctr
from pstrain.coordinator.config import parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.planning import (
    SLOT_INDEX_BYTES_PER_ROW,
    describe,
    memory_max,
    plan_job,
    planning_gpu,
    ps_bytes,
    table_bytes_per_shard,
)
from pstrain.launcher.cli import main as cli_main
from pstrain.planner.memory_plan import MemoryBudget, batch_limits, largest_model, max_batch, plan_for_batch
from pstrain.planner.profiler import LayerProfile, ModelProfile
from tests.helpers import REPO_ROOT, child_env, classification_set, write_job

RAW = {
    "model": {"factory": "tests.helpers:odd_mlp"},
    "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 64}},
    "cluster": {"workers": 2, "devices_per_worker": ["cpu", "cpu"]},  # stand-ins on any host, a GPU host too
}


def job_plan(samples=64, **sections):
    cfg = parse_config({**RAW, **sections})
    model = ModelState(cfg)
    return plan_job(cfg, model.model, classification_set(samples), model.layout.total)


def synthetic(layers=24, per_sample=1000.0, params=4000, forward_s=1e-3):
    return ModelProfile(
        tuple(
            LayerProfile(str(i), params, per_sample, 0.0, per_sample, forward_s, 2 * forward_s) for i in range(layers)
        ),
        batch=32,
        device="cpu",
    )


def test_the_global_batch_never_exceeds_the_training_set():
    plan = job_plan(batch={"per_device": "auto"}, memory={"device_memory": "64GiB", "host_memory": "1TiB"})
    assert plan.plan.global_batch <= 64 and plan.plan.per_device_batch == 16  # 64 samples over 4 devices
    assert "capped at 16/device by the training set: 64 samples over 4 devices" in plan.batch_reason
    assert "device memory binds" in plan.batch_reason  # and why memory alone would have stopped later
    fixed = job_plan(batch={"per_device": 100})
    assert fixed.plan.per_device_batch == 16 and "without the cap 100: set by batch.per_device" in fixed.batch_reason
    assert "batch: capped at 16/device" in describe(fixed)


def test_auto_says_why_it_stopped():
    plan = job_plan(
        samples=10**6, batch={"per_device": "auto"}, memory={"device_memory": "64KiB", "host_memory": "1TiB"}
    )
    assert plan.batch_reason.startswith("device memory binds: 64.0 KiB fits")
    assert plan.limits is not None and plan.limits.binding == "device"
    capped = job_plan(
        samples=10**6, batch={"per_device": "auto", "max_per_device": 2}, memory={"device_memory": "64KiB"}
    )
    assert capped.batch_reason == "batch.max_per_device caps it at 2"


def test_host_memory_binds_when_swapped_activations_do_not_fit_it():
    profile = synthetic()
    roomy = MemoryBudget(10_000_000, 1e12, devices_per_host=4, host_bytes=10**12)
    tight = replace(roomy, host_bytes=40_000_000)
    free, bound = batch_limits(profile, roomy, True), batch_limits(profile, tight, True)
    assert free.binding in ("device", "neither") and free.both == free.device
    assert bound.binding == "host" and bound.both == bound.host < bound.device == free.device
    plan = plan_for_batch(profile, bound.both, tight)
    assert plan.fits and plan.host_bytes <= 40_000_000
    assert not plan_for_batch(profile, bound.both + 1, tight).fits_host
    # four devices' swapped activations + staging, plus the worker's two buffers
    swapped = sum(d.saved_bytes for d in plan.decisions if d.policy.value == "swap")
    assert plan.host_bytes == pytest.approx(4 * (swapped + profile.param_bytes) + 2 * profile.param_bytes)


def test_whole_layer_offload_plans_a_model_larger_than_the_device():
    profile = synthetic(layers=24, params=1_000_000)  # 24 MB of parameters
    device = MemoryBudget(16_000_000, 1e12, host_bytes=10**10)  # 16 MB: the parameters alone do not fit
    assert profile.param_bytes > device.device_bytes
    assert max_batch(profile, device, allow_swap=True) == 0
    offload = replace(device, offload_params=True)
    assert max_batch(profile, offload, allow_swap=True) > 0
    assert plan_for_batch(profile, 1, offload).peak_bytes < device.device_bytes
    assert largest_model(profile, offload, True) > 10 * largest_model(profile, device, True)
    # offloaded parameters and gradients live on the host: it must hold them
    assert max_batch(profile, replace(offload, host_bytes=10_000_000), allow_swap=True) == 0


def test_pinned_memory_past_its_cap_is_copied_at_the_pageable_rate():
    budget = MemoryBudget(10**9, 1e10)
    capped = replace(budget, pinned_limit_bytes=0)
    assert capped.copy_s(1e9, 1e9) == pytest.approx(2 * budget.copy_s(1e9, 1e9))
    half = replace(budget, pinned_limit_bytes=500_000_000)
    assert budget.copy_s(1e9, 1e9) < half.copy_s(1e9, 1e9) < capped.copy_s(1e9, 1e9)
    profile = synthetic()
    assert (
        plan_for_batch(profile, 1000, capped).decisions[0].swap_s
        > plan_for_batch(profile, 1000, budget).decisions[0].swap_s
    )


@pytest.mark.parametrize("optimizer, warns", [("sgd", True), ("lars", False)])
def test_linear_scaling_past_the_threshold_warns_and_proposes_layerwise_optimizers(optimizer, warns):
    plan = job_plan(
        samples=10**5,
        optimizer={"name": optimizer, "lr": 0.1},
        batch={"per_device": 4096, "lr_scaling": "linear", "linear_lr_max_global": 8192},
    )
    assert plan.plan.global_batch == 16384
    assert bool(plan.warnings) == warns
    if warns:
        assert "exceeds batch.linear_lr_max_global 8192" in plan.warnings[0] and "lars or lamb" in plan.warnings[0]
        assert "WARNING: global batch 16384" in describe(plan)
    small = job_plan(samples=10**5, batch={"per_device": 2048, "lr_scaling": "linear"})
    assert small.warnings == ()


@pytest.mark.parametrize(
    "devices, gpus_here, expected",
    [
        (["cpu", "cpu"], 1, None),  # CPU stand-ins: this host's GPU says nothing about them
        (2, 1, "cuda:0"),  # as many devices as the host has: GPUs
        (["cuda:3"], 1, "cuda:0"),  # a GPU this host lacks: the workers' hosts have it; one like it stands in
        (["cpu", "cuda:1"], 2, "cuda:1"),
        (["cuda:0"], 0, None),  # no GPU here to plan with
    ],
)
def test_the_planning_gpu_is_one_the_job_lists_or_one_like_it(monkeypatch, devices, gpus_here, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus_here > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_here)
    cfg = parse_config({**RAW, "cluster": {"workers": 1, "devices_per_worker": devices}})
    gpu = planning_gpu(cfg)
    assert (None if gpu is None else str(gpu)) == expected


def test_plan_shows_both_limits_each_policy_and_cpu_measured_times():
    memory = {"device_memory": "64KiB", "host_memory": "8GiB"}
    gpus = {"workers": 2, "devices_per_worker": ["cuda:0", "cuda:1"]}  # planned here, on any host
    plan = job_plan(samples=10**5, batch={"per_device": "auto"}, memory=memory, cluster=gpus)
    text = describe(plan)
    assert "largest batch: device-fit" in text and "host-fit" in text and "binds: device" in text
    for policy in ("keep", "swap activations", "whole-layer offload"):
        assert f"  {policy}" in text
    assert [p for p, _, _ in plan.largest_models] == ["keep", "swap activations", "whole-layer offload"]
    keep, swap, offload = (m for _, m, _ in plan.largest_models)
    assert offload > keep and swap >= keep
    assert "measured on this host's CPU" in text and "memory.probe: true" in text
    stand_ins = job_plan(samples=10**5, batch={"per_device": "auto"}, memory=memory)  # CPU workers: CPU times fit
    assert "measured on this host's CPU" not in describe(stand_ins)


def test_pstrain_plan_measures_bandwidth_and_takes_host_memory(tmp_path):
    job = write_job(tmp_path / "job.yaml", batch={"per_device": "auto", "max_per_device": 64})
    result = subprocess.run(
        [sys.executable, "-m", "pstrain.launcher.cli", "plan", "--config", str(job), "--device-memory", "256KiB"]
        + ["--host-memory", "2GiB", "--measure-bandwidth"],
        cwd=REPO_ROOT,
        env=child_env("plan"),  # no GPU visible: the copy it measures is the host's
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "memory.bandwidth measured:" in result.stdout and "host memory copy (no GPU)" in result.stdout
    assert "of 2.0 GiB" in result.stdout and "largest batch: device-fit" in result.stdout


def test_whole_layer_offload_shares_the_hosts_buffers_across_its_devices():
    """Offloaded replicas read the worker's parameter copy and sum into its host-sum buffer: 2P per host."""
    profile = synthetic(layers=24, params=1_000_000)
    offload = MemoryBudget(16_000_000, 1e12, devices_per_host=4, host_bytes=10**10, offload_params=True)
    plan = plan_for_batch(profile, 1, offload)
    swapped = sum(d.saved_bytes for d in plan.decisions if d.policy.value == "swap")
    assert plan.host_bytes == pytest.approx(4 * swapped + 2 * profile.param_bytes)
    plain = replace(offload, device_bytes=10**12, offload_params=False)
    assert plan.host_bytes < plan_for_batch(profile, 1, plain).host_bytes
    assert max_batch(profile, replace(offload, host_bytes=int(2.1 * profile.param_bytes)), allow_swap=True) > 0


# ------------------------------------------------------------------ review fixes: PS tables, swap + auto, bad input


def test_ps_memory_counts_the_sparse_table_rows_each_shard_owns():
    sizes = {"users": 1001, "items": 500, "contexts": 7}
    raw = {
        "model": {"factory": "examples.ctr:dlrm", "kwargs": {**sizes, "dim": 8, "hidden": 8}},
        "data": {"factory": "examples.ctr:train_set", "kwargs": {"samples": 64, **sizes, "seed": 0}},
        "cluster": {"ps_shards": 3, "workers": 1, "devices_per_worker": ["cpu"]},
        "embeddings": {
            "user": {"rows": 1001, "dim": 8, "optimizer": "adagrad"},
            "item": {"rows": 500, "dim": 8, "optimizer": "adam"},
            "ctx": {"rows": 7, "dim": 8},  # sgd: no state
        },
    }
    cfg = parse_config(raw)
    model = ModelState(cfg)
    dense = ps_bytes(parse_config({**raw, "embeddings": {}}), model.layout.total)
    # shard 0 owns ceil(rows / 3) of each table (ids dealt by id % 3); a row: values, optimizer state, id + index
    row = SLOT_INDEX_BYTES_PER_ROW
    tables = 334 * (8 * 4 * 2 + row) + 167 * (8 * 4 * 3 + 4 + row) + 3 * (8 * 4 + row)
    assert table_bytes_per_shard(cfg) == tables
    plan = plan_job(cfg, model.model, ctr.train_set(samples=64, **sizes, seed=0), model.layout.total)
    assert plan.ps_bytes_per_shard == dense + tables and plan.ps_table_bytes_per_shard == tables
    assert memory_max(cfg, plan, model.layout.total)["ps_bytes"] >= tables  # the PS's MemoryMax too
    assert f"(sparse tables up to {tables / 1024:.1f} KiB of it, once every row is touched)" in describe(plan)


def test_swap_policy_with_an_auto_batch_sizes_the_batch_for_the_all_swap_plan_the_workers_get():
    memory = {"device_memory": "1MiB", "host_memory": "640KiB", "bandwidth": "10GB/s"}
    greedy = job_plan(samples=10**6, batch={"per_device": "auto", "lr_scaling": "none"}, memory=memory)
    swap = job_plan(
        samples=10**6, batch={"per_device": "auto", "lr_scaling": "none"}, memory={**memory, "policy": "swap"}
    )
    assert swap.memory is not None and greedy.memory is not None
    assert set(swap.memory.policies().values()) == {"swap"}  # every layer that saves anything is swapped
    assert swap.memory.fits and swap.plan.per_device_batch < greedy.plan.per_device_batch
    assert swap.batch_reason.startswith("host memory binds with every layer swapped (memory.policy: swap)")
    assert swap.limits is not None and swap.plan.per_device_batch == swap.limits.both
    profile, budget = swap.profile, swap.memory.budget
    assert profile is not None
    bigger = plan_for_batch(profile, swap.plan.per_device_batch + 1, budget, swap_all=True)
    assert not bigger.fits  # the largest batch that fits with every layer swapped


def test_a_training_set_smaller_than_the_devices_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"^cluster\.workers: the training set has 3 sample\(s\), fewer than the job's 4"
    ):
        job_plan(samples=3, batch={"per_device": 1})
    assert job_plan(samples=4, batch={"per_device": 1}).plan.global_batch == 4  # one sample per device is fine


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--network-bandwidth", "0", "--network-bandwidth: must be positive, got '0'"),
        ("--network-bandwidth", "fast", "--network-bandwidth: cannot read 'fast' as a size"),
        ("--device-memory", "1e400", "--device-memory: '1e400' is too large: not a finite number of bytes"),
        ("--host-memory", "1e999GiB", "--host-memory: '1e999GiB' is too large"),
        ("--device-memory", "0", "--device-memory: must be positive, got '0'"),
        ("--bandwidth", "12 parsecs", "--bandwidth: cannot read '12 parsecs' as a size"),
    ],
)
def test_pstrain_plan_refuses_a_bad_flag_with_a_message_and_exit_2(tmp_path, capsys, flag, value, message):
    job = write_job(tmp_path / "job.yaml")
    assert cli_main(["plan", "--config", str(job), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pstrain plan: {message}") and "Traceback" not in err
