"""The master worker's probe: one real iteration, and the memory it really took (SPEC S2.1).

On CUDA the device figure is ``torch.cuda.max_memory_allocated`` (max over the worker's GPUs)
and an iterative trial runs under ``set_per_process_memory_fraction``; an out-of-memory error
counts as full utilisation. On CPU stand-in devices the device figure is the growth of the
process's peak resident memory during the iteration. The host figure is the peak RSS.

Before its first probe the master also profiles the model per layer on its first device with the
planner's own profiler (``device_profile``, issue 10): the coordinator re-plans swap/recompute and
the batch from those times instead of the ones it measured on its own CPU.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import replace

import torch

from pstrain.nn import seeded_rows
from pstrain.planner.profile_wire import profile_to_pb
from pstrain.planner.profiler import profile_model
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import LossFn, build_model
from pstrain.runtime.sparse_rows import TableSpec
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.row_store import HostRowStore

DEFAULT_PROFILE_BATCHES = (4, 8)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_probe(
    replicas: ReplicaSet,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    limit_bytes: int = 0,
    rows: HostRowStore | None = None,
) -> tuple[int, int]:
    """One forward/backward on every device; returns (device peak bytes, host peak bytes).

    ``rows`` (a job with sparse tables, issue 9): the host's row store, which binds the batch's rows
    (from the seeded init: ``row_store.probe_row_store``) and sums their gradients as a step does.
    """
    cuda = sorted({d for d in replicas.devices if d.type == "cuda"}, key=lambda d: d.index or 0)
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
        if limit_bytes:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, limit_bytes / torch.cuda.get_device_properties(d).total_memory), d
            )
    before = _rss_bytes()
    devices = len(replicas)
    try:
        if rows is not None:
            rows.prepare(0, list(inputs.chunk(devices)))
        replicas.forward_backward(list(inputs.chunk(devices)), list(targets.chunk(devices)), loss_fn)
        if rows is not None:
            rows.gradients()
        out_of_memory = False
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    finally:
        if rows is not None:
            rows.release()
        for d in cuda:
            if limit_bytes:
                torch.cuda.set_per_process_memory_fraction(1.0, d)
    host_peak = _peak_rss_bytes()
    if cuda:
        device_peak = limit_bytes if out_of_memory else max(torch.cuda.max_memory_allocated(d) for d in cuda)
        torch.cuda.empty_cache()
    else:
        device_peak = max(0, host_peak - before)
    return device_peak, host_peak


def device_profile(
    job: pb.JobSpec,
    device: torch.device,
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
) -> pb.DeviceProfile:
    """The planner's per-layer profile of the job's model on ``device`` (a fresh model: the replicas stay as built).

    The layers are the plan's (``job.profile_blocks``) at the plan's two batch sizes; a job with sparse
    tables binds each batch's rows from the seeded init, as the coordinator's profile does.
    """
    batches = tuple(job.profile_batches) if len(job.profile_batches) == 2 else DEFAULT_PROFILE_BATCHES
    model = build_model(job.model_factory, job.model_kwargs_json)
    tables = [TableSpec.from_pb(t) for t in job.embeddings]
    try:
        with seeded_rows(model, tables):
            profile = profile_model(model, sample, loss_fn, (batches[0], batches[1]), list(job.profile_blocks), device)
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return profile_to_pb(replace(profile, device_total_bytes=total))
