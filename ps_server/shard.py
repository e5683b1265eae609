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
    push(non-finite gradient)    -> InvalidArgument: a NaN never reaches the parameters
    push(skip=True)              -> counted without a payload; the step completes without an update

The contributors (``cluster.min_workers``): worker ids ``0..workers-1`` at first; ``set_workers(from_version,
ids, scaled_lr)`` changes who contributes to step ``from_version`` on, and the learning rate with them (S1.6).
Removing a worker applies to the step in flight at once: a contribution of it that arrived is kept (it is
in the step, which then keeps its LR: the new one applies from the next step), the step no longer waits for
one that did not. Adding one must come before its step
collects any push. A push from a worker not among the step's contributors is refused (StepConflict)
and changes nothing.

Determinism: contributions are summed in worker order whatever order they arrive in (an early
one from a higher worker id waits in a side buffer; the second in order, arriving first, becomes
the accumulator at once, since the first two terms of a sum commute exactly), so a step's result
does not depend on timing and a resumed run equals an uninterrupted one bit for bit.

Pulls are served from a published copy of the parameters that an update never writes while a
reader holds it: the update copies into the other of two buffers and publishes that one (a
buffer still held by a stalled reader is left to it and a new one allocated), so a slow reader
never holds up a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import ShardState
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.hand_over import HandOverTurns
from pstrain.ps_server.layerwise import Layers, LayerwiseOptimizer
from pstrain.ps_server.optimizer import build_optimizer, step_on_mean
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.schedule import learning_rate
from pstrain.runtime.shm_board import WRITING, PieceBoard

log = logging.getLogger(__name__)

# Issue 12: the dtypes a gradient may be pushed in, as torch and wire dtypes. The accumulator is float32
# whatever arrives: a bfloat16 push is widened (exactly) as it is copied or added into it.
PUSH_DTYPES: dict[torch.dtype, int] = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16}


def _dtype_name(dtype: int) -> str:
    return pb.DType.Name(dtype) if dtype in pb.DType.values() else str(dtype)


@dataclass(frozen=True)
class PushResult:
    version: int
    duplicate: bool
    completed: bool
    update_s: float = 0.0  # optimizer time, when this push completed the step
    skipped: bool = False  # the step completed without an update (a worker asked to skip it)


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
    skipped_steps: int = 0


@dataclass(frozen=True)
class CheckpointPolicy:
    """When the shard snapshots itself: every ``every_steps`` versions and at ``final_version``."""

    every_steps: int
    final_version: int
    on_snapshot: Callable[[ShardState], None]  # called outside the lock, in version order; may block (backpressure)

    def due(self, version: int) -> bool:
        return self.every_steps > 0 and (version % self.every_steps == 0 or version == self.final_version)


@dataclass(frozen=True)
class _Snapshot:
    """A due checkpoint's state and its turn among this shard's snapshots (``_hand_over`` keeps that order)."""

    state: ShardState
    turn: int


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
        optimizer_state: dict[str, Any] | None = None,
        checkpoints: CheckpointPolicy | None = None,
        layers: Layers | None = None,  # issue 10: parameter segments + norm exchange for LARS/LAMB
        push_dtype: int = pb.FLOAT32,  # issue 12: the dtype the job pushes gradients in (FLOAT32 | BFLOAT16)
    ) -> None:
        if initial.dtype != torch.float32 or initial.dim() != 1 or initial.numel() != end - start:
            raise InvalidArgument(
                f"shard {shard_id} needs a 1-D float32 tensor of {end - start} elements, "
                f"got {initial.dtype} of shape {tuple(initial.shape)}"
            )
        if workers <= 0:
            raise InvalidArgument(f"a shard needs at least one worker, got {workers}")
        if push_dtype not in PUSH_DTYPES.values():
            raise InvalidArgument(f"gradients are pushed as FLOAT32 or BFLOAT16, not {_dtype_name(push_dtype)}")
        self.push_dtype = push_dtype
        self.shard_id = shard_id
        self.start = start
        self.end = end
        self.workers = workers
        self._schedule = schedule
        self._param = torch.nn.Parameter(initial.clone(), requires_grad=True)
        self._published = self._param.detach().clone()  # what pulls read; never written while a reader holds it
        self._spare: torch.Tensor | None = None  # the previously published buffer, reused once no reader holds it
        # The parameters of version ``_version - 1`` (the spare, or the published buffer after a skipped step) until
        # the next update: a replacement worker reads them to redo a step its failed predecessor pushed to some
        # pieces only (``read_at``, S2.5).
        self._previous: torch.Tensor | None = None
        self._readers: dict[int, int] = {}  # id(published buffer) -> readers holding it
        self._board: PieceBoard | None = None  # issue 12: published into shared memory (``publish_on``)
        self._accum = torch.zeros_like(initial)
        # The step's only contribution, lent by the caller for the push call that completes the step (``lent``):
        # the update reads it where it lies instead of from a copy in the accumulator. Never set outside that call.
        self._borrowed: torch.Tensor | None = None
        self._optimizer = build_optimizer(self._param, optimizer, learning_rate(schedule, version), layers)
        if optimizer_state is not None:
            self._optimizer.load_state_dict(optimizer_state)
        if isinstance(self._optimizer, LayerwiseOptimizer):
            self._optimizer.while_waiting = self._outside_lock
        self._optimizer_name = optimizer.name
        self._checkpoints = checkpoints
        self._version = version
        self._pending: dict[int, int] = {}  # worker -> device count, for the current step
        self._held: dict[int, torch.Tensor] = {}  # contributions that arrived before a lower worker's
        self._contributors: tuple[int, ...] = tuple(range(workers))  # who contributes to the next steps
        self._order: tuple[int, ...] = self._contributors  # the current step's contributors, summed in this order
        self._changes: dict[int, tuple[tuple[int, ...], float]] = {}  # from_version -> (ids, scaled_lr), not yet due
        self._deferred: int | None = None  # the version of a change ``set_workers`` put off by a step (a kept push)
        self._summed = 0  # workers _order[:_summed] are in the accumulator (or skipped)
        self._has_sum = False  # the accumulator holds this step's first contribution already
        self._skip_step = False
        self._skipped_steps = 0
        self._last_step: dict[int, int] = {}  # worker -> last step it contributed to
        # Never taken twice by one thread (a plain lock): an update that waits for its peers' norms lets go of it
        # entirely (``_outside_lock``) and says so in ``_updating``.
        self._cond = threading.Condition(threading.Lock())
        self._updating = False
        # Due snapshots reach ``on_snapshot`` in version order (``_hand_over``): each takes a turn under ``_cond`` as
        # it is taken, and is handed over once every earlier one has been.
        self._turns = HandOverTurns()
        self._failed: str | None = None  # why the shard refuses everything: an update failed halfway
        self._closed = False

    @classmethod
    def restore(
        cls,
        state: ShardState,
        optimizer: pb.OptimizerSpec,
        schedule: pb.LrSchedule,
        workers: int,
        checkpoints: CheckpointPolicy | None = None,
        layers: Layers | None = None,
        push_dtype: int = pb.FLOAT32,
    ) -> ParameterShard:
        """A shard continuing from a checkpoint: its range, optimizer state and version. ``push_dtype`` is the job's
        (a checkpoint does not record it): a bfloat16 job's shard restored without it refuses every push."""
        return cls(
            state.shard_id,
            state.start,
            state.end,
            state.params,
            optimizer,
            schedule,
            workers,
            version=state.version,
            optimizer_state=state.optimizer,
            checkpoints=checkpoints,
            layers=layers,
            push_dtype=push_dtype,
        )

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def version_now(self) -> int:
        """``version`` without the lock (reading an int is atomic), ``NotReady`` once closed: for the servicer's event
        loop, which must never wait for a lock an update holds; the read that follows checks again under the lock."""
        self._check_open()
        return self._version

    # ------------------------------------------------------------------ push

    def check_push(self, shard_id: int, worker_id: int, step: int, device_count: int, dtype: int, numel: int) -> bool:
        """Validate a push header before its payload is read; True when it is a duplicate.

        Raises for anything the shard would reject, so a bad push costs no bandwidth.
        """
        self.check_header(shard_id, worker_id, device_count, dtype, numel)
        with self._cond:
            self._check_open()
            return self._classify_step(worker_id, step)

    def check_header(self, shard_id: int, worker_id: int, device_count: int, dtype: int, numel: int) -> None:
        """The part of ``check_push`` that reads only what never changes (no lock, no step): an event loop may call
        it to size a push's buffer by its header before a thread makes the step's checks."""
        if shard_id != self.shard_id:
            raise InvalidArgument(f"push for shard {shard_id} reached shard {self.shard_id}; check the shard map")
        if not 0 <= worker_id < self.workers:
            raise UnknownWorker(f"unknown worker {worker_id}: this job has workers 0..{self.workers - 1}")
        if dtype != self.push_dtype:
            raise InvalidArgument(
                f"this job pushes gradients as {_dtype_name(self.push_dtype)} (transport.push_dtype), "
                f"got {_dtype_name(dtype)}"
            )
        if numel != self.numel:
            raise InvalidArgument(
                f"shard {self.shard_id} owns {self.numel} elements [{self.start}, {self.end}), push has {numel}"
            )
        if device_count < 1:
            raise InvalidArgument(f"device_count must be at least 1, got {device_count}")

    def push(
        self,
        worker_id: int,
        step: int,
        grad: torch.Tensor | None,
        device_count: int,
        skip: bool = False,
        recycle: Callable[[torch.Tensor], None] | None = None,
        lent: bool = False,
    ) -> PushResult:
        """Count one worker's summed gradient for ``step``; the last one applies the update.

        ``skip`` (no ``grad``): the worker saw a non-finite loss or gradient; the step then
        completes without an update, on every shard alike.

        ``recycle``: ``grad`` is a scratch buffer the caller gives up (a push received from the
        network). If it is the step's first contribution, the shard keeps it as its accumulator
        instead of copying it there (issue 12: one pass less over the shard per step) and hands
        the old accumulator, as large, to ``recycle``; the caller then owns that one, not ``grad``.

        ``lent``: the caller lends ``grad`` until this call returns, to be read and written (a colocated worker's
        push region). When it is the step's only contribution the update reads it in place instead of from a copy
        in the accumulator (issue 12: one pass less over the shard per step for a job of one worker, a GPU host's
        sum, say); a fused step's division by the device count then lands in it. Nothing refers to it once the
        call has returned. Why the region may be read that late: the worker writes a piece's span again (itself, or
        its GPU's copy during backward: ``worker.overlap``) only for the next step, whose forward waits for the
        version this update publishes, or to retry this push, with the same values (a duplicate, acknowledged
        unread); a fused kernel reads each element once, so even then it never mixes two gradients
        (``_lone_contribution``).
        """
        numel = self.numel if grad is None else grad.numel()
        dtype = self.push_dtype if grad is None else PUSH_DTYPES.get(grad.dtype, pb.DTYPE_UNSPECIFIED)
        duplicate = self.check_push(self.shard_id, worker_id, step, device_count, dtype, numel)
        if grad is None and not skip:
            raise InvalidArgument("a push carries a gradient unless it skips the step")
        if grad is not None:
            if grad.dim() != 1:
                raise InvalidArgument(f"gradient must be a 1-D tensor, got shape {tuple(grad.shape)}")
            if not duplicate and not all_finite(grad):
                raise InvalidArgument(
                    f"worker {worker_id}'s gradient for step {step} has NaN or Inf values; a worker skips such a "
                    f"step (fault.on_nonfinite) instead of pushing it"
                )
        snapshot: _Snapshot | None = None
        with self._cond:
            self._check_open()
            # Re-check under the lock: the shard may have moved on while the payload streamed.
            duplicate = duplicate or self._classify_step(worker_id, step)
            while not duplicate and self._updating:  # a contribution to the step being updated: none can come (every
                self._cond.wait()  # contributor is in), but if one did, it would wait and then be told it is stale
                self._check_open()
                duplicate = self._classify_step(worker_id, step)
            if duplicate:
                return PushResult(self._version, duplicate=True, completed=False)
            self._pending[worker_id] = device_count
            self._last_step[worker_id] = step
            try:
                self._take(worker_id, None if skip else grad, recycle, lent)
                self._sum_in_order()
                if len(self._pending) < len(self._order):
                    return PushResult(self._version, duplicate=False, completed=False)
                started = time.perf_counter()
                result, snapshot = self._finish_step()
            finally:
                self._borrowed = None  # the caller takes its buffer back when this call returns, whatever happened
        self._hand_over(snapshot, started, result.update_s)
        return result

    def _take(
        self,
        worker_id: int,
        grad: torch.Tensor | None,
        recycle: Callable[[torch.Tensor], None] | None,
        lent: bool,
    ) -> None:
        """Place a counted contribution (the lock held; ``None``: a skip): see ``push`` and ``_sum_in_order``."""
        if grad is None:
            self._skip_step = True
            self._held[worker_id] = self._accum[:0]  # an empty placeholder: nothing to add
        else:
            in_turn = self._summed < len(self._order) and worker_id == self._order[self._summed]
            second_first = self._second_first(worker_id)
            if recycle is not None and not self._has_sum and (in_turn or second_first) and self._adoptable(grad):
                # The step's first contribution: the buffer becomes the accumulator; ``_sum_in_order`` passes
                # over it (pending, not held), as over a second-first one.
                spare, self._accum = self._accum, grad
                self._has_sum = True
                recycle(spare)
            elif lent and self._lone_contribution(grad):
                self._borrowed = grad  # read by the update before ``push`` returns; ``_sum_in_order`` passes over it
                self._has_sum = True
            elif second_first:
                # Issue 12: the second worker in order arrived first. a + b == b + a exactly, so its
                # contribution becomes the accumulator at once (no clone to hold it, no second pass);
                # ``_sum_in_order`` passes over it when the first one is added.
                self._accum.copy_(grad)
                self._has_sum = True
            else:
                self._held[worker_id] = grad if in_turn else grad.clone()

    def _finish_step(self) -> tuple[PushResult, _Snapshot | None]:
        """Every contributor is in (the lock held): update, publish, and snapshot if a checkpoint is due."""
        started = time.perf_counter()
        skipped = self._apply_update()
        update_s = time.perf_counter() - started
        snapshot = None
        if self._checkpoints is not None and self._checkpoints.due(self._version):
            snapshot = _Snapshot(self._checkpoint_state(), self._turns.take())
        return PushResult(self._version, False, True, update_s=update_s, skipped=skipped), snapshot

    def _hand_over(self, snapshot: _Snapshot | None, started: float, update_s: float) -> None:
        """Outside the lock: hand a due checkpoint's snapshot to the writer, after every earlier one.

        Why in turn: the lock is let go before the hand-over, and once the step's version is published the
        workers may complete the next due step (a worker whose push waits here retries it: a duplicate, answered
        at once) while this thread is preempted or waits for the writer (backpressure). Handed over first, the
        newer snapshot would be written first and the older one after it: the confirmations would go backwards
        and the writer's prune of files past the step it wrote would delete the newer, confirmed file.
        """
        if snapshot is None:
            return
        assert self._checkpoints is not None
        with self._turns.in_turn(snapshot.turn):
            self._checkpoints.on_snapshot(snapshot.state)  # may wait for the previous write (backpressure)
        blocked_s = time.perf_counter() - started - update_s
        version = snapshot.state.version
        log.info("shard %d: checkpoint of step %d held training for %.4fs", self.shard_id, version, blocked_s)

    # ------------------------------------------------------------------ the contributors (cluster.min_workers)

    def set_workers(self, from_version: int, ids: list[int] | tuple[int, ...], scaled_lr: float) -> bool:
        """From step ``from_version`` on, ``ids`` contribute and the schedule's LR is ``scaled_lr`` (S1.6).

        Returns whether a removed worker's contribution to step ``from_version`` is in it (it arrived
        before the change: kept). A change for a later version waits for it; a removal may come late
        (the step in flight stops waiting for the removed worker); an addition must come before its
        step collects any push, else StepConflict and nothing changes.

        Removing a worker whose push is in the step in flight finishes that step with the LR it began with
        (a piece that finished it before the change did too); the new LR applies from the next step. Changes
        scheduled for later steps (a worker's return) stand, less the workers removed.
        """
        wanted = self.check_workers(from_version, ids, scaled_lr)
        started = time.perf_counter()
        with self._cond:
            self._settled()
            removed = set(self._contributors) - set(wanted)
            included = any(self._last_step.get(w) == from_version for w in removed)
            if from_version > self._version:
                self._changes[from_version] = (wanted, scaled_lr)
                if from_version == self._deferred:
                    self._deferred = None
                return included
            self._check_addition(from_version, wanted)
            if self._deferred is not None:  # this change supersedes the one deferred by an earlier call
                self._changes.pop(self._deferred, None)
                self._deferred = None
            # Changes already scheduled for later steps (a return) stand, less the workers removed now.
            later = {v: (tuple(i for i in c if i not in removed), lr) for v, (c, lr) in self._changes.items()}
            self._changes = {v: c for v, c in later.items() if v > from_version and c[0]}
            if included and from_version == self._version:
                # A removed worker's push is in the step in flight: the step is finished with the LR it began
                # with (as a piece that finished it already did); the new LR applies from the next step.
                self._enter(wanted, None)
                if self._version + 1 not in self._changes:
                    self._changes[self._version + 1] = (wanted, scaled_lr)
                    self._deferred = self._version + 1
            else:
                self._enter(wanted, scaled_lr)
            if not self._pending or len(self._pending) < len(self._order):
                return included
            result, snapshot = self._finish_step()
        self._hand_over(snapshot, started, result.update_s)
        return included

    def check_workers(self, from_version: int, ids: Sequence[int], scaled_lr: float) -> tuple[int, ...]:
        """Raise what ``set_workers`` would refuse, changing nothing (``PiecedShard`` asks every piece first);
        returns the contributors, sorted."""
        wanted = tuple(sorted(set(ids)))
        if not wanted or not all(0 <= i < self.workers for i in wanted):
            raise InvalidArgument(f"contributors must be a non-empty subset of 0..{self.workers - 1}, got {list(ids)}")
        if not scaled_lr > 0:
            raise InvalidArgument(f"the learning rate must be positive, got {scaled_lr}")
        with self._cond:
            self._settled()
            if from_version <= self._version:
                self._check_addition(from_version, wanted)
        return wanted

    def _check_addition(self, from_version: int, wanted: tuple[int, ...]) -> None:
        """An addition from a step at or before the one in flight must come before it collects a push (lock held)."""
        added = set(wanted) - set(self._order)
        if added and (from_version < self._version or self._pending):
            raise StepConflict(
                f"too late to add workers {sorted(added)} from step {from_version}: shard {self.shard_id} "
                f"{'is at step ' + str(self._version) if from_version < self._version else 'collects that step'}"
            )

    def _enter(self, ids: tuple[int, ...], scaled_lr: float | None) -> None:
        """New contributors from the step in flight on (the lock held); contributions it has are kept.
        ``scaled_lr`` None keeps the LR."""
        self._contributors = ids
        self._order = tuple(sorted(set(ids) | set(self._pending)))
        self._summed = 0
        while self._summed < len(self._order) and self._order[self._summed] in self._pending:
            if self._order[self._summed] in self._held:
                break
            self._summed += 1
        self._sum_in_order()
        if scaled_lr is not None:
            schedule = pb.LrSchedule()
            schedule.CopyFrom(self._schedule)
            schedule.scaled_lr = scaled_lr
            self._schedule = schedule
        log.debug(
            "shard %d [%d, %d): workers %s contribute from step %d on (lr %g)",
            self.shard_id,
            self.start,
            self.end,
            list(ids),
            self._version,
            self._schedule.scaled_lr,
        )

    @property
    def contributors(self) -> tuple[int, ...]:
        with self._cond:
            return self._contributors

    def _sum_in_order(self) -> None:
        """Add held contributions to the accumulator in worker order, as far as there is no gap (a contribution
        already in it, the second in order that arrived first, is passed over)."""
        while self._summed < len(self._order) and self._order[self._summed] in self._pending:  # held ones are pending
            if self._order[self._summed] not in self._held:  # in the accumulator already (``_second_first``)
                self._summed += 1
                continue
            grad = self._held.pop(self._order[self._summed])
            if grad.numel():
                if not self._has_sum:
                    self._accum.copy_(grad)  # the first contribution of a step: no zeroing pass; bf16 widens here
                else:
                    self._accum.add_(grad)
                self._has_sum = True
            self._summed += 1

    def _adoptable(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can stand in for the accumulator: float32 (a bfloat16 push is widened into it), the
        same shape, its own storage from the start (not a view into something the caller still uses)."""
        accum = self._accum
        return (
            grad.dtype == accum.dtype
            and grad.shape == accum.shape
            and grad.device == accum.device
            and grad.is_contiguous()
            and grad.storage_offset() == 0
            and grad._base is None
        )

    def _lone_contribution(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (its worker just counted as pending) is the step's only contribution with a payload and
        completes it (the lock held): nothing summed or held, every contributor in. Float32, the accumulator's shape.

        Only for an update that reads the gradient in one pass (a fused kernel, which also divides as it reads): a
        layer-wise one reads it in several, with its peers' norms awaited between them, and a region written again
        meanwhile (a retried push) would be read twice with different contents; it is given the accumulator's copy."""
        accum, optimizer = self._accum, self._optimizer
        return (
            not isinstance(optimizer, LayerwiseOptimizer)
            and all(group.get("fused") for group in optimizer.param_groups)
            and not self._has_sum
            and not self._held
            and len(self._pending) == len(self._order)
            and grad.dtype == accum.dtype
            and grad.shape == accum.shape
            and grad.device == accum.device
        )

    def _second_first(self, worker_id: int) -> bool:
        """Whether ``worker_id`` is second in summing order and its contribution comes before anything was summed
        (the lock held): the first two of a sum commute exactly, later ones do not, so only this one is placed early."""
        return not self._has_sum and self._summed == 0 and len(self._order) > 1 and worker_id == self._order[1]

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
        if worker_id not in self._order:
            raise StepConflict(
                f"worker {worker_id} does not contribute to step {step} of shard {self.shard_id}: the job goes on "
                f"with workers {list(self._order)} (cluster.min_workers); register again to rejoin"
            )
        return False

    def _apply_update(self) -> bool:
        """Called with the lock held once every worker has contributed; True if the step was skipped."""
        skipped = self._skip_step
        if skipped:
            self._skipped_steps += 1
        else:
            # The device sum (lent: where the caller holds it); the fused step divides as it reads (one pass).
            self._param.grad = self._accum if self._borrowed is None else self._borrowed
            for group in self._optimizer.param_groups:
                group["lr"] = learning_rate(self._schedule, self._version)
            try:
                step_on_mean(self._optimizer, sum(self._pending.values()))
            except BaseException as exc:
                # Half done (the gradient divided, the optimizer's step counted, LAMB's moments moved): nothing may
                # step or snapshot this shard again; it is restored from a checkpoint (the job rolls back).
                self._failed = f"its update of step {self._version} failed ({type(exc).__name__}: {exc})"
                self._param.grad = None
                self._cond.notify_all()
                raise
            self._param.grad = None
            self._publish()
        self._previous = self._published if skipped else self._spare  # version ``_version`` until the next update
        self._pending.clear()
        self._summed = 0
        self._has_sum = False
        self._skip_step = False
        self._version += 1
        self._order = self._contributors
        change = self._changes.pop(self._version, None)
        if change is not None:
            self._enter(*change)
        self._cond.notify_all()
        return skipped

    def _publish(self) -> None:
        """Copy the parameters into a buffer no reader holds and publish it (double buffering).

        Reusing the spare buffer costs a memcpy; a fresh 100 MB allocation per step would cost
        page faults several times that. A reader still holding the spare (a stalled pull) keeps
        it: the shard then allocates instead of waiting. On a board (``publish_on``) the two
        buffers are its halves and each write is stamped; a buffer off the board holds a
        version the board does not show, and its pulls are copied as before.
        """
        board = self._board
        if board is not None:
            half = board.spare_half(self._published)
            if not self._readers.get(id(board.halves[half])):
                board.write(half, self._param.detach(), self._version + 1)
                self._spare, self._published = self._published, board.halves[half]
                return
        spare = self._spare
        if spare is None or self._readers.get(id(spare)) or (board is not None and board.holds(spare)):
            spare = torch.empty_like(self._published)
        spare.copy_(self._param.detach())
        self._spare, self._published = self._published, spare

    def publish_on(self, board: PieceBoard) -> None:
        """Issue 12: publish into ``board`` (the shard's published board, ``runtime.shm_board``) from now on, so
        that colocated workers copy each version straight out of it; the current version goes there now."""
        if board.numel != self.numel:
            raise InvalidArgument(f"a board piece of {board.numel} elements for a piece of {self.numel}")
        with self._cond:
            self._settled()
            board.write(0, self._published, self._version)
            board.stamps[1] = WRITING
            self._published, self._spare = board.halves[0], board.halves[1]
            self._board = board

    def board_slot(self, min_version: int) -> tuple[int, int] | None:
        """(version, board slot) of the newest version on the board if it is ``min_version`` or newer; lock-free
        (the reader checks the slot's stamp after copying, ``Board.copy_out``)."""
        board = self._board
        return None if board is None else board.newest(min_version)

    # ------------------------------------------------------------------ pull

    @contextmanager
    def read(self, min_version: int, timeout_s: float) -> Iterator[tuple[int, torch.Tensor]]:
        """Wait for ``min_version``, then lend the published parameters while the caller streams them.

        The published tensor is never written again (an update publishes a new one), so the
        caller holds no lock and a stalled reader never delays a step.
        """
        with self._cond:
            self._wait_for(min_version, timeout_s)
            version, published = self._version, self._published
            self._readers[id(published)] = self._readers.get(id(published), 0) + 1
        with self._lent(published):
            yield version, published

    def last_step_of(self, worker_id: int) -> int:
        """The last step ``worker_id`` contributed to here (-1: none since this shard was built)."""
        with self._cond:
            return self._last_step.get(worker_id, -1)

    @contextmanager
    def read_at(self, version: int, timeout_s: float) -> Iterator[torch.Tensor]:
        """Wait for ``version``, then lend the parameters of exactly that version: the published buffer, or the
        previous one once the shard has moved one step past it.

        Why: a worker that died after pushing some pieces of a step leaves those pieces one version ahead of the
        others; its replacement reads every piece at the held version and redoes the step (its pushes to the pieces
        that moved on are duplicates), so the job goes on in place with the fault-free result. The previous buffer
        is the spare of the double buffering: it costs nothing and lives until the next update, which cannot come
        before the replacement pushes.
        """
        with self._cond:
            self._wait_for(version, timeout_s)
            if self._version == version:
                lent = self._published
            elif self._version == version + 1 and self._previous is not None:
                lent = self._previous
            else:
                raise StepConflict(
                    f"shard {self.shard_id} [{self.start}, {self.end}) is at version {self._version}; version "
                    f"{version} is no longer kept (a shard keeps the one before its current version)"
                )
            self._readers[id(lent)] = self._readers.get(id(lent), 0) + 1
        with self._lent(lent):
            yield lent

    def _wait_for(self, version: int, timeout_s: float) -> None:
        """Wait (the lock held) until the shard is at ``version`` or newer."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_open()
            if self._version >= version:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(
                    f"shard {self.shard_id} is at version {self._version}; version {version} did not appear within "
                    f"{timeout_s:.1f}s (are all {self.workers} workers pushing?)"
                )
            self._cond.wait(remaining)

    @contextmanager
    def _lent(self, buffer: torch.Tensor) -> Iterator[None]:
        """Hand back a buffer counted in ``_readers`` (under the lock) once the reader is done with it."""
        try:
            yield
        finally:
            with self._cond:
                left = self._readers.pop(id(buffer)) - 1
                if left:
                    self._readers[id(buffer)] = left

    def parameters(self) -> tuple[int, torch.Tensor]:
        """A copy of the current parameters and their version (for tests and checkpoints)."""
        with self._cond:
            return self._version, self._published.clone()

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> ShardState:
        """A consistent snapshot of the shard at its current version (parameters + optimizer state)."""
        with self._cond:
            self._settled()  # not halfway through an update (LAMB's moments move before the norms are in)
            return self._checkpoint_state()

    def _checkpoint_state(self) -> ShardState:
        """Called with the lock held: parameters and optimizer state copied (the writer holds them a while)."""
        optimizer = self._optimizer.state_dict()
        state = {
            index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for index, entry in optimizer["state"].items()
        }
        copied = {"state": state, "param_groups": [dict(g) for g in optimizer["param_groups"]]}
        params = self._published.clone()
        return ShardState(self.shard_id, self.start, self.end, self._version, params, copied)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wake every waiting pull so a shutting-down server drains quickly."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._failed is not None:
            raise NotReady(f"shard {self.shard_id} [{self.start}, {self.end}) {self._failed}; restart it")
        if self._closed:
            raise NotReady(f"shard {self.shard_id} is shutting down")

    def _settled(self) -> None:
        """Wait (the lock held) until no update is halfway, for what changes the step or reads mid-update state."""
        self._cond.wait_for(lambda: self._closed or self._failed is not None or not self._updating)
        self._check_open()

    @contextmanager
    def _outside_lock(self) -> Iterator[None]:
        """A layer-wise update (the lock held) waits for its peers' partial norms without the lock.

        The peers send theirs once their own step is complete. When the worker that failed had pushed the
        step here but not to them, that takes its replacement's pushes, and before those the replacement
        asks this shard for its status and the held version and pushes here too (a duplicate): with the
        lock held for the whole exchange it waited for it until the exchange timed out, and the job rolled
        back (issue 11, S2.5). Meanwhile reads of published buffers, status and duplicate pushes go on; what
        changes the step or reads the update's half-done state waits (``_settled``). The parameters are not
        written before the norms are in, so every reader still sees the published version.
        """
        assert self._cond._is_owned(), "a layer-wise update runs under the shard's lock"  # type: ignore[attr-defined]
        self._updating = True
        self._cond.release()
        try:
            yield
        finally:
            self._cond.acquire()
            self._updating = False
            self._cond.notify_all()
        self._check_open()  # closed meanwhile (the server stops): the update does not publish

    def snapshot(self) -> ShardSnapshot:
        with self._cond:
            state_bytes = sum(
                t.numel() * t.element_size()
                for state in self._optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            )
            buffers = 4 if self._spare is not None else 3  # parameters, published (+ spare), accumulator
            early = sum(g.numel() for g in self._held.values()) * 4  # contributions waiting for a lower worker
            held = self._param.numel() * buffers * 4 + state_bytes + early
            return ShardSnapshot(
                self.shard_id,
                self.start,
                self.end,
                self._version,
                len(self._pending),
                len(self._order),
                held,
                self._optimizer_name,
                self._skipped_steps,
            )
