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
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
CUDA_SUCCESS = 0


@dataclass(frozen=True)
class HostPinning:
    """How a client page-locks a mapped region and releases it again: the CUDA runtime's calls, or a test's."""

    pin: Callable[[torch.Tensor], bool]  # True when ``tensor``'s memory is page-locked now
    unpin: Callable[[torch.Tensor], None]  # before the memory is unmapped


def cuda_pin(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return False
    error = int(
        torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            tensor.data_ptr(), tensor.numel() * tensor.element_size(), CUDA_HOST_REGISTER_PORTABLE
        )
    )
    if error != CUDA_SUCCESS:
        log.warning(
            "cannot page-lock a shared-memory region of %.1f MiB for device copies (cudaError %d): its buckets "
            "are staged and copied on the host instead",
            tensor.numel() * tensor.element_size() / 2**20,
            error,
        )
        return False
    return True


def cuda_unpin(tensor: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy into the region may still be in flight (a job stopped during backward)
    error = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))  # type: ignore[no-untyped-call]
    if error != CUDA_SUCCESS:
        log.warning("releasing a page-locked shared-memory region failed (cudaError %d)", error)


def for_devices(devices: list[torch.device]) -> HostPinning | None:
    """The CUDA runtime's pinning for a worker with exactly one GPU (whose buckets are pushed without a host sum),
    else None: several devices' gradients are summed on the host before they leave, and a CPU copies anyway."""
    if len(devices) != 1 or devices[0].type != "cuda" or not torch.cuda.is_available():
        return None
    return HostPinning(cuda_pin, cuda_unpin)
