"""Page-locking host memory that torch did not allocate, so that a GPU's copies go straight into it (issue 12).

A worker with one GPU pushes each gradient bucket out of a colocated shard's push region (``runtime.shm_client``).
A copy from the GPU into pageable memory is staged by the driver through a pinned buffer of its own and holds the
calling thread. So without this the bucket would go first into the worker's pinned staging buffer, and a CPU pass
would then copy it into the region. Once the region is registered with ``cudaHostRegister``, the device-to-host
copy is one DMA into it, asynchronous on the copy stream, and the host copies nothing. torch's own
``torch.distributed`` checkpoint stager registers shared memory the same way (``torch.cuda._pin_memory_utils``).

A registration that fails (no CUDA, a driver that refuses this mapping, a memlock limit) is logged and the region
is used as before: the client copies the bucket from the staging buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
CUDA_SUCCESS = 0


@dataclass(frozen=True)
class HostPinning:
    """How a client page-locks a mapped region and releases it again: the CUDA runtime's calls, or a test's."""

    pin: Callable[[torch.Tensor], bool]  # True when ``tensor``'s memory is page-locked now
    unpin: Callable[[torch.Tensor], None]  # before the memory is unmapped


class CudaPinning:
    """``cudaHostRegister`` / ``cudaHostUnregister`` for one GPU's process, each call on a thread of its own.

    Why a thread: torch's binding returns the call's error without clearing it, and the CUDA runtime keeps it as
    that host thread's last error, which the next kernel launch on the thread would report. The first pin happens
    on the autograd thread (its first bucket asks for the regions), where that would fail backward; on a helper
    thread a refusal stays there. The helper selects the worker's GPU first, so no other GPU gets a context.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-lock ``tensor``'s memory; False (logged) where the driver refuses."""
        if tensor.numel() == 0:
            return False
        size = tensor.numel() * tensor.element_size()
        error = self._call(lambda rt: rt.cudaHostRegister(tensor.data_ptr(), size, CUDA_HOST_REGISTER_PORTABLE))
        if error != CUDA_SUCCESS:
            log.warning(
                "cannot page-lock a shared-memory region of %.1f MiB for %s's copies (cudaError %d): its buckets "
                "are staged and copied on the host instead",
                size / 2**20,
                self.device,
                error,
            )
            return False
        return True

    def unpin(self, tensor: torch.Tensor) -> None:
        """Release ``tensor``'s memory once the GPU is idle (no copy into it may be in flight); never raises, so a
        closing client goes on closing whatever else it holds."""
        try:
            torch.cuda.synchronize(self.device)
            error = self._call(lambda rt: rt.cudaHostUnregister(tensor.data_ptr()))
        except RuntimeError as exc:  # a sticky CUDA error from elsewhere: the process's exit releases the pages
            log.warning("could not release a page-locked shared-memory region: %s", exc)
            return
        if error != CUDA_SUCCESS:
            log.warning("releasing a page-locked shared-memory region failed (cudaError %d)", error)

    def _call(self, call: Callable[[Any], Any]) -> int:
        def run() -> int:
            torch.cuda.set_device(self.device)
            return int(call(torch.cuda.cudart()))

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-pin") as pool:
            return pool.submit(run).result()


def for_devices(devices: list[torch.device]) -> HostPinning | None:
    """The CUDA runtime's pinning for a worker with exactly one GPU (whose buckets are pushed without a host sum),
    else None: several devices' gradients are summed on the host before they leave, and a CPU copies anyway."""
    if len(devices) != 1 or devices[0].type != "cuda" or not torch.cuda.is_available():
        return None
    cuda = CudaPinning(torch.device("cuda", devices[0].index or 0))
    return HostPinning(cuda.pin, cuda.unpin)
