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

from pstrain.coordinator.config import MAX_BATCH, JobConfig
from pstrain.coordinator.errors import ConfigError, InvalidRequest
from pstrain.coordinator.plan import Plan, make_plan
from pstrain.coordinator.probe import ProbeSetup
from pstrain.nn import seeded_rows
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy
from pstrain.planner.memory_plan import (
    BatchLimits,
    MemoryBudget,
    MemoryPlan,
    Policy,
    batch_limits,
    held_inputs,
    largest_model,
    max_batch,
    plan_for_batch,
    s15_max_batch,
)
from pstrain.planner.profile_wire import check_profile
from pstrain.planner.profiler import ModelProfile, profile_model
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import resolve_loss
from pstrain.runtime.memory_trend import host_memory_for_offload
from pstrain.runtime.optimizers import LARGE_BATCH, optimizer_entry
from pstrain.runtime.sparse_rows import owned_by
from pstrain.runtime.units import parse_bytes

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 12e9  # PCIe 3.0 x16, what a host-to-device copy reaches in practice


@dataclass(frozen=True)
class HostShare:
    """Every member runs on this host (``pstrain local``): a worker's host budget for offload is its share of the
    host's memory after the PS shards' (the default host memory is the whole host's, and every worker plans with
    it: the host-fit batch would be about ``workers`` times too large)."""

    workers: int
    shards_bytes: int  # the PS shards' estimate, all of them

    def of(self, host_bytes: int) -> int:
        return max(1, (host_bytes - self.shards_bytes) // self.workers)


@dataclass(frozen=True)
class JobPlan:
    plan: Plan
    profile: ModelProfile | None = None
    memory: MemoryPlan | None = None
    max_batch_no_swap: int = 0
    max_batch_with_plan: int = 0
    max_batch_s15: int = 0
    ps_bytes_per_shard: int = 0  # the fullest shard: dense range, its optimizer state and its sparse table rows
    ps_table_bytes_per_shard: int = 0  # of which sparse embedding table rows (issue 9), once every row is touched
    limits: BatchLimits | None = None  # device-fit, host-fit and which binds, at the job's policy
    batch_reason: str = ""  # why the chosen batch is what it is
    warnings: tuple[str, ...] = ()
    largest_models: tuple[tuple[str, float, int], ...] = ()  # (policy, parameter bytes at batch 1, max batch)
    data_cap: int = 0  # the largest per-device batch the training set allows (0: not computed)
    host_share: HostShare | None = None  # pstrain local, host memory not given: the workers share this host's

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


def measure_host_bandwidth(nbytes: int = 256 << 20) -> float:
    """Host memory copy rate (what a CPU stand-in's "swap" costs): ``--measure-bandwidth`` without a GPU."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - started)


def planning_gpu(cfg: JobConfig) -> torch.device | None:
    """The GPU of this host that stands for the workers' when the job file gives no sizes, or None.

    The coordinator usually runs on a host like the workers'. A job that lists only CPU devices
    (``devices_per_worker: [cpu, cpu]``) trains on CPU stand-ins even where this host has a GPU, so
    that GPU says nothing about the job: no memory budget from it, no bandwidth measured to it. Any
    other job trains on GPUs: the first listed GPU this host has, else ``cuda:0`` as one like the
    workers' (a job may list ``cuda:3`` for hosts with more GPUs than this one).
    """
    if not torch.cuda.is_available() or _only_cpus(cfg):
        return None
    listed = [torch.device(name) for name in cfg.cluster.device_list]
    here = [d for d in listed if d.type == "cuda" and (d.index or 0) < torch.cuda.device_count()]
    return torch.device("cuda", here[0].index or 0) if here else torch.device("cuda", 0)  # a GPU like theirs


def _only_cpus(cfg: JobConfig) -> bool:
    """The job names its devices and every one is a CPU stand-in."""
    listed = cfg.cluster.device_list
    return bool(listed) and all(torch.device(name).type == "cpu" for name in listed)


def budget_for(
    cfg: JobConfig, device_memory: str | None = None, bandwidth: str | None = None, host_memory: str | None = None
) -> MemoryBudget | None:
    gpu = planning_gpu(cfg)
    memory = device_memory or cfg.memory.device_memory
    if memory is not None:
        device_bytes = parse_bytes(memory)
    elif gpu is not None:
        device_bytes = torch.cuda.get_device_properties(gpu).total_memory
    else:
        return None
    rate = bandwidth or cfg.memory.bandwidth
    if rate is not None:
        rate_bytes = float(parse_bytes(rate))
    elif gpu is not None:
        rate_bytes = measure_bandwidth(gpu)
    else:
        rate_bytes = DEFAULT_BANDWIDTH
    host = host_memory or cfg.memory.host_memory
    return MemoryBudget(
        device_bytes,
        rate_bytes,
        cfg.memory.margin,
        cfg.memory.prefetch,
        host_bytes=parse_bytes(host) if host is not None else host_memory_for_offload(),
        devices_per_host=cfg.cluster.device_count,
        pinned_limit_bytes=parse_bytes(cfg.memory.pinned_limit),
        offload_params=cfg.memory.offload_params,
    )


def profile_job(cfg: JobConfig, model: torch.nn.Module, dataset: Dataset) -> ModelProfile:
    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > len(dataset):  # type: ignore[arg-type]
            raise ConfigError(f"memory.profile_batches: {n} exceeds the dataset's {len(dataset)} samples")  # type: ignore[arg-type]
        batch = default_collate([dataset[i] for i in range(n)])
        return batch[0], batch[1]

    b1, b2 = cfg.memory.profile_batches
    with seeded_rows(model, cfg.table_specs()):  # issue 9: sparse layers read their batch's rows from the init
        return profile_model(model, sample, resolve_loss(cfg.loss), (b1, b2), cfg.memory.blocks, "cpu")


def plan_job(
    cfg: JobConfig,
    model: torch.nn.Module,
    dataset: Dataset,
    total_params: int,
    device_memory: str | None = None,
    bandwidth: str | None = None,
    host_memory: str | None = None,
    colocated: bool = False,
) -> JobPlan:
    """The job's plan; ``colocated``: every member runs on this host (``pstrain local``), so without a host memory
    of the job file's or the caller's the workers share this host's (``HostShare``)."""
    budget = budget_for(cfg, device_memory, bandwidth, host_memory)
    share = None
    if colocated and (host_memory or cfg.memory.host_memory) is None:
        share = HostShare(cfg.cluster.workers, cfg.cluster.ps_shards * ps_bytes(cfg, total_params))
        if budget is not None and budget.host_bytes is not None:
            budget = replace(budget, host_bytes=share.of(budget.host_bytes))
    auto = cfg.batch.per_device == "auto"
    devices = cfg.cluster.workers * cfg.cluster.device_count
    samples = len(dataset)  # type: ignore[arg-type]
    if samples < devices:
        raise ConfigError(
            f"cluster.workers: the training set has {samples} sample(s), fewer than the job's {devices} devices "
            f"({cfg.cluster.workers} worker(s) x {cfg.cluster.device_count}): every device needs at least one "
            "sample per step and the global batch may not exceed the training set; use fewer workers or devices"
        )
    data_cap = samples // devices
    if budget is None:
        if auto:
            raise ConfigError(
                "memory.device_memory: batch.per_device is 'auto' but this host has no GPU to measure; "
                "give the workers' device memory, e.g. memory.device_memory: 80GiB"
            )
        batch, reason = _capped(int(cfg.batch.per_device), data_cap, "set by batch.per_device", len(dataset), devices)  # type: ignore[arg-type]
        plan = make_plan(cfg, batch)
        return JobPlan(
            plan,
            ps_bytes_per_shard=ps_bytes(cfg, total_params),
            ps_table_bytes_per_shard=table_bytes_per_shard(cfg),
            batch_reason=reason,
            warnings=_lr_warnings(cfg, plan),
            data_cap=data_cap,
            host_share=share,
        )
    profile = profile_job(cfg, model, dataset)
    allow_swap, swap_all = cfg.memory.policy != "keep", cfg.memory.policy == "swap"
    no_swap = max_batch(profile, budget, allow_swap=False)
    with_plan = max_batch(profile, budget, allow_swap=True, swap_all=swap_all)
    limits = batch_limits(profile, budget, allow_swap, upper=MAX_BATCH, swap_all=swap_all)
    if auto:
        batch, reason = limits.both, _memory_reason(limits, budget, cfg.memory.policy)
        if cfg.batch.max_per_device is not None and cfg.batch.max_per_device < batch:
            batch, reason = cfg.batch.max_per_device, f"batch.max_per_device caps it at {cfg.batch.max_per_device}"
        if batch < 1:
            raise ConfigError(
                f"batch.per_device: not even one sample fits ({_memory_reason(limits, budget, cfg.memory.policy)}); "
                "try memory.offload_params: true or a larger memory.host_memory"
            )
        batch, reason = _capped(batch, data_cap, reason, len(dataset), devices)  # type: ignore[arg-type]
    else:
        batch, reason = _capped(int(cfg.batch.per_device), data_cap, "set by batch.per_device", len(dataset), devices)  # type: ignore[arg-type]
    memory = _memory_for(cfg, profile, batch, budget)
    if not memory.fits:
        log.warning(
            "batch %d does not fit (device %s, host %s) even with the memory plan",
            batch,
            _size(memory.peak_bytes),
            _size(memory.host_bytes),
        )
    plan = make_plan(cfg, batch)
    warnings = _lr_warnings(cfg, plan)
    if profile.unprofiled():
        warnings += (profile.unprofiled(),)
    if limits.binding == "host" and (host_memory or cfg.memory.host_memory) is None and share is None:
        warnings += (
            f"the host limit binds the batch, and the host's memory ({_size(budget.host_bytes or 0)}) is this "
            "coordinator's: right when the workers run here (pstrain local), else set memory.host_memory to a "
            "worker host's (memory.probe: true re-plans with the master's own)",
        )
    gpu_job = bool(cfg.memory.device_memory or device_memory) or planning_gpu(cfg) is not None
    if profile.device == "cpu" and gpu_job and not _only_cpus(cfg):
        then = (
            "the master worker's own profile replaces it when its probe reports (memory.probe: true)"
            if cfg.memory.probe
            else "set memory.probe: true to re-plan from the master's GPU"
        )
        warnings += (
            "layer times were measured on this host's CPU, not the workers' GPU: the swap/recompute choices "
            f"rest on the compute/bandwidth ratio; {then}",
        )
    return JobPlan(
        plan,
        profile,
        memory,
        no_swap,
        with_plan,
        s15_max_batch(profile, budget.device_bytes),
        ps_bytes(cfg, total_params),
        table_bytes_per_shard(cfg),
        limits,
        reason,
        warnings,
        _largest_models(profile, budget),
        data_cap,
        share,
    )


def _capped(batch: int, data_cap: int, reason: str, samples: int, devices: int) -> tuple[int, str]:
    """The global batch never exceeds the training set: one step would otherwise repeat samples."""
    if batch <= data_cap:
        return batch, reason
    message = (
        f"capped at {data_cap}/device by the training set: {samples} samples over {devices} devices "
        f"(without the cap {batch}: {reason})"
    )
    log.warning("batch.per_device: %s", message)
    return data_cap, message


def _memory_reason(limits: BatchLimits, budget: MemoryBudget, policy: str = "auto") -> str:
    host = "unlimited" if budget.host_bytes is None else _size(budget.host_bytes)
    swapped = " with every layer swapped (memory.policy: swap)" if policy == "swap" else ""
    if limits.binding == "host":
        return f"host memory binds{swapped}: {host} fits {limits.host}/device, the device would fit {limits.device}"
    device = _size(budget.device_bytes)
    return f"device memory binds{swapped}: {device} fits {limits.device}/device (host {host} would fit {limits.host})"


def _auto_batch(cfg: JobConfig, profile: ModelProfile, budget: MemoryBudget) -> tuple[int, str]:
    """``batch.per_device: auto``: the largest batch whose plan, the one the workers will run, fits."""
    limits = batch_limits(
        profile, budget, cfg.memory.policy != "keep", upper=MAX_BATCH, swap_all=cfg.memory.policy == "swap"
    )
    return limits.both, _memory_reason(limits, budget, cfg.memory.policy)


def _lr_warnings(cfg: JobConfig, plan: Plan) -> tuple[str, ...]:
    entry = optimizer_entry(cfg.optimizer.name)
    if plan.lr_scaling != "linear" or entry.layerwise or plan.global_batch <= cfg.batch.linear_lr_max_global:
        return ()
    message = (
        f"global batch {plan.global_batch} exceeds batch.linear_lr_max_global {cfg.batch.linear_lr_max_global}: "
        f"linear LR scaling (lr x {plan.lr_factor:g}) is known to fail there; use optimizer.name: "
        f"{' or '.join(LARGE_BATCH)} (layer-wise trust ratio, made for large batches) with warmup"
    )
    log.warning("%s", message)
    return (message,)


def _largest_models(profile: ModelProfile, budget: MemoryBudget) -> tuple[tuple[str, float, int], ...]:
    """For each policy: the largest model of this shape that plans at batch 1, and this model's largest batch."""
    keep = replace(budget, offload_params=False)
    offload = replace(budget, offload_params=True)
    return (
        ("keep", largest_model(profile, keep, False), max_batch(profile, keep, False)),
        ("swap activations", largest_model(profile, keep, True), max_batch(profile, keep, True)),
        ("whole-layer offload", largest_model(profile, offload, True), max_batch(profile, offload, True)),
    )


WORKER_RUNTIME_BYTES = 2 << 30
"""A worker process's own memory besides the plan's buffers: Python, torch, CUDA context, data loading."""
PS_RUNTIME_BYTES = 1 << 30
"""A PS process's own memory besides its shard: Python, torch, gRPC buffers in flight."""


def memory_max(cfg: JobConfig, job: JobPlan, total_params: int) -> dict[str, int]:
    """systemd ``MemoryMax`` for a worker and a PS unit (S2.2 mode a on the plan's estimate): ``ansible/``
    renders them as drop-ins. The worker's is its host's offload memory (swapped activations, offloaded
    layers, pinned buffers of all its devices, its own sum buffers); the PS's is its largest shard."""
    host = job.memory.host_bytes if job.memory is not None else (job.plan.devices_per_worker + 2) * total_params * 4
    factor = cfg.memory.factor
    return {
        "worker_bytes": int(host * factor) + WORKER_RUNTIME_BYTES,
        "ps_bytes": int(job.ps_bytes_per_shard * factor) + PS_RUNTIME_BYTES,
    }


def ps_bytes(cfg: JobConfig, total_params: int) -> int:
    """The fullest shard: its dense range (parameters, the gradient accumulator, the optimizer state) and
    its sparse table rows (``table_bytes_per_shard``)."""
    shard = -(-total_params // cfg.cluster.ps_shards)
    return shard * 4 * (2 + optimizer_entry(cfg.optimizer.name).state_tensors) + table_bytes_per_shard(cfg)


TABLE_STATE_TENSORS = {"sgd": 0, "adagrad": 1, "adam": 2}
"""Per-row optimizer state of a sparse table, in tensors of ``dim`` floats (``ps_server/sparse_table.py``)."""
SLOT_INDEX_BYTES_PER_ROW = 120
"""A held row's id (int64) and its entry in the shard's id -> slot dict (about 106 B measured on CPython 3)."""


def table_bytes_per_shard(cfg: JobConfig) -> int:
    """Sparse embedding tables on the fullest PS shard once every row has been touched (issue 9).

    Rows are dealt by ``id % ps_shards``, so shard 0 owns the most of every table, ``ceil(rows / shards)``;
    each row it holds costs its values, its optimizer's state (and Adam's step count) and its slot index.
    An upper bound for a job that touches every row, as a long one does; the tables' tensors grow by
    doubling, so right after a growth they may hold spare capacity the bound leaves out.
    """
    total = 0
    for table in cfg.table_specs():
        rows = owned_by(0, cfg.cluster.ps_shards, table.rows)
        state = TABLE_STATE_TENSORS[table.optimizer]
        step = 4 if table.optimizer == "adam" else 0
        total += rows * (table.dim * 4 * (1 + state) + step + SLOT_INDEX_BYTES_PER_ROW)
    return total


def _held_lines(profile: ModelProfile, mem: MemoryPlan) -> list[str]:
    """What the peak holds beyond the layers' own saved bytes, where there is any (see ``planner.memory_plan``)."""
    lines = []
    policies = {d.name: d.policy for d in mem.decisions}
    held = held_inputs(profile, mem.batch, policies)
    if held:
        lines.append(f"inputs the recompute layers' checkpoints hold at batch {mem.batch}: {_size(held)}")
    outside = 2 * profile.unprofiled_param_bytes + profile.unprofiled_saved(mem.batch)
    if outside:
        lines.append(
            f"kept outside every layer at batch {mem.batch}: {_size(outside)} (parameters and gradients of modules "
            "that are not layers, and what is saved for backward outside every layer's forward)"
        )
    return lines


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
            *_held_lines(job.profile, mem),
            f"estimated worker memory: {_size(mem.peak_bytes)} per device, "
            f"{_size(sum(d.saved_bytes for d in mem.decisions if d.policy == Policy.SWAP))} of host memory "
            "per device for swapped activations",
            f"host memory at batch {mem.batch}: {_size(mem.host_bytes)} for {budget.devices_per_host} device(s) "
            f"and the worker's buffers, of {'unlimited' if budget.host_bytes is None else _size(budget.host_bytes)} "
            f"({'fits' if mem.fits_host else 'DOES NOT FIT'}); pinned up to {_size(budget.pinned_limit_bytes)} "
            f"per device, pageable past it; whole-layer offload {'on' if budget.offload_params else 'off'}",
        ]
        if job.host_share is not None:
            lines.append(
                f"host memory: every member runs on this host, so each of the {job.host_share.workers} worker(s) "
                f"plans with its share after the PS shards' {_size(job.host_share.shards_bytes)}"
            )
        if job.limits is not None:
            lim = job.limits

            def upto(n: int) -> str:
                return f">= {n} (the search's cap)" if n >= MAX_BATCH else str(n)

            lines.append(
                f"largest batch: device-fit {upto(lim.device)}, host-fit {upto(lim.host)}, both {upto(lim.both)}; "
                f"binds: {lim.binding}"
            )
        for policy, model_bytes, batch in job.largest_models:
            lines.append(
                f"  {policy:<20} largest model {_size(model_bytes)} of parameters; this model's max batch {batch}"
            )
    else:
        lines.append("no memory plan: no device memory given (memory.device_memory) and no GPU on this host")
    p = job.plan
    lines += [
        f"chosen batch {p.per_device_batch}/device, global {p.global_batch}; "
        f"lr {p.base_lr:g} x {p.lr_factor:g} ({p.lr_scaling}) = {p.scaled_lr:g}",
        f"estimated PS memory: {_size(job.ps_bytes_per_shard)} per shard"
        + (
            f" (sparse tables up to {_size(job.ps_table_bytes_per_shard)} of it, once every row is touched)"
            if job.ps_table_bytes_per_shard
            else ""
        ),
    ]
    if job.batch_reason:
        lines.append(f"batch: {job.batch_reason}")
    lines += [f"WARNING: {w}" for w in job.warnings]
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


class ProbePlanner:
    """The coordinator's plan while the master probes: from its own profile, then from the master's (issue 10).

    The plan first rests on the profile the coordinator measured on its own host (usually a CPU), whose
    compute/bandwidth ratio is not the workers'. The master's first probe report carries the planner's
    profile measured on its device; ``adopt`` re-plans from it (swap/recompute decisions and, for
    ``batch.per_device: auto``, the batch), every later re-plan (a probe that overflowed) uses it too,
    and each spec says in ``memory_profile`` which profile it was made from.
    """

    def __init__(
        self, cfg: JobConfig, job_plan: JobPlan, spec_for: Callable[[Plan, dict[str, str]], pb.JobSpec]
    ) -> None:
        self.cfg = cfg
        self.job_plan = job_plan
        self.spec_for = spec_for
        self.profile = job_plan.profile
        self.budget = job_plan.memory.budget if job_plan.memory is not None else None
        self.source = ""  # "" while the coordinator's own profile is in use

    def replan(self, batch: int) -> tuple[Plan, pb.JobSpec]:
        return self._plan_with(self.profile, self.budget, self.source, batch)

    def _plan_with(
        self, profile: ModelProfile | None, budget: MemoryBudget | None, source: str, batch: int
    ) -> tuple[Plan, pb.JobSpec]:
        plan = make_plan(self.cfg, batch)
        policies: dict[str, str] = {}
        if profile is not None and budget is not None:
            policies = _memory_for(self.cfg, profile, batch, budget).policies()
        spec = self.spec_for(plan, policies)
        spec.memory_profile = source
        return plan, spec

    def adopt(self, profile: ModelProfile, worker_id: int = 0) -> tuple[Plan, pb.JobSpec, int | None] | None:
        """Re-plan from ``profile`` (measured on the master's device); None when there is nothing to plan with.

        Returns the plan, its spec and the device budget in bytes. Without a budget of its own (no
        ``memory.device_memory``, no GPU on the coordinator) the coordinator takes the device's size from
        the profile; a CPU stand-in's profile has none, and then only a budget from the job file plans.
        Raises ``InvalidRequest`` for a profile it would plan from but cannot (``check_profile``: a batch of 0,
        no layers, a negative or non-finite figure, layers that are not the model's); the planner keeps
        its profile until a new plan has been made from the new one, so a refused report changes nothing.
        """
        cfg = self.cfg
        own = self.job_plan.profile
        budget = self.budget
        if budget is None and profile.device_total_bytes > 0:
            budget = budget_for(cfg, device_memory=str(profile.device_total_bytes))
        if budget is not None and cfg.memory.host_memory is None and profile.host_total_bytes > 0:
            host = profile.host_total_bytes  # the master's host, not the coordinator's
            share = self.job_plan.host_share
            budget = replace(budget, host_bytes=share.of(host) if share is not None else host)
        if budget is None:
            log.info("the master's %s profile arrived, but there is no device budget to plan with", profile.device)
            return None
        try:
            check_profile(profile, [layer.name for layer in own.layers] if own is not None else None)
        except ValueError as exc:
            raise InvalidRequest(f"the master's {profile.device or 'device'} profile: {exc}") from exc
        source = f"{profile.device} on worker {worker_id} (probe)"
        batch, reason = self.job_plan.plan.per_device_batch, "batch.per_device"
        if cfg.batch.per_device == "auto":
            batch, reason = _auto_batch(cfg, profile, budget)
            if cfg.batch.max_per_device is not None and cfg.batch.max_per_device < batch:
                batch, reason = cfg.batch.max_per_device, "batch.max_per_device caps it"
            if self.job_plan.data_cap and batch > self.job_plan.data_cap:
                batch, reason = self.job_plan.data_cap, f"capped at {self.job_plan.data_cap}/device by the training set"
            batch = max(1, batch)
        plan, spec = self._plan_with(profile, budget, source, batch)
        self.profile, self.budget, self.source = profile, budget, source  # only once a plan was made from it
        log.info(
            "memory plan re-made from the %s profile (was: the coordinator's %s profile): batch %d (%s), %s",
            self.source,
            own.device if own is not None else "no",
            batch,
            reason,
            ", ".join(f"{k}={v}" for k, v in sorted(spec.layer_policies.items())) or "every layer kept",
        )
        return plan, spec, budget.device_bytes


def _memory_for(cfg: JobConfig, profile: ModelProfile, batch: int, budget: MemoryBudget) -> MemoryPlan:
    """The plan the workers run at ``batch`` under ``memory.policy`` (swap: every layer swapped)."""
    policy = cfg.memory.policy
    return plan_for_batch(profile, batch, budget, allow_swap=policy != "keep", swap_all=policy == "swap")


def probe_setup(
    cfg: JobConfig, job_plan: JobPlan, spec_for: Callable[[Plan, dict[str, str]], pb.JobSpec]
) -> ProbeSetup | None:
    """How the coordinator judges the master's probe; None when ``memory.probe`` is off."""
    if not cfg.memory.probe:
        return None
    planner = ProbePlanner(cfg, job_plan, spec_for)
    policy = EstimatePolicy(
        EstimateMode(cfg.memory.estimate),
        cfg.memory.factor,
        parse_bytes(cfg.memory.increment),
        cfg.memory.target_utilization,
    )
    device_bytes = planner.budget.device_bytes if planner.budget is not None else None
    return ProbeSetup(
        device_bytes,
        cfg.memory.margin,
        policy,
        planner.replan,
        cfg.memory.max_probe_rounds,
        adopt=planner.adopt,
        policies=job_plan.layer_policies(),
        batch=job_plan.plan.per_device_batch,  # the first report must be of this batch
    )
