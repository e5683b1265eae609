"""The shard's torch.optim optimizer: built from the job's wire spec, stepped on the device mean.

The registry (``pstrain.runtime.optimizers``) owns the optimizers; this module only reads the
options off ``pb.OptimizerSpec`` and turns an unknown name into the shard's ``InvalidArgument``.
The coordinator has validated the options against the registry before the spec was sent.

It also holds the two things that make a shard's update fast (``bench/update.py``): the step
on the mean gradient with the division folded into the fused kernel, and the shard process's
intra-op thread count.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.ps_server.layerwise import Layers, build_layerwise
from pstrain.runtime.optimizers import OPTIMIZERS, UnknownOptimizer, optimizer_entry

UPDATE_THREADS_MAX = 4
"""Most intra-op threads a shard uses; see ``update_threads``."""


def spec_options(spec: pb.OptimizerSpec) -> dict[str, Any]:
    """Every option the wire carries, under its job-file key; an entry reads the ones it takes."""
    return {
        "momentum": spec.momentum,
        "dampening": spec.dampening,
        "nesterov": spec.nesterov,
        "weight_decay": spec.weight_decay,
        "betas": (spec.beta1, spec.beta2),
        "eps": spec.eps,
        "trust_coefficient": spec.trust_coefficient,
        "exclude_1d": spec.exclude_1d if spec.HasField("exclude_1d") else True,
    }


def build_optimizer(
    param: torch.nn.Parameter, spec: pb.OptimizerSpec, lr: float, layers: Layers | None = None
) -> torch.optim.Optimizer:
    """The registry's optimizer over ``param``; a layer-wise one (LARS, LAMB) also needs the slice's ``layers``."""
    try:
        entry = optimizer_entry(spec.name.lower())
    except UnknownOptimizer:
        raise InvalidArgument(f"unsupported optimizer {spec.name!r}; use one of {', '.join(OPTIMIZERS)}") from None
    if entry.layerwise:
        return build_layerwise(param, entry.name, lr, spec_options(spec), layers)
    return entry.build(param, lr, spec_options(spec))


def step_on_mean(optimizer: torch.optim.Optimizer, devices: int) -> None:
    """One step on the mean gradient, where each parameter's ``.grad`` holds the sum over ``devices``.

    A fused optimizer divides as it reads the gradient: its ``grad_scale`` attribute is the hook
    ``torch.amp.GradScaler`` uses to unscale, and dividing by the device count is the same
    operation (bit-for-bit ``grad.div_(devices)`` followed by the step), so the mean costs no
    pass of its own. An optimizer that is not fused (state loaded from a checkpoint written
    before the registry asked for fused kernels) divides in a separate pass first. Either way
    ``.grad`` holds the mean afterwards: the fused kernel stores the divided value back.
    """
    if devices < 1:
        raise ValueError(f"the gradient is a sum over at least one device, got {devices}")
    if devices == 1:
        optimizer.step()
        return
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.grad_scale = torch.tensor(float(devices))  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                param.grad.div_(devices)
    optimizer.step()


def update_threads(cpus: int | None = None) -> int:
    """Intra-op threads for a shard process: half the CPUs it may run on, at least 1, at most 4.

    torch's default is one thread per core in every process, and a host usually runs a worker
    and one or more shards side by side: each would spin up a pool of all the cores and they
    would contend (and the shard's gRPC threads, which copy the payloads, would wait for a
    core). The update is a memory-bound elementwise pass (a few flops per 20-28 bytes), and
    a memory-bound pass stops scaling after a few threads: ``bench/update.py`` prints the
    bandwidth of ``add_`` and of the shard's steps at each thread count up to the CPUs it may use,
    the figures this cap rests on.
    ``cpus`` defaults to the CPUs this process may run on (its affinity mask, so a shard pinned
    by systemd or taskset counts only its own).
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(UPDATE_THREADS_MAX, cpus // 2))
