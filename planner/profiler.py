"""Per-layer memory and time profile of a model (SPEC S1.4-S1.5, S3.3).

For every layer (leaf module, or a user-declared block such as a transformer block) it
measures the bytes of tensors saved for backward, per sample, as the slope between two batch
sizes (so fixed costs do not pollute the per-sample figure), its parameter and gradient bytes,
the bytes of the gradient flowing into it during backward (its output size), and its forward
and backward time. Saved tensors are seen through ``torch.autograd.graph.saved_tensors_hooks``;
a storage is counted once, for the layer that saved it first, and parameters saved for backward
are not activations and are not counted.

It also measures each of a layer's inputs: its bytes, which other layer saves it for backward
first, if one does, and whether the layer saves it itself. ``torch.utils.checkpoint`` keeps a
recomputed layer's inputs from its forward to its backward, so recomputing a layer frees its saved
bytes but holds its inputs, except those a kept layer holds anyway (a Linear after a ReLU: the ReLU
saves its output, the Linear's input).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerInput:
    """One tensor a layer takes (a storage, counted once per layer): what its checkpoint would keep."""

    bytes_per_sample: float
    bytes_fixed: float = 0.0
    saved_by: str = ""  # the other layer that saved it for backward first ("": none, or this layer)
    saved_here: bool = False  # this layer saves it too: kept, it holds it while ``saved_by`` recomputes
    storage: int = -1  # the same number for every layer's input on one storage (a view, a fan-out); -1: unknown

    def nbytes(self, batch: int) -> float:
        return self.bytes_fixed + self.bytes_per_sample * batch


@dataclass(frozen=True)
class LayerProfile:
    name: str
    param_bytes: int
    saved_bytes_per_sample: float  # tensors saved for backward, per sample
    saved_bytes_fixed: float  # the batch-independent part of the same
    output_bytes_per_sample: float  # the gradient buffer backward allocates for this layer's output
    forward_s: float  # at the profile's reference batch
    backward_s: float
    inputs: tuple[LayerInput, ...] = ()  # what ``torch.utils.checkpoint`` keeps while the layer recomputes

    def saved_bytes(self, batch: int) -> float:
        return self.saved_bytes_fixed + self.saved_bytes_per_sample * batch

    def input_bytes(self, batch: int) -> float:
        return sum(each.nbytes(batch) for each in self.inputs)


UNPROFILED_SHARE = 0.1
"""The share of a profile's bytes that may belong to no layer before the plan warns (``ModelProfile.unprofiled``):
a few bytes a model's own forward saves between its layers are no reason to (the plan counts them either way)."""


@dataclass(frozen=True)
class ModelProfile:
    layers: tuple[LayerProfile, ...]
    batch: int  # the reference batch the times were measured at
    device: str
    device_total_bytes: int = 0  # the device's memory when known (a worker's GPU); 0 for a CPU
    host_total_bytes: int = 0  # the memory of the host that profiled, for offload, when it says (0: unknown)
    # What no profiled layer holds, so no policy can swap or recompute it (the plan counts it as kept, and
    # ``unprofiled`` says when it is much): the parameters of modules that are neither layers nor inside one (a
    # non-leaf module's own ``nn.Parameter``), and the bytes saved for backward while no layer ran (a parent's
    # ``forward`` computing between its children), per sample and fixed as a layer's.
    unprofiled_param_bytes: int = 0
    unprofiled_saved_per_sample: float = 0.0
    unprofiled_saved_fixed: float = 0.0

    @property
    def param_bytes(self) -> int:
        """The parameters of the profiled layers (the ones a policy can move)."""
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def total_param_bytes(self) -> int:
        """Every trained parameter: the layers' and those of modules that are not layers."""
        return self.param_bytes + self.unprofiled_param_bytes

    def saved_bytes(self, batch: int) -> float:
        return sum(layer.saved_bytes(batch) for layer in self.layers)

    def unprofiled_saved(self, batch: int) -> float:
        return self.unprofiled_saved_fixed + self.unprofiled_saved_per_sample * batch

    def step_s(self) -> float:
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)

    def largest_layer(self) -> LayerProfile:
        return max(self.layers, key=lambda layer: layer.saved_bytes_per_sample)

    def unprofiled(self, share: float = UNPROFILED_SHARE) -> str:
        """What no layer holds and how to make it plannable, or "" while that is below ``share`` of the bytes the
        profile holds at its reference batch (parameters and saved tensors)."""
        saved = round(self.unprofiled_saved(self.batch))
        missed = self.unprofiled_param_bytes + saved
        if missed <= share * (self.param_bytes + self.saved_bytes(self.batch) + missed):
            return ""
        parts = []
        if self.unprofiled_param_bytes:
            parts.append(f"{self.unprofiled_param_bytes} B of parameters owned by modules that are not layers")
        if saved:
            parts.append(f"{saved} B saved for backward at batch {self.batch} outside every layer's forward")
        return (
            "the per-layer profile misses " + " and ".join(parts) + ": the memory plan counts them as kept, since no "
            "policy can swap or recompute what belongs to no layer, so the batch is smaller than it could be: name "
            "the modules that compute in their own forward (attention written inline, a positional nn.Parameter) in "
            "memory.blocks (the model itself cannot be one), or check the batch with memory.probe: true"
        )


@dataclass
class _Tracker:
    """Attributes saved tensors and times to the layer currently running."""

    param_ptrs: set[int]
    current: list[str] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    forward_s: dict[str, float] = field(default_factory=dict)
    backward_s: dict[str, float] = field(default_factory=dict)
    seen_storages: set[int] = field(default_factory=set)
    started: dict[str, float] = field(default_factory=dict)
    outside: int = 0  # bytes saved while no layer ran (between layers, in a parent's own forward, in the loss)
    owner: dict[int, str] = field(default_factory=dict)  # storage -> the layer that saved it first ("": none ran)
    inputs: dict[str, dict[int, int]] = field(default_factory=dict)  # layer -> its input storages' bytes, in order
    saved_here: set[tuple[str, int]] = field(default_factory=set)  # (layer, input storage) it saves itself
    numbers: dict[int, int] = field(default_factory=dict)  # input storage -> its number, in the order first taken
    # Every input storage noted, alive until the measurement ends: a freed one's address could be reused by a
    # tensor a later layer saves, which would then pass for the owner of this layer's input.
    alive: list[torch.UntypedStorage] = field(default_factory=list)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if self.current and ptr in self.inputs.get(self.current[-1], {}):
            self.saved_here.add((self.current[-1], ptr))
        if ptr not in self.param_ptrs and ptr not in self.seen_storages:
            self.seen_storages.add(ptr)
            if self.current:
                layer = self.current[-1]
                self.saved[layer] = self.saved.get(layer, 0) + storage.nbytes()
                self.owner[ptr] = layer
            else:
                self.outside += storage.nbytes()
                self.owner[ptr] = ""
        return tensor

    def enter(self, layer: str, args: tuple[object, ...]) -> None:
        """Note the storages of ``layer``'s tensor inputs (what a checkpoint of it would keep), once per layer."""
        held = self.inputs.setdefault(layer, {})
        for arg in args:
            for tensor in arg if isinstance(arg, (tuple, list)) else (arg,):
                if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.numel():
                    storage = tensor.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr not in self.param_ptrs and ptr not in held:
                        held[ptr] = storage.nbytes()
                        self.numbers.setdefault(ptr, len(self.numbers))
                        self.alive.append(storage)
        self.current.append(layer)

    def layer_inputs(self, layer: str) -> list[tuple[int, str, bool, int]]:
        """``layer``'s inputs in argument order: (bytes, the other layer that saved it first or "", saved here,
        the storage's number)."""
        out = []
        for ptr, nbytes in self.inputs.get(layer, {}).items():
            owner = self.owner.get(ptr, "")
            out.append((nbytes, "" if owner == layer else owner, (layer, ptr) in self.saved_here, self.numbers[ptr]))
        return out


def layer_modules(model: nn.Module, blocks: Sequence[str] = ()) -> list[tuple[str, nn.Module]]:
    """The profiled layers: the named blocks, plus every leaf module outside them that has work."""
    named = dict(model.named_modules())
    missing = [b for b in blocks if b not in named]
    if missing:
        raise ValueError(f"unknown block(s) {missing}; module names look like {list(named)[1:4]}")
    layers: list[tuple[str, nn.Module]] = [(b, named[b]) for b in blocks]
    for name, module in model.named_modules():
        inside = any(name == b or name.startswith(b + ".") for b in blocks)
        if not inside and name and not list(module.children()):
            layers.append((name, module))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(layers, key=lambda item: order[item[0]])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    device: torch.device,
) -> _Tracker:
    tracker = _Tracker({p.untyped_storage().data_ptr() for p in model.parameters()})
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            _sync(device)
            tracker.enter(name, args)
            tracker.started[name] = time.perf_counter()

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            _sync(device)
            tracker.forward_s[name] = tracker.forward_s.get(name, 0.0) + time.perf_counter() - tracker.started[name]
            tracker.current.pop()
            if isinstance(output, torch.Tensor):
                tracker.outputs[name] = output.numel() * output.element_size()

        return hook

    def bw_pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_output: object) -> None:
            _sync(device)
            tracker.started["bw:" + name] = time.perf_counter()

        return hook

    def bw_post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: object, grad_output: object) -> None:
            _sync(device)
            elapsed = time.perf_counter() - tracker.started.get("bw:" + name, time.perf_counter())
            tracker.backward_s[name] = tracker.backward_s.get(name, 0.0) + elapsed

        return hook

    for name, module in layers:
        handles += [
            module.register_forward_pre_hook(pre(name)),
            module.register_forward_hook(post(name)),
            module.register_full_backward_pre_hook(bw_pre(name)),
            module.register_full_backward_hook(bw_post(name)),
        ]
    try:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            loss = loss_fn(model(inputs.to(device)), targets.to(device))
        with warnings.catch_warnings():  # the first layer's inputs need no grad; its hook still times it
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        _sync(device)
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
        tracker.alive.clear()
    return tracker


def profile_model(
    model: nn.Module,
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    batches: tuple[int, int] = (4, 8),
    blocks: Sequence[str] = (),
    device: torch.device | str = "cpu",
) -> ModelProfile:
    """Profile ``model`` on ``device``; ``sample(n)`` returns a batch of ``n`` (inputs, targets)."""
    small, large = batches
    if not 0 < small < large:
        raise ValueError(f"need two batch sizes 0 < b1 < b2, got {batches}")
    device = torch.device(device)
    model = model.to(device).train()
    layers = layer_modules(model, blocks)
    if not layers:
        raise ValueError("the model has no layers to profile")
    _measure(model, layers, *sample(small), loss_fn, device)  # warm-up: allocator, kernels, lazy init
    small_batch = sample(small)
    a = _measure(model, layers, *small_batch, loss_fn, device)
    large_batch = sample(large)
    b = _measure(model, layers, *large_batch, loss_fn, device)

    def per_sample(at_small: float, at_large: float) -> tuple[float, float]:
        """The slope between the two batches and the batch-independent rest (never negative)."""
        slope = (at_large - at_small) / (large - small)
        return slope, max(0.0, at_small - slope * small)

    def layer_inputs(name: str) -> tuple[LayerInput, ...]:
        """Each input's per-sample bytes, matched by position between the two batches; a layer that took another
        number of tensors at each (a data-dependent forward) is one input, owned by none (always counted)."""
        small_inputs, large_inputs = a.layer_inputs(name), b.layer_inputs(name)
        if len(small_inputs) != len(large_inputs):
            slope, fixed = per_sample(sum(i[0] for i in small_inputs), sum(i[0] for i in large_inputs))
            return (LayerInput(slope, fixed),) if slope or fixed else ()
        return tuple(
            LayerInput(*per_sample(at_small, at_large), saved_by, here, number)
            for (at_small, *_), (at_large, saved_by, here, number) in zip(small_inputs, large_inputs, strict=True)
        )

    profiles = []
    for name, module in layers:
        saved_slope, saved_fixed = per_sample(a.saved.get(name, 0), b.saved.get(name, 0))
        params = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        profiles.append(
            LayerProfile(
                name=name,
                param_bytes=params,
                saved_bytes_per_sample=saved_slope,
                saved_bytes_fixed=saved_fixed,
                output_bytes_per_sample=(b.outputs.get(name, 0) - a.outputs.get(name, 0)) / (large - small),
                forward_s=b.forward_s.get(name, 0.0),
                backward_s=b.backward_s.get(name, 0.0),
                inputs=layer_inputs(name),
            )
        )
    in_layers = {id(p) for _, module in layers for p in module.parameters()}
    unprofiled_params = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in in_layers
    )
    outside_slope, outside_fixed = per_sample(
        max(0, a.outside - _loss_saved_bytes(model, *small_batch, loss_fn, device)),
        max(0, b.outside - _loss_saved_bytes(model, *large_batch, loss_fn, device)),
    )
    return ModelProfile(
        tuple(profiles),
        large,
        str(device),
        unprofiled_param_bytes=unprofiled_params,
        unprofiled_saved_per_sample=max(0.0, outside_slope),
        unprofiled_saved_fixed=outside_fixed,
    )


def forward_saved_bytes(model: nn.Module, inputs: torch.Tensor) -> int:
    """What one forward of ``model`` leaves for backward: each storage saved for it once, parameters aside.

    The plan's check against the real thing: a layer that recomputes (``torch.utils.checkpoint``, non-reentrant)
    saves its inputs before its own hooks take over the layer's saved tensors, so this outer hook sees exactly what
    stays on the device until backward, whatever the layers' policies.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs)
    return sum(saved.values())


def _loss_saved_bytes(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, device: torch.device
) -> int:
    """Bytes the loss function saves for backward at this batch: outside every layer, but not the model's (the
    plan's backward temporaries cover them), so ``unprofiled_saved_*`` leave them out."""
    with torch.no_grad():
        output = model(inputs.to(device))
    output.requires_grad_(True)
    tracker = _Tracker({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        loss_fn(output, targets.to(device))
    return tracker.outside
