"""Which devices a worker drives. On a host without GPUs, CPU replicas stand in for them."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class DeviceError(ValueError):
    """The devices asked for do not exist on this host."""


def resolve_devices(explicit: list[str], count: int) -> list[torch.device]:
    """``explicit`` (e.g. ["cuda:0", "cuda:1"]) wins; else ``count`` GPUs, or CPU stand-ins."""
    if explicit:
        devices = [torch.device(d) for d in explicit]
        for d in devices:
            if d.type == "cuda":
                if not torch.cuda.is_available():
                    raise DeviceError(f"{d} requested but CUDA is not available on this host")
                if (d.index or 0) >= torch.cuda.device_count():
                    raise DeviceError(f"{d} requested but this host has {torch.cuda.device_count()} GPU(s)")
            elif d.type != "cpu":
                raise DeviceError(f"unsupported device {d}; use cuda:N or cpu")
        return devices
    if count < 1:
        raise DeviceError(f"devices_per_worker must be at least 1, got {count}")
    if torch.cuda.is_available():
        if torch.cuda.device_count() < count:
            raise DeviceError(f"devices_per_worker is {count} but this host has {torch.cuda.device_count()} GPU(s)")
        return [torch.device("cuda", i) for i in range(count)]
    log.info("no CUDA on this host: %d CPU replica(s) stand in for GPUs", count)
    return [torch.device("cpu")] * count
