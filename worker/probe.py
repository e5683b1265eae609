"""The master worker's probe: one real iteration, and the memory it really took (SPEC S2.1).

On CUDA the device figure is ``torch.cuda.max_memory_allocated`` (max over the worker's GPUs)
and an iterative trial runs under ``set_per_process_memory_fraction``; an out-of-memory error
counts as full utilisation. On CPU stand-in devices the device figure is the growth of the
process's peak resident memory during the iteration. The host figure is the peak RSS.
"""

from __future__ import annotations

import resource

import torch

from pstrain.runtime.factories import LossFn
from pstrain.worker.replicas import ReplicaSet


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_probe(
    replicas: ReplicaSet, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, limit_bytes: int = 0
) -> tuple[int, int]:
    """One forward/backward on every device; returns (device peak bytes, host peak bytes)."""
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
        replicas.forward_backward(list(inputs.chunk(devices)), list(targets.chunk(devices)), loss_fn)
        out_of_memory = False
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    finally:
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
