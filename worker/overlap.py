"""S4 on the worker: push each gradient bucket while backward runs, pull it back before forward needs it.

Push side (``BucketPusher``). Every replica's parameters carry a post-accumulate-grad hook; when
all parameters of a bucket (``runtime.buckets``) have their gradient on a device, the bucket is
ready there, and when it is ready on every device of the host, one background sender thread (a
single-thread executor: bounded, buckets leave in the order they became ready) sums that bucket's
slice of the devices' gradients into the host buffer (device order, as ``ReplicaSet.sum_gradients``
does for the whole vector, so the sum is bit-identical; with one device there is nothing to sum and
the bucket is pushed from that device's host buffer itself) and pushes its pieces at once, while
backward goes on with earlier layers. Once the shards have acknowledged the bucket, its pull of the
next version starts (from the acknowledging thread, so the sender never waits), which the shard
serves as soon as every worker has pushed that piece (``push_pull_pieces``; over shared memory the
push and the pull of a piece are one call, acknowledged with the new version). A bucket whose push
must be repeated is pulled after the repeat (its first pull fails with the push's error and the
loader pulls it again), and a skipped bucket's pull starts once the skip is acknowledged
(``pull_missing``). After backward the trainer waits for the pushes (the exposed push). The sender reads the
previous step's directive (the coordinator's answer to its report) before a step's first push and pushes nothing
if it stops the job, so the trainer need not wait for that answer before backward.

One GPU (``place_on_device``). With no host sum to make, the GPU copies each piece of a bucket whose shard is
colocated straight into the piece's span of that shard's push region, page-locked for it
(``ParameterServerClient.push_targets``), and the push names those spans as the pieces' sources (``placed``), so
the host copies nothing; the other pieces go to the pinned staging buffer as before. A push that must be repeated
gathers the placed pieces into the staging buffer first (``host_gradient``). The GPU also sums the bucket and sends
back whether that sum is finite: a finite sum proves every element finite (a NaN or Inf never sums to a finite
value), so the host reads the bucket only when the device's sum is not finite, and then decides, as it always
does with several devices (whose host sum can overflow where no device's part does).

Pull side (``BucketLoader``). The next step's forward waits only for the buckets a module uses:
a forward pre-hook on each module that holds parameters of its own waits for the buckets of its
whole subtree (so a module that reads a child's weight directly, as ``MultiheadAttention`` reads
``out_proj.weight``, is covered) and copies them into that device's replica (a GPU's; a CPU
stand-in reads the host buffer the pull wrote, so there is nothing to copy); modules without
parameters of their own are walked into. After forward every bucket not yet loaded (parameters
no module called) is loaded, so backward always sees one version. A forward that reads a
parameter of a module outside its own subtree before that module ran would see the previous
version (on a CPU device, whose parameters are the host buffer the pulls write, possibly a bucket
being written): such a model needs ``transport.bucket_bytes: 0`` (one bucket, loaded before forward).

Non-finite values (``fault.on_nonfinite``). The losses are checked before backward: a non-finite
loss pushes nothing (``skip``: every piece is skipped; ``stop``: nothing at all). During backward
each bucket's host sum is checked before it is pushed; the first non-finite bucket and every
bucket after it are skipped (``skip``) or not pushed (``stop``). A NaN therefore never reaches a
shard. The buckets pushed before it were finite and are applied: with several buckets, a step
whose gradient (but not its loss) turns non-finite is a partial update under ``skip``. That is
the price of pushing during backward; ``transport.bucket_bytes: 0`` keeps the all-or-nothing step
(one bucket is checked whole before anything is pushed). With bfloat16 pushes (``transport.push_dtype``) the host
checks the values as they will be rounded: a float32 gradient beyond bfloat16's range is Inf on the shard
(``finite_as_pushed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.buckets import Bucket, BucketPlan
from pstrain.runtime.model_refusal import ModelUnsupported
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.ps_api import RETRYABLE, ParameterServerClient, PullHandle, PushHandle, ShardAck

Repull = Callable[[Bucket, int], int]  # pull a bucket again (with retries) after its async pull failed

# The smallest float32 magnitude that rounds (to nearest, ties to even) to a bfloat16 Inf: halfway between
# bfloat16's largest value (about 3.3895e38) and Inf.
BF16_ROUNDS_TO_INF = torch.tensor([0x7F7F8000], dtype=torch.int32).view(torch.float32).item()


def finite_as_pushed(values: torch.Tensor, push_dtype: torch.dtype) -> bool:
    """Whether ``values`` (float32) hold no NaN/Inf once rounded to ``push_dtype``, as the shard will see them.

    A float32 gradient beyond bfloat16's range is finite here but Inf on the shard, which refuses the push
    (InvalidRequest) where the worker should have skipped the step or reported it (``fault.on_nonfinite``). One
    pass without a copy: NaN makes both bounds NaN, so both comparisons fail.
    """
    if push_dtype != torch.bfloat16 or values.numel() == 0:  # aminmax refuses an empty tensor
        return all_finite(values)
    low, high = torch.aminmax(values)
    return bool(low > -BF16_ROUNDS_TO_INF) and bool(high < BF16_ROUNDS_TO_INF)


@dataclass
class StagedBucket:
    """One device's copies of a bucket's gradient to the host, in flight (``Replica.stage_bucket``)."""

    done: torch.cuda.Event | None  # recorded after the copies; None: nothing is in flight
    finite: torch.Tensor | None = None  # pinned bool[1]: the device's sum of the bucket is finite (after ``done``)
    placed: tuple[torch.Tensor | None, ...] = ()  # per piece: its push target, if copied there instead of staging

    def gather(self, bucket: Bucket, into: torch.Tensor) -> None:
        """Copy the placed pieces into ``into`` (the host buffer), which then holds the whole bucket."""
        if not self.placed:
            return
        for piece, target in zip(bucket.pieces, self.placed, strict=True):
            if target is not None:
                into[piece.start : piece.end].copy_(target)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def surely_finite(self) -> bool:
        """True proves every element finite; False only means the host must look (an overflowing sum)."""
        return self.finite is not None and bool(self.finite[0])


Stage = Callable[[Bucket, Sequence[torch.Tensor | None]], StagedBucket | None]  # a bucket's copies on one device


@dataclass
class StepPushes:
    """What one step pushed: the handles to wait on and whether every pushed bucket was finite."""

    step: int
    # The previous step's report, whose directive the sender reads before this step's first push (None: go on).
    held: Future[pb.Directive] | None = None
    stopped: bool = False  # that directive stopped the job (or its report failed): this step pushes nothing
    handles: list[tuple[Bucket, bool, PushHandle]] = field(default_factory=list)  # (bucket, skipped, handle)
    pulls: dict[int, PullHandle] = field(default_factory=dict)  # bucket index -> its pull of version step + 1
    placed: dict[int, StagedBucket] = field(default_factory=dict)  # bucket index -> its copies, some into targets
    finite: bool = True
    first_nonfinite: int | None = None  # bucket index


class BucketPusher:
    """Counts gradients per bucket and device during backward and pushes each bucket when it is complete."""

    def __init__(
        self,
        plan: BucketPlan,
        devices: int,
        ps: ParameterServerClient,
        worker_id: int,
        host_grads: torch.Tensor,
        host_params: torch.Tensor,
        staging: Sequence[torch.Tensor],
        skip_nonfinite: bool,
        place_on_device: bool = False,
        push_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``place_on_device``: the one device is a GPU that copies each piece into its ``push_targets`` span, where
        it has one, instead of into ``staging``. ``push_dtype``: what the client rounds a push to
        (``transport.push_dtype``); the host's finiteness verdict is on those values, as the shard's is."""
        self.plan = plan
        self.devices = devices
        self.ps = ps
        self.worker_id = worker_id
        self.host_grads = host_grads
        self.host_params = host_params
        self.staging = list(staging)
        # One device: its staging buffer (the CPU replica's own flat gradient, a GPU's pinned copy) is already the
        # host sum, so buckets are pushed from it without a copy; it is not written again before the next step's
        # forward, and the trainer waits for every push of a step (and its repeats) before that.
        self.grads = self.staging[0] if len(self.staging) == 1 else host_grads
        self.skip_nonfinite = skip_nonfinite
        self.push_dtype = push_dtype
        self._place = place_on_device and devices == 1
        self._sizes = [len(b.params) for b in plan.buckets]
        self._lock = threading.Lock()
        self._sender: ThreadPoolExecutor | None = None  # made by the first bucket of a run, ended by ``close``
        self._sent: list[Future[None]] = []
        self._step: StepPushes | None = None
        self._left: list[list[int]] = []  # per device, per bucket: parameters still without a gradient
        self._ready: list[int] = []  # per bucket: devices on which it is complete
        self._events: list[list[StagedBucket | None]] = []  # per device, per bucket: its copies to the host
        self._queued: set[int] = set()
        self._got: list[set[int]] = []  # per device: parameters whose gradient this step has reported
        self.names: Sequence[str] = ()  # the layout's parameter names, for errors (``ReplicaSet.attach`` sets them)
        self.on_push: Callable[[Bucket], None] | None = None  # tests observe the order of pushes

    def start(self, step: int, held: Future[pb.Directive] | None = None) -> None:
        """Arm the hooks for ``step`` (before backward). ``held``: the previous step's report in flight; the step
        pushes nothing until its directive has come, and nothing at all if it stops the job (or the report fails:
        the trainer raises its error), so its round trip overlaps backward."""
        with self._lock:
            self._step = StepPushes(step, held)
            self._left = [list(self._sizes) for _ in range(self.devices)]
            self._ready = [0] * len(self.plan.buckets)
            self._events = [[None] * len(self.plan.buckets) for _ in range(self.devices)]
            self._queued = set()
            self._got = [set() for _ in range(self.devices)]
            self._sent = []

    def gradient_ready(self, device: int, param: int, stage: Stage) -> None:
        """Parameter ``param``'s gradient is final on ``device`` (from its post-accumulate-grad hook)."""
        with self._lock:
            if self._step is None:
                return  # not a training step (the probe, a test's plain forward_backward)
            if param in self._got[device]:  # its bucket may have been counted complete before this part came
                name = self.names[param] if param < len(self.names) else f"number {param}"
                raise ModelUnsupported(
                    f"parameter {name} got a gradient twice in one backward on device {device}: a parameter used in "
                    "several reentrant backward passes (torch.utils.checkpoint with use_reentrant=True around a module "
                    "that runs more than once, or around a parameter also used outside it) cannot be pushed as soon "
                    "as its gradient is ready; use use_reentrant=False"
                )
            self._got[device].add(param)
            bucket = self.plan.bucket_of[param]
            left = self._left[device]
            left[bucket] -= 1
            if left[bucket] != 0:
                return
        handle = self._stage(stage, bucket)  # the device->host copy of this bucket, where there is one
        with self._lock:
            self._events[device][bucket] = handle
            self._ready[bucket] += 1
            if self._ready[bucket] == self.devices:
                self._queue(bucket)

    def device_done(self, device: int, stage: Stage) -> None:
        """Backward ended on ``device``: a bucket still missing gradients there (parameters the step did not
        use keep their zero gradient) is complete now."""
        with self._lock:
            if self._step is None:
                return
            missing = [b for b, left in enumerate(self._left[device]) if left > 0]
            for bucket in missing:
                self._left[device][bucket] = 0
        for bucket in missing:
            handle = self._stage(stage, bucket)
            with self._lock:
                self._events[device][bucket] = handle
                self._ready[bucket] += 1
                if self._ready[bucket] == self.devices:
                    self._queue(bucket)

    def _stage(self, stage: Stage, index: int) -> StagedBucket | None:
        bucket = self.plan.buckets[index]
        return stage(bucket, self.ps.push_targets(bucket.pieces, self.worker_id) if self._place else ())

    def skip_all(self, step: int, devices: int) -> StepPushes:
        """A non-finite loss: skip every piece of ``step`` (no backward, nothing pushed but the skips)."""
        self._step = StepPushes(step, finite=False, first_nonfinite=0)
        for bucket in self.plan.buckets:
            self._step.handles.append((bucket, True, self.ps.skip_pieces(bucket.pieces, self.worker_id, step, devices)))
        return self._finish()

    def finish(self) -> StepPushes:
        """After backward (every device called ``device_done``): wait until every bucket has left."""
        with self._lock:
            if len(self._queued) != len(self.plan.buckets):
                missing = sorted(set(range(len(self.plan.buckets))) - self._queued)
                raise RuntimeError(f"buckets {missing} never completed: did every device call device_done?")
            sent = list(self._sent)
        for future in sent:
            future.result()  # the sender's own errors (a bad buffer); shard errors come from the handles
        return self._finish()

    def _finish(self) -> StepPushes:
        step = self._step
        assert step is not None
        self._step = None
        return step

    def _queue(self, bucket: int) -> None:
        """Called with the lock held."""
        self._queued.add(bucket)
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-push")
        self._sent.append(self._sender.submit(self._send, self.plan.buckets[bucket]))

    def _send(self, bucket: Bucket) -> None:
        """On the sender thread: the host sum of one bucket, checked, pushed, and its next pull started."""
        step = self._step
        assert step is not None
        if step.held is not None:  # the first bucket of the step: its directive first
            try:
                step.stopped = step.held.result().stop
            except BaseException:  # noqa: BLE001 - the trainer raises the report's error (``Trainer._wait_report``)
                step.stopped = True
            step.held = None
        if step.stopped:
            return
        copies = [self._events[device][bucket.index] for device in range(self.devices)]
        for copy in copies:
            if copy is not None:
                copy.wait()
        dest = self.grads[bucket.start : bucket.end]
        if len(self.staging) > 1:  # several devices: their sum, in device order
            dest.copy_(self.staging[0][bucket.start : bucket.end])
            for staged in self.staging[1:]:
                dest.add_(staged[bucket.start : bucket.end])
        own = copies[0] if self.devices == 1 else None  # one device: its copy is the sum
        if own is not None and any(t is not None for t in own.placed):
            step.placed[bucket.index] = own
        if step.finite and not ((own is not None and own.surely_finite()) or self._host_finite(own, bucket, dest)):
            step.finite = False
            step.first_nonfinite = bucket.index
        devices = self.devices
        if step.finite:
            if self.on_push is not None:
                self.on_push(bucket)
            placed = own.placed if own is not None and own.placed else None  # pieces the device put in place
            handle, pull = self.ps.push_pull_pieces(
                self.grads, bucket.pieces, self.worker_id, step.step, devices, self.host_params, placed
            )
            step.handles.append((bucket, False, handle))
            with self._lock:
                step.pulls[bucket.index] = pull
            return
        if not self.skip_nonfinite:
            return  # on_nonfinite: stop: nothing more leaves; the job fails
        handle = self.ps.skip_pieces(bucket.pieces, self.worker_id, step.step, devices)
        step.handles.append((bucket, True, handle))
        self._pull_when_acknowledged(step, bucket, handle)

    def _host_finite(self, own: StagedBucket | None, bucket: Bucket, dest: torch.Tensor) -> bool:
        """The host's verdict; it needs the whole bucket in ``dest`` (the bucket's span of ``grads``), so placed
        pieces are gathered first (only when the device's sum was not finite: rarely), at their places in
        ``grads``: pieces are placed by their offsets in the whole flat vector. With bfloat16 pushes it is on the
        values as rounded (``finite_as_pushed``)."""
        if own is not None:
            own.gather(bucket, self.grads)
        return finite_as_pushed(dest, self.push_dtype)

    def host_gradient(self, step: StepPushes, bucket: Bucket) -> torch.Tensor:
        """The host buffer with ``bucket``'s gradient of ``step`` whole (its placed pieces gathered): what a repeated
        push of the bucket sends."""
        staged = step.placed.get(bucket.index)
        if staged is not None:
            staged.gather(bucket, self.grads)
        return self.grads

    def _pull_when_acknowledged(self, step: StepPushes, bucket: Bucket, handle: PushHandle) -> None:
        left = [len(handle.futures)]

        def acknowledged(future: Future[ShardAck]) -> None:
            with self._lock:
                left[0] -= 1
                if left[0] or any(f.cancelled() or f.exception() is not None for f in handle.futures):
                    return
            self._pull(step, bucket)

        for future in handle.futures:
            future.add_done_callback(acknowledged)

    def _pull(self, step: StepPushes, bucket: Bucket) -> None:
        with self._lock:
            if bucket.index in step.pulls:
                return
            step.pulls[bucket.index] = self.ps.pull_pieces(step.step + 1, self.host_params, bucket.pieces)

    def pull_missing(self, step: StepPushes) -> None:
        """After every push of ``step`` is acknowledged: start the pulls that no acknowledgement started."""
        for bucket, _, _ in step.handles:
            self._pull(step, bucket)

    def close(self) -> None:
        """End the sender thread (``Trainer.run`` does as it returns): a process that builds trainers one after
        another must not keep one idle thread per trainer. It does not wait: a bucket being pushed finishes, one
        still queued (a step that failed mid-backward) is dropped, so nothing leaves after ``run`` has returned
        but that push. The next step makes a new sender."""
        with self._lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown(wait=False, cancel_futures=True)


class BucketLoader:
    """The pulls of the next version, per bucket, and which replica has copied which bucket yet."""

    def __init__(self, plan: BucketPlan, replicas: int, host_params: torch.Tensor) -> None:
        self.plan = plan
        self.host_params = host_params
        self._replicas = replicas
        self._pulls: dict[int, PullHandle] = {}
        self._version = 0
        self._loaded = [[True] * len(plan.buckets) for _ in range(replicas)]
        self._repull: Repull | None = None
        self._lock = threading.Lock()
        self._pulled: dict[int, threading.Lock] = {b.index: threading.Lock() for b in plan.buckets}
        self._done: set[int] = set()
        self._failed: dict[int, BaseException] = {}  # bucket index -> why its pull (with its repeats) failed
        self.waited_s = [0.0] * replicas  # per replica, since ``arm``: the exposed pull
        # Per replica, since ``arm``: the buckets only ``ensure_all`` loaded (after forward). A parameter of one that
        # gets a gradient was read by forward before its new version was there (``ReplicaSet`` refuses that).
        self.late: list[set[int]] = [set() for _ in range(replicas)]

    def arm(self, version: int, pulls: dict[int, PullHandle], repull: Repull) -> None:
        """The next forward loads ``version`` per bucket from ``pulls`` (started by the pusher)."""
        with self._lock:
            self._version = version
            self._pulls = dict(pulls)
            self._repull = repull
            self._done = set()
            self._failed = {}
            self._loaded = [[False] * len(self.plan.buckets) for _ in range(self._replicas)]
            self.waited_s = [0.0] * self._replicas
            self.late = [set() for _ in range(self._replicas)]

    @property
    def armed(self) -> bool:
        return any(not all(row) for row in self._loaded)

    def ensure(self, replica: int, buckets: Sequence[int], load: Callable[[Bucket], None]) -> None:
        """Wait for ``buckets``' pulls and ``load`` (copy into ``replica``) those it has not loaded yet."""
        loaded = self._loaded[replica]
        for index in buckets:
            if loaded[index]:
                continue
            started = time.perf_counter()
            self._wait(index)
            self.waited_s[replica] += time.perf_counter() - started
            load(self.plan.buckets[index])
            loaded[index] = True

    def ensure_all(self, replica: int, load: Callable[[Bucket], None]) -> None:
        """After forward: load the buckets no module's pre-hook loaded (noted in ``late``)."""
        self.late[replica] = {b.index for b in self.plan.buckets if not self._loaded[replica][b.index]}
        self.ensure(replica, [b.index for b in self.plan.forward_order], load)

    def _wait(self, index: int) -> None:
        """One device thread waits (and repeats a failed pull), the others after it. A pull that failed for good
        fails the other devices at once: each repeating the whole retry cycle in turn would only delay the error
        by a backoff per device and call the shard that many times more."""
        with self._pulled[index]:
            if index in self._done:
                return
            failed = self._failed.get(index)
            if failed is not None:
                raise failed
            try:
                self._pull_once(index)
            except BaseException as exc:
                self._failed[index] = exc
                raise
            self._done.add(index)

    def _pull_once(self, index: int) -> None:
        handle = self._pulls.get(index)
        bucket = self.plan.buckets[index]
        if handle is None:
            raise RuntimeError(f"bucket {index} was never pulled for version {self._version}")
        try:
            version = handle.wait()
        except RETRYABLE:
            assert self._repull is not None
            version = self._repull(bucket, self._version)  # retries a retryable error, raises the rest
        if version != self._version:
            raise RuntimeError(f"bucket {index} came back at version {version}, expected {self._version}")
