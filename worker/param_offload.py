"""Whole-layer offload (SPEC S1.4 in full, ``memory.offload_params``): parameters live on the host.

Activation swap (``worker.offload``) moves saved activations out; this moves everything else a
layer does not need right now. Between steps and between layers a replica's parameters and
gradients are views into two flat HOST buffers (pinned on a GPU host), the same buffers the
worker's push reads and its pull writes, so the device holds about one layer's worth:

* forward: a layer's forward pre-hook brings its parameters to the device (waiting for a copy
  the previous layer prefetched) and starts copying the next ``prefetch`` layers' on a side
  stream; its forward hook points the parameters back at the host. Parameters that autograd
  saves for backward are packed as a reference, not kept on the device.
* backward: a hook on the layer's output fires when the gradient reaches the layer, before its
  backward runs: it brings the parameters back (and prefetches the layers backward reaches
  next). As soon as a parameter's gradient is accumulated, it goes into the HOST-SUM buffer
  (``HostGradSum``: the buffer the push reads) and is dropped from the device.

One host copy per host, not per device: every replica of a host binds its parameters to the same
host parameter buffer (the pull writes it once; the step only reads it), and every replica's
gradients are summed into the same host gradient buffer, in device order per parameter, so the
sum is bitwise the one ``ReplicaSet.sum_gradients`` makes from per-device copies. Host memory for
parameters and gradients is 2P per host instead of 2P per device.

A "layer" is a module with parameters of its own (``recurse=False``); a parameter used outside
its own module's forward (weight tying through another module) is not supported and refused.
On a CPU stand-in the same code runs with host-to-host copies, so CI checks that training with
offload is bitwise identical to training without (``tests/test_param_offload.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.model_refusal import ModelUnsupported
from pstrain.worker.offload import SwapToHost


@dataclass
class ParamOffloadStats:
    fetched_bytes: int = 0  # host -> device parameter copies, forward and backward
    grad_bytes: int = 0  # device -> host gradient copies
    prefetched: int = 0  # layers whose copy started ahead of their need


@dataclass
class _Layer:
    index: int
    module: nn.Module
    params: list[nn.Parameter]
    host: list[torch.Tensor]  # each parameter's view of the host flat buffer
    grads: list[torch.Tensor]  # each parameter's view of the host gradient buffer
    positions: list[int]  # each parameter's position in the layout
    on_device: list[torch.Tensor] | None = None
    ready: Any = None  # CUDA event of the copy in flight
    saved: dict[int, int] = field(default_factory=dict)  # device storage ptr -> parameter position


@dataclass(frozen=True)
class _Activation:
    """What a layer's pack hook returns for an activation ``SwapToHost.take`` sent to the host or shares."""

    packed: Any


PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)
"""Modules never called: their parent reads their tensors, so their parameters are the parent's (a pre-hook of the
parent's, not of theirs, runs before those tensors are read)."""

CHILDREN_READ_BY_PARENT: dict[type[nn.Module], tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}
"""Children whose parameters their parent's forward reads without calling them: ``nn.MultiheadAttention`` (and so
every ``nn.Transformer*Layer``) hands ``out_proj.weight`` to ``F.multi_head_attention_forward``. Their parameters are
the parent's too; else whole-layer offload never brought them to the device (a device mismatch on a GPU)."""


def children_read_by(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of ``module`` whose parameters ``module``'s forward reads itself (see the two tables above)."""
    named = dict(module.named_children())
    read: list[tuple[str, nn.Module]] = [(n, c) for n, c in named.items() if isinstance(c, PARAMETER_CONTAINERS)]
    for kind, names in CHILDREN_READ_BY_PARENT.items():
        if isinstance(module, kind):
            read += [(name, named[name]) for name in names if name in named and (name, named[name]) not in read]
    return read


class HostGradSum:
    """The host gradient buffer every offloaded replica of a host sums into, in device order per parameter.

    Device ``i`` adds parameter ``j``'s gradient of its ``k``-th step once the counter of ``j`` reads
    ``k * devices + i`` (device 0 copies, so no zeroing is needed between steps); counters only grow,
    so nothing is reset between steps. A parameter without a gradient on a device (unused in the
    step) is passed by ``finish`` at the end of that device's backward.
    """

    def __init__(self, flat_grads: torch.Tensor, params: int, devices: int) -> None:
        self.flat = flat_grads
        self.devices = devices
        self._done = [0] * params
        self._turn = threading.Condition()
        self._failed: str | None = None  # another device's step failed: its turns will never come

    def abort(self, why: str) -> None:
        """A device's forward or backward raised: the devices waiting for its turns raise instead of waiting."""
        with self._turn:
            if self._failed is None:  # the first failure; the others are its consequence
                self._failed = why
            self._turn.notify_all()

    def add(self, device: int, step: int, param: int, target: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Put ``grad`` (None: no gradient) into ``target``, the host view of parameter ``param``, in turn."""
        with self._turn:
            turn = step * self.devices + device
            if not self._turn.wait_for(lambda: self._failed is not None or self._done[param] == turn, timeout=600.0):
                raise RuntimeError(f"device {device} waited 10 min for its turn to sum parameter {param}")
            if self._failed is not None:
                raise RuntimeError(f"device {device} stops summing parameter {param}: {self._failed}")
        if grad is None:
            if device == 0:
                target.zero_()
        elif grad.is_sparse:  # nn.Embedding(sparse=True): no dense copy of it on the device; added where it has rows
            if device == 0:
                target.zero_()
            target.add_(grad.to("cpu"))
        elif device == 0:
            target.copy_(grad)
        elif grad.device.type == "cpu":
            target.add_(grad)
        else:
            target.add_(grad.to("cpu"))  # the same CPU addition as sum_gradients' (bitwise equal)
        with self._turn:
            self._done[param] += 1
            self._turn.notify_all()


class ParamOffload:
    """Hooks that keep a model's parameters on the host except while their layer computes."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        layout: ParamLayout,
        prefetch: int = 1,
        grad_sum: HostGradSum | None = None,
        device_index: int = 0,
    ) -> None:
        self.device = device
        self.grad_sum = grad_sum
        self.device_index = device_index
        self._steps = 0  # backward passes finished (this device's step count for ``grad_sum``)
        self._summed: set[int] = set()  # parameter positions this step's gradient went into ``grad_sum``
        # Called with a layer's layout positions before its host values are read: per-bucket pulls
        # (S4, ``ReplicaSet.attach``) make it wait until the new values have landed in the host buffer.
        self.before_fetch: Callable[[list[int]], None] | None = None
        self.prefetch = max(0, prefetch)
        self.stats = ParamOffloadStats()
        self._stream: torch.cuda.Stream | None = None
        self._layout = layout
        self._model = model
        self._layers: list[_Layer] = []
        self._handles: list[Any] = []
        self._contexts: dict[int, list[Any]] = {}  # layer index -> saved-tensor hook contexts entered in forward
        # Activation swap (``worker.offload``) when the plan has swap layers. A layer's own hooks are the
        # innermost, so every activation it saves passes through here and goes on to ``SwapToHost.take``:
        # swapped inside a swap layer (or a block marked swap), shared if a swap layer already sent it.
        self.activations: SwapToHost | None = None

    # ------------------------------------------------------------------ set-up

    def install(self, flat_params: torch.Tensor, flat_grads: torch.Tensor) -> None:
        """Hook every layer; ``flat_params``/``flat_grads`` are the host buffers the parameters are bound to."""
        position = {id(p): i for i, p in enumerate(self._model.parameters())}
        seen: dict[int, str] = {}  # parameter -> the module it is a layer's of
        absorbed: set[int] = set()  # modules whose parameters are their parent's layer (children_read_by)
        for module_name, module in self._model.named_modules():
            if id(module) in absorbed:
                absorbed.update(id(m) for m in module.children())
                continue  # not called (or its tensors read directly): they are a layer of the parent's
            own = dict(module.named_parameters(recurse=False))
            for child_name, child in children_read_by(module):
                own.update((f"{child_name}.{name}", p) for name, p in child.named_parameters())
                absorbed.add(id(child))
            for name, p in own.items():
                if id(p) in seen:  # tied: the other module's forward would compute on the host copy
                    raise ModelUnsupported(
                        f"parameter {name!r} of module {module_name!r} is also a parameter of module {seen[id(p)]!r} "
                        "(tied weights): memory.offload_params brings a parameter to the device only for the forward "
                        "of the module it belongs to, so it cannot train a model that shares one between modules"
                    )
            params = list(own.values())
            if not params:
                continue
            seen.update((id(p), module_name) for p in params)
            host = [self._view(flat_params, position[id(p)]) for p in params]
            grads = [self._view(flat_grads, position[id(p)]) for p in params]
            layer = _Layer(len(self._layers), module, params, host, grads, [position[id(p)] for p in params])
            self._layers.append(layer)
            self._handles += [
                module.register_forward_pre_hook(self._before_forward(layer)),
                module.register_forward_hook(self._after_forward(layer), always_call=True),  # forward may raise
            ]
            for i, p in enumerate(params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready(layer, i)))
        self._positions = len(position)
        # First among the root's pre-hooks: the root is a layer itself when it holds parameters (its own, or a
        # ParameterList's). After its layer hook, _start_step would put that layer back on the host, so its forward
        # computed on the host buffer, and the freed device copies' addresses, still in ``layer.saved``, could be
        # taken by an activation that ``_pack`` then saved as a parameter (seen: 1 run in 4 off plain PyTorch).
        self._handles.append(self._model.register_forward_pre_hook(self._start_step, prepend=True))

    def _view(self, flat: torch.Tensor, position: int) -> torch.Tensor:
        offset, shape = self._layout.offsets[position], self._layout.shapes[position]
        return flat[offset : offset + int(torch.Size(shape).numel())].view(shape)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ copies

    def finish_step(self) -> None:
        """End of this device's backward: pass the parameters that got no gradient, count the step, and point every
        layer back at the host buffer. A layer whose backward fetched it but left a parameter without a gradient,
        or one prefetched for a backward that never reached it (behind a ``detach``), still holds a device copy;
        ``_fetch`` would reuse that copy in the next forward, which would then compute on this step's parameters
        instead of the ones the pull brings."""
        if self.grad_sum is not None:
            for layer in self._layers:
                for position, target in zip(layer.positions, layer.grads, strict=True):
                    if position not in self._summed:
                        self.grad_sum.add(self.device_index, self._steps, position, target, None)
        for layer in self._layers:
            if layer.on_device is not None:
                self._release(layer)
            layer.ready = None
        self._summed = set()
        self._steps += 1

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _fetch(self, layer: _Layer, prefetch: bool = False) -> None:
        """Start copying ``layer``'s parameters to the device (no-op if they are there or on their way)."""
        if layer.on_device is not None:
            return
        if self.before_fetch is not None:
            self.before_fetch(layer.positions)
        if self.device.type == "cuda":
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                layer.on_device = [h.to(self.device, non_blocking=True) for h in layer.host]
                layer.ready = torch.cuda.Event()
                layer.ready.record(stream)
        else:
            layer.on_device = [h.clone() for h in layer.host]  # a CPU stand-in: same path, host copies
        self.stats.fetched_bytes += sum(h.numel() * h.element_size() for h in layer.host)
        self.stats.prefetched += int(prefetch)

    def _use(self, layer: _Layer) -> list[torch.Tensor]:
        """Wait for ``layer``'s copy on the compute stream and point its parameters at the device copies."""
        self._fetch(layer)
        assert layer.on_device is not None
        if layer.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(layer.ready)
            for t in layer.on_device:
                t.record_stream(current)
            layer.ready = None
        for p, t in zip(layer.params, layer.on_device, strict=True):
            p.data = t
        layer.saved = {t.untyped_storage().data_ptr(): i for i, t in enumerate(layer.on_device)}
        return layer.on_device

    def _release(self, layer: _Layer) -> None:
        for p, h in zip(layer.params, layer.host, strict=True):
            p.data = h
        layer.on_device = None
        layer.saved = {}  # the device copies' addresses are free for other tensors now

    # ------------------------------------------------------------------ hooks

    def _start_step(self, module: nn.Module, args: object) -> None:
        for layer in self._layers:
            if layer.on_device is not None:  # a step that ended before backward (a non-finite loss): see finish_step
                self._release(layer)
            layer.ready = None
            for p in layer.params:
                p.grad = None  # gradients are written straight into the host buffer (zeroed by the replica)

    def _before_forward(self, layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            # The context first: if a copy below raises, the forward hook (always called) still has it to exit
            # and points the parameters back at the host (a copy left on the device would be stale next step).
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack(layer), self._unpack(layer))
            ctx.__enter__()
            self._contexts.setdefault(layer.index, []).append(ctx)
            self._use(layer)
            for ahead in self._layers[layer.index + 1 : layer.index + 1 + self.prefetch]:
                self._fetch(ahead, prefetch=True)

        return hook

    def _after_forward(self, layer: _Layer) -> Callable[..., Any]:
        def hook(module: nn.Module, args: object, output: Any) -> Any:
            try:
                self._exit_context(layer)
            finally:
                self._release(layer)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._before_backward(layer))
                        break
            return None

        return hook

    def _exit_context(self, layer: _Layer) -> None:
        self._contexts[layer.index].pop().__exit__(None, None, None)

    def _before_backward(self, layer: _Layer) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._use(layer)
            for behind in reversed(self._layers[max(0, layer.index - self.prefetch) : layer.index]):
                self._fetch(behind, prefetch=True)

        return hook

    def _pack(self, layer: _Layer) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            if tensor.layout != torch.strided:  # a sparse tensor has no storage to look up: kept as it is
                return tensor
            i = layer.saved.get(tensor.untyped_storage().data_ptr())
            if i is None:  # an activation
                taken = tensor if self.activations is None else self.activations.take(tensor)
                return taken if taken is tensor else _Activation(taken)
            return (i, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))

        return pack

    def _unpack(self, layer: _Layer) -> Callable[[Any], torch.Tensor]:
        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            if isinstance(packed, _Activation):
                assert self.activations is not None
                return self.activations.unpack(packed.packed)
            i, offset, shape, stride = packed
            on_device = layer.on_device if layer.on_device is not None else self._use(layer)
            return on_device[i].as_strided(shape, stride, offset)

        return unpack

    def _grad_ready(self, layer: _Layer, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            target = layer.grads[i]
            if layer.positions[i] in self._summed:  # it would wait (10 min) for a turn it has already had
                name = self._layout.names[layer.positions[i]]
                raise ModelUnsupported(
                    f"parameter {name!r} got a gradient twice in one backward: a parameter used in several reentrant "
                    "backward passes (torch.utils.checkpoint with use_reentrant=True around a module that runs more "
                    "than once) cannot be offloaded; use use_reentrant=False"
                )
            if self.grad_sum is not None:
                self.grad_sum.add(self.device_index, self._steps, layer.positions[i], target, grad)
                self._summed.add(layer.positions[i])
            elif grad.device.type == "cuda":
                stream = self._side_stream()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    target.copy_(grad, non_blocking=True)
                grad.record_stream(stream)
            else:
                target.copy_(grad)
            self.stats.grad_bytes += grad.numel() * grad.element_size()
            param.grad = None
            param.data = layer.host[i]
            done = zip(layer.params, layer.host, strict=True)
            if all(p.grad is None and p.data.data_ptr() == h.data_ptr() for p, h in done):
                layer.on_device = None  # the layer's backward is done with its parameters

        return hook


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def offload_layers(
    model: nn.Module,
    device: torch.device,
    layout: ParamLayout,
    pin: bool,
    prefetch: int,
    shared: tuple[torch.Tensor, HostGradSum, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ParamOffload]:
    """Bind ``model``'s parameters and gradients to host buffers and hook it (``worker.replicas`` calls it).

    Buffers (BatchNorm statistics) go to the device; parameters stay on the host. ``shared`` is the
    host's parameter buffer, gradient sum and this device's index when the host has several
    replicas; without it the replica gets buffers of its own (pinned when ``pin``). Returns the host
    parameter and gradient buffers and the installed offload.
    """
    for name, buffer in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        setattr(owner, attr, buffer.to(device))
    if shared is None:
        flat_params = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin)
        grad_sum = HostGradSum(torch.zeros(layout.total, dtype=torch.float32, pin_memory=pin), len(layout.offsets), 1)
        index = 0
    else:
        flat_params, grad_sum, index = shared
    flat_grads = grad_sum.flat
    if index == 0:
        layout.bind(model, flat_params, flat_grads)
    else:  # the first replica wrote the initial values; the pull overwrites them anyway
        for param, value, grad in zip(
            model.parameters(), layout.views(flat_params), layout.views(flat_grads), strict=True
        ):
            param.data = value
            param.grad = grad
    offload = ParamOffload(model, device, layout, prefetch, grad_sum, index)
    offload.install(flat_params, flat_grads)
    return flat_params, flat_grads, offload
