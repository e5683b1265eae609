"""One parameter-server shard: its range of parameters, the optimizer, and the sync protocol.

Protocol (S1.2, synchronous): the shard is at ``version`` v, which is also the step it is
collecting. Every registered worker pushes exactly one contribution for step v (the sum of
its devices' gradients and how many devices that is). When the last one arrives the shard
divides the total by the number of devices, runs one optimizer step and publishes v + 1.
Pulls wait until the version they ask for exists.

State changes only in ``push`` and only after every check has passed, so a rejected push
leaves the shard exactly as it was.

    push(step == v, new worker)  -> counted; the last one applies the update, v -> v + 1
    push(same worker, same step) -> duplicate: acknowledged, not counted again (retry-safe)
    push(step < v, not a retry)  -> StepConflict (stale)
    push(step > v)               -> StepConflict (ahead: the worker skipped a pull)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.optimizer import build_optimizer
from pstrain.runtime.schedule import learning_rate


@dataclass(frozen=True)
class PushResult:
    version: int
    duplicate: bool
    completed: bool
    update_s: float = 0.0  # optimizer time, when this push completed the step


@dataclass(frozen=True)
class ShardSnapshot:
    """Figures for operators; no tensors."""

    shard_id: int
    start: int
    end: int
    version: int
    pushes_waiting: int
    workers_expected: int
    bytes_held: int
    optimizer: str


class ParameterShard:
    def __init__(
        self,
        shard_id: int,
        start: int,
        end: int,
        initial: torch.Tensor,
        optimizer: pb.OptimizerSpec,
        schedule: pb.LrSchedule,
        workers: int,
        version: int = 0,
    ) -> None:
        if initial.dtype != torch.float32 or initial.dim() != 1 or initial.numel() != end - start:
            raise InvalidArgument(
                f"shard {shard_id} needs a 1-D float32 tensor of {end - start} elements, "
                f"got {initial.dtype} of shape {tuple(initial.shape)}"
            )
        if workers <= 0:
            raise InvalidArgument(f"a shard needs at least one worker, got {workers}")
        self.shard_id = shard_id
        self.start = start
        self.end = end
        self.workers = workers
        self._schedule = schedule
        self._param = torch.nn.Parameter(initial.clone(), requires_grad=True)
        self._accum = torch.zeros_like(initial)
        self._optimizer = build_optimizer(self._param, optimizer, learning_rate(schedule, version))
        self._optimizer_name = optimizer.name
        self._version = version
        self._pending: dict[int, int] = {}  # worker -> device count, for the current step
        self._last_step: dict[int, int] = {}  # worker -> last step it contributed to
        self._cond = threading.Condition()
        self._readers = 0
        self._updating = False
        self._closed = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    # ------------------------------------------------------------------ push

    def check_push(self, shard_id: int, worker_id: int, step: int, device_count: int, dtype: int, numel: int) -> bool:
        """Validate a push header before its payload is read; True when it is a duplicate.

        Raises for anything the shard would reject, so a bad push costs no bandwidth.
        """
        if shard_id != self.shard_id:
            raise InvalidArgument(f"push for shard {shard_id} reached shard {self.shard_id}; check the shard map")
        if not 0 <= worker_id < self.workers:
            raise UnknownWorker(f"unknown worker {worker_id}: this job has workers 0..{self.workers - 1}")
        if dtype != pb.FLOAT32:
            raise InvalidArgument(
                f"gradients must be FLOAT32, got {pb.DType.Name(dtype) if dtype in pb.DType.values() else dtype}"
            )
        if numel != self.numel:
            raise InvalidArgument(
                f"shard {self.shard_id} owns {self.numel} elements [{self.start}, {self.end}), push has {numel}"
            )
        if device_count < 1:
            raise InvalidArgument(f"device_count must be at least 1, got {device_count}")
        with self._cond:
            self._check_open()
            return self._classify_step(worker_id, step)

    def push(self, worker_id: int, step: int, grad: torch.Tensor, device_count: int) -> PushResult:
        """Count one worker's summed gradient for ``step``; the last one applies the update."""
        duplicate = self.check_push(self.shard_id, worker_id, step, device_count, pb.FLOAT32, grad.numel())
        if grad.dtype != torch.float32 or grad.dim() != 1:
            raise InvalidArgument(f"gradient must be a 1-D float32 tensor, got {grad.dtype} {tuple(grad.shape)}")
        with self._cond:
            self._check_open()
            # Re-check under the lock: the shard may have moved on while the payload streamed.
            if duplicate or self._classify_step(worker_id, step):
                return PushResult(self._version, duplicate=True, completed=False)
            if self._pending:
                self._accum.add_(grad)
            else:
                self._accum.copy_(grad)  # the first contribution of a step: no separate zeroing pass
            self._pending[worker_id] = device_count
            self._last_step[worker_id] = step
            if len(self._pending) < self.workers:
                return PushResult(self._version, duplicate=False, completed=False)
            started = time.perf_counter()
            self._apply_update()
            return PushResult(self._version, duplicate=False, completed=True, update_s=time.perf_counter() - started)

    def _classify_step(self, worker_id: int, step: int) -> bool:
        if self._last_step.get(worker_id) == step:
            return True
        if step < self._version:
            raise StepConflict(
                f"stale push: worker {worker_id} pushed step {step} but shard {self.shard_id} is at step "
                f"{self._version}; pull the newest parameters and continue from there"
            )
        if step > self._version:
            raise StepConflict(
                f"push ahead of the shard: worker {worker_id} pushed step {step} but shard {self.shard_id} "
                f"is at step {self._version}; a worker must pull version {step} before pushing step {step}"
            )
        return False

    def _apply_update(self) -> None:
        """Called with the lock held once every worker has contributed."""
        self._updating = True
        try:
            while self._readers:
                self._cond.wait()
            devices = sum(self._pending.values())
            self._param.grad = self._accum.div_(devices)
            for group in self._optimizer.param_groups:
                group["lr"] = learning_rate(self._schedule, self._version)
            self._optimizer.step()
            self._param.grad = None
            self._pending.clear()
            self._version += 1
        finally:
            self._updating = False
            self._cond.notify_all()

    # ------------------------------------------------------------------ pull

    @contextmanager
    def read(self, min_version: int, timeout_s: float) -> Iterator[tuple[int, torch.Tensor]]:
        """Wait for ``min_version``, then lend the parameters while the caller streams them.

        The update waits for readers to finish, so a reader never sees half an update and no
        copy of the parameters is needed.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_open()
                if self._version >= min_version and not self._updating:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(
                        f"shard {self.shard_id} is at version {self._version}; version {min_version} did not "
                        f"appear within {timeout_s:.1f}s (are all {self.workers} workers pushing?)"
                    )
                self._cond.wait(remaining)
            self._readers += 1
            version = self._version
        try:
            yield version, self._param.detach()
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def parameters(self) -> tuple[int, torch.Tensor]:
        """A copy of the current parameters and their version (for tests and checkpoints)."""
        with self._cond:
            return self._version, self._param.detach().clone()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wake every waiting pull so a shutting-down server drains quickly."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady(f"shard {self.shard_id} is shutting down")

    def snapshot(self) -> ShardSnapshot:
        with self._cond:
            state_bytes = sum(
                t.numel() * t.element_size()
                for state in self._optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            )
            held = (self._param.numel() + self._accum.numel()) * 4 + state_bytes
            return ShardSnapshot(
                self.shard_id,
                self.start,
                self.end,
                self._version,
                len(self._pending),
                self.workers,
                held,
                self._optimizer_name,
            )
