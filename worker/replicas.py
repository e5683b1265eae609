"""The device replicas of one host and the host-side gradient sum (S1.3, the PCIe star).

Every replica's parameters and gradients are views into one flat buffer per device, so
"send the gradients to the host" is one device->host copy per device and "load the new
parameters" is one host->device copy per device. The host buffers are pinned when any
device is a GPU, so those copies run asynchronously. A CPU stand-in's parameters are views of
the host parameter buffer itself, and with whole-layer offload every replica's are: for them
loading copies nothing.

With ``attach`` (S4, ``worker.overlap``) the same copies happen per gradient bucket: hooks on
every replica's parameters report each gradient as backward produces it (the bucket's
device->host copy starts when the bucket is complete on that device), and forward pre-hooks load
each bucket of new parameters just before the first module that uses it runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pstrain.runtime.buckets import Bucket, BucketPlan
from pstrain.runtime.factories import LossFn
from pstrain.runtime.layout import ParamLayout, refuse_frozen
from pstrain.runtime.model_refusal import ModelUnsupported
from pstrain.worker.offload import KeptBuffers, SwapToHost, apply_layer_policies
from pstrain.worker.overlap import BF16_ROUNDS_TO_INF, BucketLoader, BucketPusher, StagedBucket
from pstrain.worker.param_offload import HostGradSum, ParamOffload, children_read_by, offload_layers

T = TypeVar("T")


@dataclass(frozen=True)
class MemoryPolicy:
    """The job's per-layer memory plan as the worker applies it."""

    layer_policies: dict[str, str]
    prefetch: int = 2
    pinned_limit_bytes: int = 4 << 30
    offload_params: bool = False  # issue 10: whole-layer offload (worker.param_offload)


@dataclass
class Replica:
    device: torch.device
    model: torch.nn.Module
    layout: ParamLayout  # the model's parameters and grads are views into the two flat buffers
    flat_params: torch.Tensor
    flat_grads: torch.Tensor
    staging: torch.Tensor  # host buffer the gradients land in (the flat grads themselves on CPU)
    offload: SwapToHost | None = None  # swap-out of saved activations, per the job's memory plan
    param_offload: ParamOffload | None = None  # whole-layer offload: host buffers shared by the host's replicas
    copy_stream: torch.cuda.Stream | None = None  # the per-bucket gradient copies (``stage_bucket``), made lazily
    finite_flags: dict[int, torch.Tensor] | None = None  # per bucket: pinned bool[1] (stage_bucket); None: not made
    finite_below: float = math.inf  # the magnitude from which a pushed value is Inf on the shard (bfloat16: less)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        device: torch.device,
        layout: ParamLayout,
        pin: bool,
        memory: MemoryPolicy | None,
        shared: tuple[torch.Tensor, HostGradSum, int] | None = None,
        host_params: torch.Tensor | None = None,
    ) -> Replica:
        """``host_params``: the host's parameter buffer, which a CPU replica uses as its own (see ``ReplicaSet``)."""
        for name, param in model.named_parameters():  # a model that froze one after the layout was made
            refuse_frozen(name, param)
        if memory is not None and memory.offload_params:  # issue 10: parameters and gradients stay on the host
            swap = SwapToHost(memory.prefetch, memory.pinned_limit_bytes)
            apply_layer_policies(model, memory.layer_policies, swap)  # first: the parameter hooks nest inside
            flat_params, flat_grads, params = offload_layers(model, device, layout, pin, memory.prefetch, shared)
            params.activations = swap if "swap" in memory.layer_policies.values() else None
            return cls(device, model, layout, flat_params, flat_grads, flat_grads, swap, params)
        model = model.to(device)
        if device.type == "cpu" and host_params is not None:
            flat_params = host_params
        else:
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
        with self._failing_others():
            loss = self.forward(inputs, targets, loss_fn)
            self.backward(loss)
        if self.staging is not self.flat_grads:
            self.staging.copy_(self.flat_grads, non_blocking=True)
        return loss.detach()

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        if self.param_offload is None:  # with it, the gradient sum overwrites (the buffer is the host's)
            self.flat_grads.zero_()
        if self.offload is not None:
            self.offload.reset()
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        return loss_fn(self.model(inputs), targets)

    @contextlib.contextmanager
    def _failing_others(self) -> Iterator[None]:
        """With whole-layer offload the devices of a host sum each gradient in turn: if this one raises (the
        probe's out-of-memory, a user hook), the others must not wait 10 minutes for turns that never come."""
        try:
            yield
        except BaseException as exc:
            offload = self.param_offload
            if offload is not None and offload.grad_sum is not None:
                offload.grad_sum.abort(f"device {offload.device_index} failed: {type(exc).__name__}: {exc}")
            raise

    def backward(self, loss: torch.Tensor) -> None:
        with self._failing_others():
            loss.backward()
        if self.param_offload is not None:
            self.param_offload.finish_step()
        self.layout.rebind_grads(self.model, self.flat_grads)

    def load_bucket(self, source: torch.Tensor, bucket: Bucket) -> None:
        """Copy one bucket of new parameters from the host buffer ``source`` into this replica."""
        if self.flat_params.data_ptr() == source.data_ptr():
            return  # a CPU stand-in or whole-layer offload: the replica reads the host buffer itself
        with torch.no_grad():
            self.flat_params[bucket.start : bucket.end].copy_(source[bucket.start : bucket.end], non_blocking=True)

    def stage_bucket(self, bucket: Bucket, targets: Sequence[torch.Tensor | None] = ()) -> StagedBucket | None:
        """Start the device->host copy of one bucket's gradient (None on the CPU: nothing to copy).

        The copy runs on a side stream that first waits for the compute stream (the bucket's gradients are
        complete there): on the compute stream itself, backward of the layers below would wait for each bucket
        to cross PCIe. Nothing writes ``flat_grads`` again before ``backward`` synchronizes the device, and
        ``staging`` is read only after the event (the sender) or that synchronization (``sum_gradients``).
        Both buffers live as long as the replica, so the caching allocator needs no ``record_stream``.

        ``targets`` (one GPU, ``worker.overlap``): per piece of the bucket, page-locked host memory the piece is
        copied into instead of ``staging`` (None: into ``staging``): its span of a shard's push region. The shard
        reads that span for the previous step only until it publishes that step's version of the piece, which
        this step's forward waited for before the bucket's backward could begin (``BucketLoader``), so nothing
        reads a span while this copy writes it. With ``finite_flags`` (one device, whose copy is the host sum)
        the side stream also checks every value of the bucket is below ``finite_below`` (a sum could overflow,
        and under bfloat16 pushes a float32 value past bfloat16's range is Inf on the shard) and copies the
        verdict into a pinned flag, read by the sender after the event.
        """
        if targets and len(targets) != len(bucket.pieces):
            raise ValueError(f"{len(targets)} push targets for a bucket of {len(bucket.pieces)} pieces")
        if self.staging is self.flat_grads:
            return None
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        flag = None
        if self.finite_flags is not None:
            flag = self.finite_flags.get(bucket.index)
            if flag is None:
                flag = self.finite_flags[bucket.index] = torch.empty(1, dtype=torch.bool, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            grads = self.flat_grads[bucket.start : bucket.end]
            if any(t is not None for t in targets):
                for piece, target in zip(bucket.pieces, targets, strict=True):
                    into = self.staging[piece.start : piece.end] if target is None else target
                    into.copy_(self.flat_grads[piece.start : piece.end], non_blocking=True)
            else:
                self.staging[bucket.start : bucket.end].copy_(grads, non_blocking=True)
            if flag is not None:  # every value below the limit, as the shard will see them (NaN fails both)
                low, high = torch.aminmax(grads) if grads.numel() else (grads.new_zeros(()), grads.new_zeros(()))
                flag.copy_(((low > -self.finite_below) & (high < self.finite_below)).reshape(1), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return StagedBucket(event, flag, tuple(targets))


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
        gpus = [torch.device(d.type, d.index or 0) for d in devices if d.type == "cuda"]
        if memory is not None and memory.offload_params and len(set(gpus)) < len(gpus):  # config.py says it too
            raise ValueError(
                f"devices {[str(d) for d in devices]} name a GPU twice, which whole-layer offload cannot run: the "
                "replicas' backward passes would share that GPU's one autograd thread and wait on each other's turn"
            )
        self.layout = layout
        self.devices = devices
        pin = any(d.type == "cuda" for d in devices)
        self.host_grads = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin)
        self.host_params = torch.empty(layout.total, dtype=torch.float32, pin_memory=pin)
        self.shared = memory is not None and memory.offload_params  # one host copy of parameters and gradients
        grad_sum = HostGradSum(self.host_grads, len(layout.offsets), len(devices))
        # A CPU replica's parameters are views of ``host_params`` itself: the pulls write the new version where the
        # model reads it, so loading a bucket copies nothing (one pass over the model per step and device less).
        # Nothing reads a bucket's parameters while its pull writes them: the pull of step t + 1 starts only after
        # every device's backward of step t has finished with that bucket (its gradients were pushed), and the
        # next forward waits for it (``BucketLoader``) as it would to copy it.
        self.replicas = [
            Replica.build(
                build_model(),
                d,
                layout,
                pin,
                memory,
                (self.host_params, grad_sum, i) if self.shared else None,
                host_params=self.host_params,
            )
            for i, d in enumerate(devices)
        ]
        if self.places_on_device:  # one GPU: its copy of a bucket is the host sum, so its own check stands
            self.replicas[0].finite_flags = {}
        self._pool = ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="replica")
        self._hooks: list[Any] = []  # removable handles of the S4 hooks (``attach``)
        self._losses: list[torch.Tensor] = []  # from ``forward``, for ``backward``
        self._pusher: BucketPusher | None = None
        self._loader: BucketLoader | None = None

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def places_on_device(self) -> bool:
        """One GPU with a staging buffer of its own: its buckets can be copied into the shards' push regions
        (``worker.overlap``); several devices are summed on the host first, whole-layer offload sums there."""
        return len(self.replicas) == 1 and self.replicas[0].staging is not self.replicas[0].flat_grads

    @property
    def staging(self) -> list[torch.Tensor]:
        """The host buffers the gradient sum reads: one per device, or the sum itself when the replicas share it."""
        return [self.host_grads] if self.shared else [r.staging for r in self.replicas]

    def train(self, mode: bool = True) -> None:
        for r in self.replicas:
            r.model.train(mode)

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn) -> list[float]:
        """Run every device on its slice at once (``_each``)."""
        if len(inputs) != len(self.replicas) or len(targets) != len(self.replicas):
            raise ValueError(f"need one input slice per device ({len(self.replicas)})")
        losses = self._each(lambda _, r, x, y: r.forward_backward(x, y, loss_fn), inputs, targets)
        self._synchronize()
        return [float(loss) for loss in losses]

    # ------------------------------------------------------------------ S4: per-bucket push and load

    def attach(self, plan: BucketPlan, pusher: BucketPusher, loader: BucketLoader) -> None:
        """Install the per-bucket hooks (replacing earlier ones): see the module docstring."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._pusher, self._loader = pusher, loader
        pusher.names = self.layout.names
        if self.replicas[0].finite_flags is not None:  # the device's own check: on the values as they are pushed
            self.replicas[0].finite_below = BF16_ROUNDS_TO_INF if pusher.push_dtype == torch.bfloat16 else math.inf
        for index, r in enumerate(self.replicas):
            params = list(r.model.parameters())  # layout order (named_parameters, shared ones once)
            position = {id(p): i for i, p in enumerate(params)}
            for i, param in enumerate(params):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(index, i)))
            for module in _modules_with_parameters(r.model):
                needed = sorted({plan.bucket_of[position[id(p)]] for p in module.parameters()}, reverse=True)
                self._hooks.append(module.register_forward_pre_hook(self._load_hook(index, needed)))
            if r.param_offload is not None:  # its pre-hooks read the host buffer first: wait for the pulls there
                r.param_offload.before_fetch = self._offload_wait(index)

    def _grad_hook(self, device: int, param: int) -> Callable[[torch.Tensor], None]:
        r = self.replicas[device]
        offset = self.layout.offsets[param]

        def hook(p: torch.Tensor) -> None:
            assert self._loader is not None and self._pusher is not None
            if self._pusher.plan.bucket_of[param] in self._loader.late[device]:
                raise ModelUnsupported(
                    f"parameter {self.layout.names[param]!r} was used by forward before its new version was loaded: "
                    "its bucket is loaded just before the first module that owns it (or one above it that has "
                    "parameters of its own) runs, and no such module ran (a module reading a child's weight without "
                    "calling it, or a module's forward called directly); set transport.bucket_bytes: 0"
                )
            view = r.flat_grads[offset : offset + p.numel()]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():  # replaced by a user hook: keep values
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view(p.shape)
            self._pusher.gradient_ready(device, param, r.stage_bucket)

        return hook

    def _offload_wait(self, device: int) -> Callable[[list[int]], None]:
        r = self.replicas[device]

        def wait(positions: list[int]) -> None:
            assert self._loader is not None and self._pusher is not None
            buckets = sorted({self._pusher.plan.bucket_of[p] for p in positions}, reverse=True)
            self._loader.ensure(device, buckets, lambda bucket: r.load_bucket(self.host_params, bucket))

        return wait

    def _load_hook(self, device: int, buckets: list[int]) -> Callable[..., None]:
        r = self.replicas[device]

        def hook(module: torch.nn.Module, args: object) -> None:
            assert self._loader is not None
            self._loader.ensure(device, buckets, lambda bucket: r.load_bucket(self.host_params, bucket))

        return hook

    def forward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn) -> list[float]:
        """Forward on every device at once; per-bucket loads wait inside (``attach``). Returns the losses."""
        if len(inputs) != len(self.replicas) or len(targets) != len(self.replicas):
            raise ValueError(f"need one input slice per device ({len(self.replicas)})")

        def run(index: int, r: Replica, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = r.forward(x, y, loss_fn)
            if self._loader is not None:  # buckets of parameters no module's forward reached
                self._loader.ensure_all(index, lambda bucket: r.load_bucket(self.host_params, bucket))
            return loss

        self._losses = self._each(run, inputs, targets)
        return [float(loss.detach()) for loss in self._losses]

    def backward(self) -> None:
        """Backward of the losses ``forward`` returned, on every device at once; buckets leave as they complete."""

        def run(index: int, r: Replica, loss: torch.Tensor) -> None:
            r.backward(loss)
            if self._pusher is not None:
                self._pusher.device_done(index, r.stage_bucket)

        losses, self._losses = self._losses, []
        self._each(run, losses)
        self._synchronize()

    def _each(self, run: Callable[..., T], *columns: Sequence[Any]) -> list[T]:
        """``run(index, replica, *(column[index] for column in columns))`` on every device, at once: one thread each
        (torch releases the GIL), or this thread where there is one device (no hand-off on the step's path)."""
        rows = [(i, r, *args) for i, (r, *args) in enumerate(zip(self.replicas, *columns, strict=True))]
        if len(rows) == 1:
            return [run(*rows[0])]
        futures = [self._pool.submit(run, *row) for row in rows]
        wait(futures)  # every device is out of the step before an error leaves it
        errors = [error for f in futures if (error := f.exception()) is not None]
        if errors:  # a model refusal wins: another device's error may be its consequence (a gradient sum aborted)
            raise next((e for e in errors if isinstance(e, ModelUnsupported)), errors[0])
        return [f.result() for f in futures]

    def drop_losses(self) -> None:
        """Forget the graphs of a ``forward`` whose step is not backpropagated (a non-finite loss)."""
        self._losses = []

    def sum_gradients(self) -> torch.Tensor:
        """Sum every device's gradient into ``host_grads`` in device order (deterministic)."""
        if self.shared:
            return self.host_grads  # summed during backward (worker.param_offload.HostGradSum)
        self.host_grads.copy_(self.replicas[0].staging)
        for r in self.replicas[1:]:
            self.host_grads.add_(r.staging)
        return self.host_grads

    def load_parameters(self, flat: torch.Tensor | None = None) -> None:
        """Copy ``flat`` (default: ``host_params``) into every replica."""
        source = self.host_params if flat is None else flat
        for r in self.replicas:
            if r.flat_params.data_ptr() != source.data_ptr():  # shared with offload: written once
                r.flat_params.copy_(source, non_blocking=True)
        self._synchronize()

    def keep_buffers(self) -> KeptBuffers | None:
        """Every replica's buffers as they are (None: the model has none): what ``KeptBuffers.restore`` puts back
        when a step is skipped (``fault.on_nonfinite: skip``), so that a skipped step moves no running statistics,
        as it moves no parameters."""
        kept = KeptBuffers.of(module for r in self.replicas for module in r.model.modules())
        return kept if kept.entries else None

    def buffers(self) -> dict[str, torch.Tensor]:
        """The first replica's buffers (e.g. BatchNorm statistics), for the exported model."""
        return {name: b.detach().cpu() for name, b in self.replicas[0].model.named_buffers()}

    def slot_buffers(self) -> dict[str, torch.Tensor]:
        """Every replica's buffers as ``"<replica>/<name>"`` copies (issue 11: a checkpoint of the slot).

        Each replica updates its own (BatchNorm sees its own slice of the batch), so all are kept.
        """
        return {
            f"{i}/{name}": b.detach().to("cpu", copy=True)
            for i, r in enumerate(self.replicas)
            for name, b in r.model.named_buffers()
        }

    def load_slot_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Put ``slot_buffers``' copies back into every replica (a resumed slot); each must be there."""
        with torch.no_grad():
            for i, r in enumerate(self.replicas):
                for name, b in r.model.named_buffers():
                    b.copy_(buffers[f"{i}/{name}"])
        self._synchronize()

    def close(self) -> None:
        """End the device threads and remove the S4 hooks, which hold this set (and its trainer) alive otherwise."""
        self._pool.shutdown(wait=True)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _synchronize(self) -> None:
        for d in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)


def _modules_with_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward pre-hook loads their buckets: the highest ones that hold parameters of their own.

    Such a module waits for the buckets of its whole subtree (it may read a child's weight directly); a
    module without parameters of its own is walked into, so a container never waits for everything. A
    ``ParameterList`` or ``ParameterDict`` is never called (its parent reads its tensors), so its parameters count
    as its parent's own; so do those of the other children a parent reads directly (``children_read_by``).
    """
    found: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        read_here = bool(children_read_by(module))
        if read_here or next(module.parameters(recurse=False), None) is not None:
            found.append(module)
        else:
            for child in module.children():
                walk(child)

    walk(model)
    return found
