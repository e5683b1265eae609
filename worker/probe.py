"""The master worker's probe: one real iteration, and the memory it really took (SPEC S2.1).

On CUDA the device figure is ``torch.cuda.max_memory_allocated`` (max over the worker's GPUs)
and an iterative trial runs under ``set_per_process_memory_fraction``; an out-of-memory error
counts as full utilisation; one with no limit (the first probe) is reported as more than the device
holds (``oom_device_peak``), so the coordinator shrinks the batch instead of reading a peak of 0. On
CPU stand-in devices the device figure is the growth of the process's resident memory during the
iteration, and the host figure is the iteration's peak RSS: both from ``IterationPeak``, which resets
the kernel's high-water mark first, since the process-lifetime peak (``ru_maxrss``, inherited across
fork and exec) would report an earlier, bigger probe's or the parent's peak and the shrink loop would
never converge.

Before its first probe the master also profiles the model per layer on its first device with the
planner's own profiler (``device_profile``, issue 10): the coordinator re-plans swap/recompute and
the batch from those times instead of the ones it measured on its own CPU.
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType

import torch

from pstrain.nn import seeded_rows
from pstrain.planner.profile_wire import profile_to_pb
from pstrain.planner.profiler import profile_model
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import LossFn, build_model
from pstrain.runtime.memory_trend import host_memory_for_offload
from pstrain.runtime.sparse_rows import TableSpec
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.row_store import HostRowStore

DEFAULT_PROFILE_BATCHES = (4, 8)


CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"
SAMPLE_INTERVAL_S = 0.001  # the fallback's RSS sampling period where the high-water mark cannot be reset


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _reset_high_water_mark(clear_refs: str) -> bool:
    """Reset this process's VmHWM to its current RSS (``echo 5 > /proc/self/clear_refs``); False where unsupported."""
    try:
        with open(clear_refs, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _high_water_mark_bytes(status: str) -> int | None:
    try:
        with open(status) as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class IterationPeak:
    """This process's peak resident memory while the ``with`` block runs, not over its lifetime.

    Resets the kernel's high-water mark on entry and reads ``VmHWM`` on exit; where the reset is not
    available (an older kernel, a sandbox) a thread samples RSS every ``interval_s`` instead, which
    can miss a peak shorter than the interval but never reports one from before the block.
    """

    def __init__(self, clear_refs: str = CLEAR_REFS, status: str = STATUS, interval_s: float = SAMPLE_INTERVAL_S):
        self._clear_refs = clear_refs
        self._status = status
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._lock = threading.Lock()
        self.start_bytes = 0  # RSS on entry
        self.sampled_peak = 0  # the fallback's running maximum
        self.peak_bytes = 0  # set on exit

    @property
    def resets(self) -> bool:
        """Whether the kernel's high-water mark was reset (else the RSS is sampled)."""
        return self._sampler is None

    def sample(self) -> None:
        """Take one RSS sample now (the fallback's thread calls it; also taken on entry and exit)."""
        rss = _rss_bytes()
        with self._lock:
            self.sampled_peak = max(self.sampled_peak, rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def __enter__(self) -> IterationPeak:
        self.start_bytes = _rss_bytes()
        self.sampled_peak = self.start_bytes
        if not (_reset_high_water_mark(self._clear_refs) and _high_water_mark_bytes(self._status) is not None):
            self._sampler = threading.Thread(target=self._run, name="probe-rss-sampler", daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.sample()
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self.peak_bytes = self.sampled_peak
        else:
            hwm = _high_water_mark_bytes(self._status)
            self.peak_bytes = max(self.sampled_peak, hwm or 0)

    @property
    def growth_bytes(self) -> int:
        """How far the peak rose above the RSS on entry: a CPU stand-in device's peak."""
        return max(0, self.peak_bytes - self.start_bytes)


def oom_device_peak(limit_bytes: int, allocated_peak_bytes: int, device_total_bytes: int) -> int:
    """The device peak to report for an iteration that ran out of device memory.

    Under a limit (an iterative trial, S2.2c) it is the limit: full utilisation, so the limit grows.
    With no limit (the first probe) the iteration needs more than the device has, but not how much
    more: it stopped at the allocation that failed. Twice the larger of the device's memory and what
    was allocated is unmistakably over the coordinator's budget for this device, so it shrinks the
    batch (to about half, less the margin) and probes again, where a peak of 0 would be accepted.
    """
    if limit_bytes:
        return limit_bytes
    return 2 * max(device_total_bytes, allocated_peak_bytes, 1)


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
    devices = len(replicas)
    out_of_memory = False
    with IterationPeak() as meter:
        try:
            if rows is not None:
                rows.prepare(0, list(inputs.chunk(devices)))
            replicas.forward_backward(list(inputs.chunk(devices)), list(targets.chunk(devices)), loss_fn)
            if rows is not None:
                rows.gradients()
        except torch.cuda.OutOfMemoryError:
            out_of_memory = True
        finally:
            if rows is not None:
                rows.release()
            for d in cuda:
                if limit_bytes:
                    torch.cuda.set_per_process_memory_fraction(1.0, d)
    host_peak = meter.peak_bytes
    if cuda:
        allocated = max(torch.cuda.max_memory_allocated(d) for d in cuda)
        if out_of_memory:
            total = max(torch.cuda.get_device_properties(d).total_memory for d in cuda)
            device_peak = oom_device_peak(limit_bytes, allocated, total)
        else:
            device_peak = allocated
        torch.cuda.empty_cache()
    else:
        device_peak = meter.growth_bytes
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
    host = host_memory_for_offload() or 0  # the coordinator's own host may not be this one
    return profile_to_pb(replace(profile, device_total_bytes=total, host_total_bytes=host))
