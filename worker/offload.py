"""Swap-out of saved activations to host memory and swap-in for backward (SPEC S1.4, S3.2).

While a layer marked "swap" runs forward, every tensor it saves for backward is copied to
host memory as soon as it is produced, on a side CUDA stream, and the device copy is let go.
Backward consumes saved tensors in reverse order, so when it asks for tensor ``i`` the hook
also starts copying ``i-1 … i-prefetch`` back on the side stream: the GPU rarely waits for a
copy it could have had earlier (``torch.autograd.graph.save_on_cpu`` neither overlaps nor
prefetches). Pinned host memory is capped; past the cap the hook falls back to pageable
memory deliberately, with one warning. A host copy lives as long as the graph that saved it (freed when
backward frees the graph, kept for a retained one). On a CPU "device" the very same code runs (the copies
are host-to-host), so CI exercises it.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT_PINNED_LIMIT_BYTES = 4 << 30

# device, storage address, offset, shape, stride, dtype, version: one live tensor saved more than once
_Key = tuple[torch.device, int, int, tuple[int, ...], tuple[int, ...], torch.dtype, int]


@dataclass(eq=False)
class _Saved:
    host: torch.Tensor
    device: torch.device
    on_device: torch.Tensor | None = None  # the original until its copy is done, or the prefetched copy
    ready: torch.cuda.Event | None = None
    uses: int = 1  # how many saved slots refer to this tensor: each backward unpacks every one of them once
    left: int = 1  # slots this backward has yet to unpack; the device copy stays until the last
    done: bool = False  # this backward unpacked every slot: not prefetched again (a retained graph's next one may)
    expanded: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # shape, stride over the copied span (_reach)


@dataclass(frozen=True, eq=False)
class _Handle:
    """What autograd holds for a swapped tensor.

    The host copy lives exactly as long as the graph's saved slots do: freed when backward frees the graph
    (held past it, pinned host memory sat idle through the gradient push and the next forward until that
    forward's ``reset``), kept for a graph retained for another backward. ``step`` is the forward's own list,
    so a graph still alive after ``reset`` prefetches its own tensors, not the next forward's.
    """

    entry: _Saved
    step: list[weakref.ref[_Saved]]
    index: int


@dataclass(frozen=True)
class _View:
    """A saved tensor that is a view of a swapped one (a 3-D input a Linear reshapes to 2-D, a flatten)."""

    handle: _Handle
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class OffloadStats:
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    prefetched: int = 0
    pageable_fallbacks: int = 0
    resident_bytes: int = 0  # saved-tensor bytes this hook holds on the device right now
    peak_resident_bytes: int = 0
    forward_peak_resident_bytes: int = 0


@dataclass
class SwapToHost:
    """``saved_tensors_hooks`` pair that keeps saved activations in host memory between passes."""

    prefetch: int = 2
    pinned_limit_bytes: int = DEFAULT_PINNED_LIMIT_BYTES
    min_bytes: int = 0  # tensors smaller than this stay where they are
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self) -> None:
        self._saved: list[weakref.ref[_Saved]] = []  # this forward's swapped tensors, alive while its graph is
        # Dedupe of a tensor saved twice. A hit counts only while the first tensor is alive: once
        # it is freed, the allocator may give its address to a new tensor of the same shape.
        self._by_key: dict[_Key, tuple[int, Any]] = {}
        # Swapped tensors that cover their whole storage, by address: a view of one is rebuilt from its copy.
        # The value holds the tensor's root (the tensor a view of it has as ``_base``) and its version.
        self._whole: dict[tuple[torch.device, int, torch.dtype], tuple[int, weakref.ref[torch.Tensor], int]] = {}
        self._swapping = 0  # how many swap layers' forwards are running (``take`` packs inside one)
        self._pinned_bytes = 0
        self._warned = False
        self._stream: torch.cuda.Stream | None = None
        self._in_flight: deque[_Saved] = deque()  # device->host copies not yet known to be done
        self._param_ptrs: set[int] = set()
        self._in_forward = True

    # -------------------------------------------------------------- set-up

    def ignore_parameters(self, model: nn.Module) -> SwapToHost:
        """Parameters are saved for backward too, but they live on the device anyway."""
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return self

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """The hooks a swap layer runs its forward in."""
        self._swapping += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._swapping -= 1

    def follower_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks for the layers that keep their tensors (``follow``); a swap layer's own ``hooks`` nest inside."""
        return torch.autograd.graph.saved_tensors_hooks(self.follow, self.unpack)

    def reset(self) -> None:
        """Forget the last step's tensors; call before each forward."""
        self._saved = []  # a new list: a graph of an earlier forward that is still alive keeps its own
        self._by_key.clear()
        self._whole.clear()
        self._in_flight.clear()
        self._pinned_bytes = 0
        self._in_forward = True
        self.stats.resident_bytes = 0

    # -------------------------------------------------------------- forward

    @staticmethod
    def _key(tensor: torch.Tensor) -> _Key:
        storage_ptr = tensor.untyped_storage().data_ptr()
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        return tensor.device, storage_ptr, int(tensor.storage_offset()), shape, stride, tensor.dtype, tensor._version

    def _shared(self, tensor: torch.Tensor) -> _Handle | _View | None:
        """The live tensor already on its way to the host that ``tensor`` is, or views, counted once more.

        A hit counts only while the swapped tensor is alive: once it is freed, the allocator may give
        its address to a new tensor.
        """
        if not _shareable(tensor):
            return None
        hit = self._by_key.get(self._key(tensor))
        if hit is not None and hit[1]() is not None:
            handle = self._use_again(hit[0])
            if handle is not None:
                return handle
        whole = self._whole.get((tensor.device, tensor.untyped_storage().data_ptr(), tensor.dtype))
        if whole is None or whole[1]() is not _root(tensor) or whole[2] != tensor._version:
            return None  # not a view of it (an alias made with ``set_``), or it changed in place since
        handle = self._use_again(whole[0])
        if handle is None:
            return None
        return _View(handle, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))

    def _use_again(self, index: int) -> _Handle | None:
        """One more slot on swapped tensor ``index``; None if the graph that saved it is gone (its copy with it)."""
        entry = self._saved[index]()
        if entry is None:
            return None
        entry.uses += 1
        entry.left += 1
        return _Handle(entry, self._saved, index)

    def take(self, tensor: torch.Tensor) -> Any:
        """``pack`` inside a swap layer's forward, ``follow`` outside: for hooks that sit inside both."""
        return self.pack(tensor) if self._swapping else self.follow(tensor)

    def follow(self, tensor: torch.Tensor) -> Any:
        """``pack`` for a layer that keeps its tensors: one a swap layer already sent to the host is shared.

        A ReLU marked "swap" saves its output, and the next Linear, kept, saves the same tensor (or, for
        a 3-D input, a 2-D view of it) as its input. Kept as is, that reference held the device copy for
        backward and the swap freed nothing (seen on an H100: the planned batch ran out of memory). The
        profile counts a tensor for the layer that saves it first, so only the savers after a swap
        layer must follow it.
        """
        shared = self._shared(tensor)
        return tensor if shared is None else shared

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.layout != torch.strided:  # sparse tensors have no storage of their own to copy
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._param_ptrs or nbytes < self.min_bytes:
            return tensor
        shared = self._shared(tensor)  # the same live tensor (or a view of it) saved twice: one copy
        if shared is not None:
            return shared
        source, expanded = _reach(tensor)
        copied = source.numel() * source.element_size()
        host = self._host_buffer(source)
        entry = _Saved(host, tensor.device, expanded=expanded)
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(stream)
            tensor.record_stream(stream)
            entry.on_device = source  # held until the copy is known to be done
            self._in_flight.append(entry)
            self._track(copied)
        else:
            host.copy_(source)
        self.stats.swapped_out_bytes += copied
        self._saved.append(weakref.ref(entry))
        index = len(self._saved) - 1
        if _shareable(tensor):  # a conjugate copy must not stand in for the tensor it views, nor the reverse
            self._by_key[self._key(tensor)] = (index, weakref.ref(tensor))
            if tensor.is_contiguous() and tensor.storage_offset() == 0 and nbytes == storage.nbytes():
                where = (tensor.device, storage.data_ptr(), tensor.dtype)
                self._whole[where] = (index, weakref.ref(_root(tensor)), tensor._version)
        self._release_finished_copies()
        return _Handle(entry, self._saved, index)

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        pin = tensor.device.type == "cuda" and self._pinned_bytes + nbytes <= self.pinned_limit_bytes
        if tensor.device.type == "cuda" and not pin:
            self.stats.pageable_fallbacks += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "pinned host memory for swapped activations reached its cap of %.1f GiB; "
                    "further swaps use pageable memory (slower copies)",
                    self.pinned_limit_bytes / 2**30,
                )
        if pin:
            self._pinned_bytes += nbytes
        if _dense(tensor):  # laid out as the original: a kernel given other strides may round differently
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, pin_memory=pin)
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)

    def _release_finished_copies(self, wait: bool = False) -> None:
        """Let go of device tensors whose copy to the host is done (copies finish in order)."""
        while self._in_flight:
            entry = self._in_flight[0]
            assert entry.ready is not None and entry.on_device is not None
            if wait:
                entry.ready.synchronize()
            elif not entry.ready.query():
                return
            self._track(-entry.on_device.numel() * entry.on_device.element_size())
            entry.on_device = None
            self._in_flight.popleft()

    # -------------------------------------------------------------- backward

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _View):  # the swapped tensor covered its storage: its copy is laid out the same
            return self.unpack(packed.handle).as_strided(packed.shape, packed.stride, packed.offset)
        if self._in_forward:
            self._in_forward = False
            self.stats.forward_peak_resident_bytes = self.stats.peak_resident_bytes
            self._release_finished_copies(wait=True)  # forward is over: every copy must land
        entry = packed.entry
        if entry.done:  # a retained graph's next backward: every slot is unpacked once more
            entry.done = False
        tensor = self._bring_back(entry)
        for ahead in range(packed.index - 1, max(-1, packed.index - 1 - self.prefetch), -1):
            earlier = packed.step[ahead]()
            # not one this backward is done with: nothing would let go of its device copy until the next step
            if earlier is not None and earlier.on_device is None and not earlier.done:
                self._bring_back(earlier, prefetch=True)
        if entry.ready is not None:
            torch.cuda.current_stream(entry.device).wait_event(entry.ready)
            tensor.record_stream(torch.cuda.current_stream(entry.device))
        entry.left -= 1
        if entry.left == 0:
            entry.on_device = None  # autograd owns it now; it is freed after this node's backward
            entry.left, entry.done = entry.uses, True
            if entry.device.type == "cuda":
                self._track(-tensor.numel() * tensor.element_size())
        if entry.expanded is None:
            return tensor
        shape, stride = entry.expanded
        return tensor.as_strided(shape, stride, tensor.storage_offset())

    def _bring_back(self, entry: _Saved, prefetch: bool = False) -> torch.Tensor:
        if entry.on_device is not None:
            return entry.on_device
        nbytes = entry.host.numel() * entry.host.element_size()
        if entry.device.type == "cuda":
            stream = self._side_stream(entry.device)
            with torch.cuda.stream(stream):
                tensor = entry.host.to(entry.device, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(stream)
            self._track(nbytes)
        else:
            tensor = entry.host.clone()
        entry.on_device = tensor
        self.stats.swapped_in_bytes += nbytes
        if prefetch:
            self.stats.prefetched += 1
        return tensor

    # -------------------------------------------------------------- helpers

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _track(self, delta: int) -> None:
        self.stats.resident_bytes += delta
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)


def _shareable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are its storage's as laid out, so another tensor on it can share its copy.

    A conjugate or negative view is not (the bit is applied lazily: its copy holds other values than
    the storage), nor is an empty tensor (address 0, whatever it was cut from).
    """
    return tensor.layout == torch.strided and tensor.numel() > 0 and not tensor.is_conj() and not tensor.is_neg()


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of its storage once each (any dimension order): a host buffer
    with its strides holds exactly its elements. An expanded or overlapping tensor is copied contiguous."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _reach(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """What to copy for ``tensor``, and the shape and stride that rebuild it from that copy (None: it is itself).

    An expanded tensor (a mask broadcast over the batch and heads, a gather index over the features) repeats
    a few elements many times: copying its elements one by one made host and device copies as large as the
    activation it masks, where autograd alone keeps the few. Its storage span is copied instead.
    """
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    if tensor.numel() == 0 or span >= tensor.numel():
        return tensor, None
    return tensor.as_strided((span,), (1,)), (tuple(tensor.shape), tuple(tensor.stride()))


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view of ``tensor`` names as ``_base`` (views of views share the root)."""
    return tensor if tensor._base is None else tensor._base


def apply_layer_policies(model: nn.Module, policies: dict[str, str], offload: SwapToHost) -> list[Any]:
    """Make the named layers swap (``"swap"``) or recompute (``"recompute"``) in place.

    Swap layers run their forward inside ``offload``'s hooks; recompute layers run under
    ``torch.utils.checkpoint`` (non-reentrant). When any layer swaps, the whole model runs inside
    ``offload``'s follower hooks, so a kept layer that saves a tensor a swap layer already sent to
    the host shares that copy instead of holding the device tensor. The module tree and parameter
    names do not change, so the flat parameter layout stays the same. Returns the hook handles.
    """
    named = dict(model.named_modules())
    for name, policy in policies.items():  # the whole plan is checked before any layer changes
        if name not in named:
            raise ValueError(f"the plan names layer {name!r}, which the model does not have")
        if policy not in ("keep", "swap", "recompute"):
            raise ValueError(f"unknown policy {policy!r} for layer {name!r}: use keep, swap or recompute")
    handles: list[Any] = []
    if "swap" in policies.values():
        handles += _enter_around(model, offload.follower_hooks)  # outermost: a swap layer's own hooks nest inside
    for name, policy in policies.items():
        if policy == "swap":
            handles += _swap_hooks(named[name], offload)
        elif policy == "recompute":
            _recompute(named[name])
    return handles


def _swap_hooks(module: nn.Module, offload: SwapToHost) -> list[Any]:
    return _enter_around(module, offload.hooks)


def _enter_around(module: nn.Module, hooks: Callable[[], Any]) -> list[Any]:
    """Run ``module``'s forward inside a fresh ``hooks()`` context (a stack: a module may run re-entrantly)."""
    contexts: list[Any] = []

    def enter(mod: nn.Module, args: object) -> None:
        ctx = hooks()
        ctx.__enter__()
        contexts.append(ctx)

    def leave(mod: nn.Module, args: object, output: object) -> None:  # also when forward raised (always_call)
        if contexts:  # empty only if a global pre-hook raised before ``enter`` ran
            contexts.pop().__exit__(None, None, None)

    # ``enter`` first of the module's pre-hooks: whichever of the others raises, ``leave`` has its context to exit,
    # and a swap layer's hooks are outside whole-layer offload's, whichever was installed first.
    return [
        module.register_forward_pre_hook(enter, prepend=True),
        module.register_forward_hook(leave, always_call=True),
    ]


def _recompute(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        guard = _BufferGuard(module)
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, context_fn=lambda: (guard.forward(), guard.recompute()), **kwargs
        )

    module.forward = checkpointed  # type: ignore[method-assign]


class _BufferGuard:
    """A recomputed layer's buffers (BatchNorm's running statistics, an EMA) are not changed again when backward
    recomputes it: plain PyTorch runs that forward once, so its statistics move once per step.

    The recompute puts every buffer of the layer back as the forward left it. All of them, not only those whose
    version moved: BatchNorm's kernel and writes through ``.data`` change a buffer without a version bump. Buffers
    are small next to the activations a recompute rebuilds, and a copy lives only for the recompute.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def forward(self) -> AbstractContextManager[None]:
        return nullcontext()

    @contextmanager
    def recompute(self) -> Iterator[None]:
        kept = KeptBuffers.of(self._module.modules())
        try:
            yield
        finally:
            kept.restore()


@dataclass(frozen=True)
class KeptBuffers:
    """Every buffer of some modules and a copy of its value, taken before a forward that must not move them (a
    recompute, a step that is skipped). ``restore`` puts each tensor back in its place (a forward that assigned
    a new tensor gets the old one back too) with its old value."""

    entries: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, modules: Iterable[nn.Module]) -> KeptBuffers:
        return cls([(m, name, b, b.clone()) for m in modules for name, b in m._buffers.items() if b is not None])

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buffer, value in self.entries:
                module._buffers[name] = buffer
                buffer.copy_(value)
