"""From the job file and a measured profile to the job's plan: batch, LR and memory policy.

This is where S1.5 (largest batch), S1.6 (LR) and S3.2-S3.4 (swap or recompute) meet: the
coordinator profiles the model on its own host (CPU is fine: per-sample bytes do not depend on
the device), plans for the device memory of the workers' GPUs, and picks the per-device batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Dataset, default_collate

from pstrain.coordinator.config import JobConfig
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.plan import Plan, make_plan
from pstrain.coordinator.probe import ProbeSetup
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy
from pstrain.planner.memory_plan import (
    MemoryBudget,
    MemoryPlan,
    Policy,
    max_batch,
    peak_bytes,
    plan_for_batch,
    s15_max_batch,
)
from pstrain.planner.profiler import ModelProfile, profile_model
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import resolve_loss
from pstrain.runtime.optimizers import optimizer_entry
from pstrain.runtime.units import parse_bytes

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 12e9  # PCIe 3.0 x16, what a host-to-device copy reaches in practice


@dataclass(frozen=True)
class JobPlan:
    plan: Plan
    profile: ModelProfile | None = None
    memory: MemoryPlan | None = None
    max_batch_no_swap: int = 0
    max_batch_with_plan: int = 0
    max_batch_s15: int = 0
    ps_bytes_per_shard: int = 0

    def layer_policies(self) -> dict[str, str]:
        return self.memory.policies() if self.memory else {}


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Pinned host -> device copy rate, the figure swap costs are computed from."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started)


def budget_for(cfg: JobConfig, device_memory: str | None = None, bandwidth: str | None = None) -> MemoryBudget | None:
    memory = device_memory or cfg.memory.device_memory
    if memory is not None:
        device_bytes = parse_bytes(memory)
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        return None
    rate = bandwidth or cfg.memory.bandwidth
    if rate is not None:
        rate_bytes = float(parse_bytes(rate))
    elif torch.cuda.is_available():
        rate_bytes = measure_bandwidth(torch.device("cuda", 0))
    else:
        rate_bytes = DEFAULT_BANDWIDTH
    return MemoryBudget(device_bytes, rate_bytes, cfg.memory.margin, cfg.memory.prefetch)


def profile_job(cfg: JobConfig, model: torch.nn.Module, dataset: Dataset) -> ModelProfile:
    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > len(dataset):  # type: ignore[arg-type]
            raise ConfigError(f"memory.profile_batches: {n} exceeds the dataset's {len(dataset)} samples")  # type: ignore[arg-type]
        batch = default_collate([dataset[i] for i in range(n)])
        return batch[0], batch[1]

    b1, b2 = cfg.memory.profile_batches
    return profile_model(model, sample, resolve_loss(cfg.loss), (b1, b2), cfg.memory.blocks, "cpu")


def plan_job(
    cfg: JobConfig,
    model: torch.nn.Module,
    dataset: Dataset,
    total_params: int,
    device_memory: str | None = None,
    bandwidth: str | None = None,
) -> JobPlan:
    budget = budget_for(cfg, device_memory, bandwidth)
    auto = cfg.batch.per_device == "auto"
    if budget is None:
        if auto:
            raise ConfigError(
                "memory.device_memory: batch.per_device is 'auto' but this host has no GPU to measure; "
                "give the workers' device memory, e.g. memory.device_memory: 80GiB"
            )
        return JobPlan(make_plan(cfg), ps_bytes_per_shard=ps_bytes(cfg, total_params))
    profile = profile_job(cfg, model, dataset)
    no_swap = max_batch(profile, budget, allow_swap=False)
    with_plan = max_batch(profile, budget, allow_swap=True)
    if auto:
        batch = with_plan if cfg.memory.policy != "keep" else no_swap
        if cfg.batch.max_per_device is not None:
            batch = min(batch, cfg.batch.max_per_device)
        if batch < 1:
            raise ConfigError(f"batch.per_device: not even one sample fits in {budget.device_bytes / 2**30:.1f} GiB")
    else:
        batch = int(cfg.batch.per_device)
    memory = plan_for_batch(profile, batch, budget, allow_swap=cfg.memory.policy != "keep")
    if cfg.memory.policy == "swap":
        memory = _all_swap(memory, profile, budget)
    if not memory.fits:
        log.warning("batch %d does not fit in %.1f GiB even with the memory plan", batch, budget.device_bytes / 2**30)
    return JobPlan(
        make_plan(cfg, batch),
        profile,
        memory,
        no_swap,
        with_plan,
        s15_max_batch(profile, budget.device_bytes),
        ps_bytes(cfg, total_params),
    )


def _all_swap(memory: MemoryPlan, profile: ModelProfile, budget: MemoryBudget) -> MemoryPlan:
    decisions = tuple(replace(d, policy=Policy.SWAP) if d.saved_bytes > 0 else d for d in memory.decisions)
    policies = {d.name: d.policy for d in decisions}
    return replace(memory, decisions=decisions, peak_bytes=peak_bytes(profile, memory.batch, policies, budget))


def ps_bytes(cfg: JobConfig, total_params: int) -> int:
    """Parameters, the gradient accumulator and the optimizer state of the largest shard."""
    shard = -(-total_params // cfg.cluster.ps_shards)
    return shard * 4 * (2 + optimizer_entry(cfg.optimizer.name).state_tensors)


def describe(job: JobPlan) -> str:
    """The printout of ``pstrain plan``."""
    lines = []
    mem = job.memory
    if job.profile is not None and mem is not None:
        lines.append(
            f"{'layer':<24} {'params':>10} {'saved/sample':>13} {'at batch':>11} {'policy':>9} "
            f"{'swap ms':>9} {'recomp ms':>9}"
        )
        for layer, d in zip(job.profile.layers, mem.decisions, strict=True):
            lines.append(
                f"{layer.name:<24} {_size(layer.param_bytes):>10} {_size(layer.saved_bytes_per_sample):>13} "
                f"{_size(d.saved_bytes):>11} {d.policy.value:>9} {d.swap_s * 1e3:>9.2f} {d.recompute_s * 1e3:>9.2f}"
            )
        budget = mem.budget
        lines += [
            "",
            f"device memory {_size(budget.device_bytes)} (margin {budget.margin:.0%}), "
            f"device<->host {budget.bandwidth_bytes_per_s / 1e9:.1f} GB/s, prefetch {budget.prefetch}",
            f"max per-device batch: without swap {job.max_batch_no_swap}, with the plan {job.max_batch_with_plan} "
            f"({job.max_batch_with_plan / max(job.max_batch_no_swap, 1):.1f}x), "
            f"S1.5 formula {job.max_batch_s15}",
            f"at batch {mem.batch}: peak {_size(mem.peak_bytes)} of {_size(budget.device_bytes)} "
            f"({'fits' if mem.fits else 'DOES NOT FIT'}); swap {mem.swap_s * 1e3:.1f} ms under an overlap budget of "
            f"{mem.overlap_budget_s * 1e3:.1f} ms; recompute {mem.recompute_s * 1e3:.1f} ms",
            f"estimated worker memory: {_size(mem.peak_bytes)} per device, "
            f"{_size(sum(d.saved_bytes for d in mem.decisions if d.policy == Policy.SWAP))} of host memory "
            "per device for swapped activations",
        ]
    else:
        lines.append("no memory plan: no device memory given (memory.device_memory) and no GPU on this host")
    p = job.plan
    lines += [
        f"chosen batch {p.per_device_batch}/device, global {p.global_batch}; "
        f"lr {p.base_lr:g} x {p.lr_factor:g} ({p.lr_scaling}) = {p.scaled_lr:g}",
        f"estimated PS memory: {_size(job.ps_bytes_per_shard)} per shard",
    ]
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def probe_setup(
    cfg: JobConfig, job_plan: JobPlan, spec_for: Callable[[Plan, dict[str, str]], pb.JobSpec]
) -> ProbeSetup | None:
    """How the coordinator judges the master's probe; None when ``memory.probe`` is off."""
    if not cfg.memory.probe:
        return None
    memory = job_plan.memory

    def replan(batch: int) -> tuple[Plan, pb.JobSpec]:
        plan = make_plan(cfg, batch)
        policies: dict[str, str] = {}
        if job_plan.profile is not None and memory is not None:
            policies = plan_for_batch(job_plan.profile, batch, memory.budget, cfg.memory.policy != "keep").policies()
        return plan, spec_for(plan, policies)

    policy = EstimatePolicy(
        EstimateMode(cfg.memory.estimate),
        cfg.memory.factor,
        parse_bytes(cfg.memory.increment),
        cfg.memory.target_utilization,
    )
    device_bytes = memory.budget.device_bytes if memory is not None else None
    return ProbeSetup(device_bytes, cfg.memory.margin, policy, replan, cfg.memory.max_probe_rounds)
