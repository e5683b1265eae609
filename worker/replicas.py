"""The device replicas of one host and the host-side gradient sum (S1.3, the PCIe star).

Every replica's parameters and gradients are views into one flat buffer per device, so
"send the gradients to the host" is one device->host copy per device and "load the new
parameters" is one host->device copy per device. The host buffers are pinned when any
device is a GPU, so those copies run asynchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pstrain.runtime.factories import LossFn
from pstrain.runtime.layout import ParamLayout
from pstrain.worker.offload import SwapToHost, apply_layer_policies


@dataclass(frozen=True)
class MemoryPolicy:
    """The job's per-layer memory plan as the worker applies it."""

    layer_policies: dict[str, str]
    prefetch: int = 2
    pinned_limit_bytes: int = 4 << 30


@dataclass
class Replica:
    device: torch.device
    model: torch.nn.Module
    layout: ParamLayout  # the model's parameters and grads are views into the two flat buffers
    flat_params: torch.Tensor
    flat_grads: torch.Tensor
    staging: torch.Tensor  # host buffer the gradients land in (the flat grads themselves on CPU)
    offload: SwapToHost | None = None  # swap-out of saved activations, per the job's memory plan

    @classmethod
    def build(
        cls, model: torch.nn.Module, device: torch.device, layout: ParamLayout, pin: bool, memory: MemoryPolicy | None
    ) -> Replica:
        model = model.to(device)
        flat_params = torch.empty(layout.total, dtype=torch.float32, device=device)
        flat_grads = torch.zeros(layout.total, dtype=torch.float32, device=device)
        layout.bind(model, flat_params, flat_grads)
        pinned = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin) if device.type != "cpu" else None
        staging = flat_grads if pinned is None else pinned
        offload = None
        if memory is not None and memory.layer_policies:
            offload = SwapToHost(memory.prefetch, memory.pinned_limit_bytes).ignore_parameters(model)
            apply_layer_policies(model, memory.layer_policies, offload)
        return cls(device, model, layout, flat_params, flat_grads, staging, offload)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """One forward/backward on this device's slice; the gradient lands in ``flat_grads``."""
        self.flat_grads.zero_()
        if self.offload is not None:
            self.offload.reset()
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        self.layout.rebind_grads(self.model, self.flat_grads)
        if self.staging is not self.flat_grads:
            self.staging.copy_(self.flat_grads, non_blocking=True)
        return loss.detach()


class ReplicaSet:
    """All replicas of this host plus the host buffers the PS client reads and writes."""

    def __init__(
        self,
        build_model: Callable[[], torch.nn.Module],
        devices: list[torch.device],
        layout: ParamLayout,
        memory: MemoryPolicy | None = None,
    ):
        if not devices:
            raise ValueError("a worker needs at least one device")
        self.layout = layout
        self.devices = devices
        pin = any(d.type == "cuda" for d in devices)
        self.replicas = [Replica.build(build_model(), d, layout, pin, memory) for d in devices]
        self.host_grads = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin)
        self.host_params = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin)
        self._pool = ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="replica")

    def __len__(self) -> int:
        return len(self.replicas)

    def train(self, mode: bool = True) -> None:
        for r in self.replicas:
            r.model.train(mode)

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn) -> list[float]:
        """Run every device on its slice at once (one thread each; torch releases the GIL)."""
        if len(inputs) != len(self.replicas) or len(targets) != len(self.replicas):
            raise ValueError(f"need one input slice per device ({len(self.replicas)})")
        futures = [
            self._pool.submit(r.forward_backward, x, y, loss_fn)
            for r, x, y in zip(self.replicas, inputs, targets, strict=True)
        ]
        losses = [f.result() for f in futures]
        self._synchronize()
        return [float(loss) for loss in losses]

    def sum_gradients(self) -> torch.Tensor:
        """Sum every device's gradient into ``host_grads`` in device order (deterministic)."""
        self.host_grads.copy_(self.replicas[0].staging)
        for r in self.replicas[1:]:
            self.host_grads.add_(r.staging)
        return self.host_grads

    def load_parameters(self, flat: torch.Tensor | None = None) -> None:
        """Copy ``flat`` (default: ``host_params``) into every replica."""
        source = self.host_params if flat is None else flat
        for r in self.replicas:
            r.flat_params.copy_(source, non_blocking=True)
        self._synchronize()

    def buffers(self) -> dict[str, torch.Tensor]:
        """The first replica's buffers (e.g. BatchNorm statistics), for the exported model."""
        return {name: b.detach().cpu() for name, b in self.replicas[0].model.named_buffers()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _synchronize(self) -> None:
        for d in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)
