"""A PS shard's part of the sparse embedding tables: rows, their optimizer, the sync protocol (S5).

Rows live here, in host memory, sharded by id (``runtime.sparse_rows.owner_of``: ``id % shards``).
A row is created the first time a worker pulls it, with the value ``init_rows`` gives it (a
function of seed, table and id, so creation order does not matter); rows nobody touched cost
nothing. ``SparseTable`` is one table's rows on this shard; ``SparseShard`` is all tables of a
shard and the same synchronous protocol as the dense shard (``ps_server/shard.py``):

    push(step == v, new worker)  -> held; the last one applies the update, v -> v + 1
    push(same worker, same step) -> duplicate: acknowledged, not counted again (retry-safe)
    push(step < v or step > v)   -> StepConflict (stale / ahead)
    push(bad ids, dtypes, shapes, counts, non-finite values, rows of another shard)
                                 -> InvalidArgument, nothing changed
    push(skip=True)              -> counted without rows; the step completes without an update
    pull(min_version)            -> waits until v >= min_version, returns the rows (creating them)

Every worker pushes to every shard once per step, with no blocks when none of its rows lives
here: that is how a shard knows a step is complete.

The update (S5.3, S5.4). For each row touched in the step, the shard adds the workers'
contributions in worker order (deterministic), each a per-row gradient sum over that worker's
devices plus the number of devices in which the id occurred, and divides the sum by

* ``count`` (default, the source's rule): the total number of devices in which the id occurred;
* ``devices`` (the dense rule): the number of devices of the whole job.

Each touched row is updated exactly once per step with the table's optimizer: SGD; Adagrad
(``acc += g^2; w -= lr g / (sqrt(acc) + 1e-10)``, ``torch.optim.Adagrad``'s rule and eps: the table's ``eps`` is
Adam's); or lazy row-wise Adam (moments and a step
count per row, advanced only when the row is touched). Rows not touched are never written.
The learning rate of step ``t`` is the table's ``lr``, times the dense schedule's factor of ``t``
(``learning_rate(schedule, t) / scaled_lr``: the warmup) unless the table's ``lr_schedule`` is
``constant``.

Pulls are of one version: ``pull(v)`` waits until the tables are at ``v`` and returns the rows
*as of* ``v``. A shard one step past ``v`` (a replaced worker redoes the step its predecessor
had pushed, S2.5) answers from the pre-update copy of the rows it changed in step ``v`` (kept
until the next step completes; it cannot go further without that worker), so a redone step sees
exactly the rows the first attempt saw, and its push is a duplicate. Further behind is stale.

Checkpoints (``SparseCheckpoints``): at a due version the shard copies the rows it holds and
their optimizer state under its lock (one memcpy per tensor, in slot order) and hands the copy,
outside the lock, to a background writer (``sparse_checkpoint.py``), in version order
(``hand_over.HandOverTurns``): a newer copy waits until every older one has been handed over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.hand_over import HandOverTurns
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.schedule import learning_rate
from pstrain.runtime.sparse_rows import RowError, TableSpec, check_ids, init_rows, owner_of

RowGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(ids int64 [n], gradient sums float32 [n, dim], device counts int32 [n]) of one table."""

ADAGRAD_EPS = 1e-10
"""Adagrad's eps, ``torch.optim.Adagrad``'s default (``embeddings.<table>.eps`` is Adam's, 1e-8 by default: at
Adagrad's first step of a row with gradients near 1e-7 it would shrink the update by a tenth)."""


@dataclass(frozen=True)
class RowsPushResult:
    version: int
    duplicate: bool
    completed: bool
    skipped: bool = False
    update_s: float = 0.0


@dataclass(frozen=True)
class TableState:
    """A table's rows on one shard, for checkpoints and export: ids, rows and optimizer state per row."""

    spec: TableSpec
    ids: torch.Tensor  # int64 [n], ascending
    rows: torch.Tensor  # float32 [n, dim]
    state: dict[str, torch.Tensor]  # per-row optimizer state, same order as ids

    def sorted(self) -> TableState:
        """The same rows, ids ascending (a snapshot is in slot order)."""
        order = torch.argsort(self.ids)
        return TableState(self.spec, self.ids[order], self.rows[order], {k: v[order] for k, v in self.state.items()})


@dataclass(frozen=True)
class SparseCheckpoints:
    """When the tables snapshot themselves: every ``every_steps`` versions and at ``final_version``."""

    every_steps: int
    final_version: int
    on_snapshot: Callable[[int, dict[str, TableState]], None]  # outside the lock, in version order; may block

    def due(self, version: int) -> bool:
        return self.every_steps > 0 and (version % self.every_steps == 0 or version == self.final_version)


@dataclass(frozen=True)
class _Snapshot:
    """A due checkpoint's tables at ``version`` and its turn among this shard's snapshots (``_hand_over``)."""

    version: int
    tables: dict[str, TableState]
    turn: int


class SparseTable:
    """One table's rows owned by one shard: id -> slot index, rows and optimizer state in growable tensors."""

    def __init__(self, spec: TableSpec, shard_id: int, shards: int) -> None:
        self.spec = spec
        self.shard_id = shard_id
        self.shards = shards
        self._slot: dict[int, int] = {}
        self._ids = torch.empty(0, dtype=torch.int64)  # slot -> id
        self._rows = torch.empty(0, spec.dim, dtype=torch.float32)
        self._state = {name: torch.empty(0, *shape) for name, shape in self._state_shapes().items()}

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.spec.optimizer == "adagrad":
            return {"sum": (self.spec.dim,)}
        if self.spec.optimizer == "adam":
            return {"exp_avg": (self.spec.dim,), "exp_avg_sq": (self.spec.dim,), "step": ()}
        return {}

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def bytes_held(self) -> int:
        return (self._rows.numel() + sum(s.numel() for s in self._state.values())) * 4

    def check(self, ids: torch.Tensor, what: str, unique: bool = False) -> None:
        """``InvalidArgument`` unless ``ids`` are valid row ids of this table that this shard owns (and, ``unique``,
        each once: a pull or a load that names a row twice would cost its reply, or corrupt the table's slots)."""
        try:
            check_ids(ids, self.spec.rows, f"table {self.spec.name!r} {what}")
        except RowError as exc:
            raise InvalidArgument(str(exc)) from None
        if unique and ids.numel() > 1 and int(torch.unique(ids).numel()) != int(ids.numel()):
            repeated = int(ids.numel()) - int(torch.unique(ids).numel())
            raise InvalidArgument(f"table {self.spec.name!r} {what}: row ids must be unique, {repeated} repeat")
        if ids.numel() and bool((owner_of(ids, self.shards) != self.shard_id).any()):
            bad = int(ids[owner_of(ids, self.shards) != self.shard_id][0])
            raise InvalidArgument(
                f"table {self.spec.name!r}: row {bad} belongs to shard {bad % self.shards}, not shard "
                f"{self.shard_id} (rows are dealt by id % {self.shards})"
            )

    def slots(self, ids: torch.Tensor, create: bool) -> torch.Tensor:
        """The slot of each id; missing ids are created with their initial value (``create``) or are -1."""
        slot = self._slot
        found = [slot.get(i, -1) for i in ids.tolist()]
        missing = [i for i, s in zip(ids.tolist(), found, strict=True) if s < 0]
        if missing and create:
            new = torch.tensor(sorted(set(missing)), dtype=torch.int64)
            self._insert(new, init_rows(self.spec, new))
            found = [slot[i] for i in ids.tolist()]
        return torch.tensor(found, dtype=torch.int64)

    def _insert(self, new: torch.Tensor, rows: torch.Tensor) -> None:
        """Append rows for ids not held yet, with zero optimizer state."""
        first = len(self._slot)
        self._grow(first + len(new))
        self._rows[first : first + len(new)] = rows
        self._ids[first : first + len(new)] = new
        for tensor in self._state.values():
            tensor[first : first + len(new)] = 0
        for k, i in enumerate(new.tolist()):
            self._slot[i] = first + k

    def load(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Set the initial value of rows ``ids`` (unique, owned here) to ``rows``: ``model.init_checkpoint``'s rows
        replace the seeded init before training (their optimizer state starts at zero, as the dense one does)."""
        self.check(ids, "init_checkpoint", unique=True)
        if tuple(rows.shape) != (int(ids.numel()), self.spec.dim) or rows.dtype != torch.float32:
            raise InvalidArgument(
                f"table {self.spec.name!r}: init_checkpoint rows must be float32 of shape ({int(ids.numel())}, "
                f"{self.spec.dim}), got {rows.dtype} {tuple(rows.shape)}"
            )
        held = self.slots(ids, create=False)
        fresh = held < 0
        if bool(fresh.any()):
            self._insert(ids[fresh], rows[fresh])
        if bool((~fresh).any()):
            self._rows[held[~fresh]] = rows[~fresh]

    def _grow(self, need: int) -> None:
        capacity = self._rows.shape[0]
        if need <= capacity:
            return
        capacity = max(need, 2 * capacity, 1024)
        self._rows = _grown(self._rows, capacity)
        self._ids = _grown(self._ids, capacity)
        self._state = {name: _grown(t, capacity) for name, t in self._state.items()}

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (creating untouched ones), as a new tensor."""
        slots = self.slots(ids, create=True)  # first: creating rows may reallocate ``_rows``
        return self._rows[slots]

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, divisor: torch.Tensor, lr: float) -> torch.Tensor:
        """One optimizer step at ``lr`` on rows ``ids`` (unique) with gradient ``grads / divisor[:, None]``.

        Returns the rows as they were before the step (in the order of ``ids``).
        """
        slots = self.slots(ids, create=True)
        g = grads / divisor.to(torch.float32)[:, None]
        s = self.spec
        before = self._rows[slots]  # a copy (advanced indexing)
        w = before.clone()
        if s.optimizer == "sgd":
            w.add_(g, alpha=-lr)
        elif s.optimizer == "adagrad":
            acc = self._state["sum"][slots].addcmul_(g, g)
            self._state["sum"][slots] = acc
            w.addcdiv_(g, acc.sqrt().add_(ADAGRAD_EPS), value=-lr)
        else:  # lazy row-wise Adam: bias correction from each row's own step count
            t = self._state["step"][slots] + 1
            m = self._state["exp_avg"][slots].mul_(s.beta1).add_(g, alpha=1 - s.beta1)
            v = self._state["exp_avg_sq"][slots].mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
            self._state["step"][slots] = t
            self._state["exp_avg"][slots] = m
            self._state["exp_avg_sq"][slots] = v
            m_hat = m / (1 - s.beta1**t)[:, None]
            v_hat = v / (1 - s.beta2**t)[:, None]
            w.addcdiv_(m_hat, v_hat.sqrt_().add_(s.eps), value=-lr)
        self._rows[slots] = w
        return before

    def snapshot(self) -> TableState:
        """Every row this shard holds and its optimizer state, in slot order: one copy per tensor (a memcpy)."""
        n = len(self._slot)
        return TableState(
            self.spec, self._ids[:n].clone(), self._rows[:n].clone(), {k: v[:n].clone() for k, v in self._state.items()}
        )

    def state(self) -> TableState:
        """Every row this shard holds, ids ascending (copies)."""
        return self.snapshot().sorted()

    @classmethod
    def restore(cls, state: TableState, shard_id: int, shards: int) -> SparseTable:
        table = cls(state.spec, shard_id, shards)
        table.check(state.ids, "checkpoint", unique=True)
        n = int(state.ids.numel())
        table._grow(n)
        table._rows[:n] = state.rows
        table._ids[:n] = state.ids
        for name in table._state:
            table._state[name][:n] = state.state[name]
        table._slot = {i: k for k, i in enumerate(state.ids.tolist())}
        return table


def _restore_before(rows: torch.Tensor, ids: torch.Tensor, changed: torch.Tensor, before: torch.Tensor) -> None:
    """Overwrite, in ``rows`` (for ``ids``), the rows the last step changed with their values before it."""
    if changed.numel() == 0 or ids.numel() == 0:
        return
    pos = torch.searchsorted(changed, ids).clamp_(max=changed.numel() - 1)
    hit = changed[pos] == ids
    rows[hit] = before[pos[hit]]


def _grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    out = torch.empty(capacity, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class SparseShard:
    """All sparse tables of one PS shard, behind the synchronous step protocol (module docstring)."""

    def __init__(
        self,
        shard_id: int,
        shards: int,
        specs: list[TableSpec],
        workers: int,
        total_devices: int,
        version: int = 0,
        schedule: pb.LrSchedule | None = None,
        checkpoints: SparseCheckpoints | None = None,
    ) -> None:
        if workers <= 0 or total_devices <= 0:
            raise InvalidArgument(f"a shard needs workers and devices, got {workers} and {total_devices}")
        self.shard_id = shard_id
        self.shards = shards
        self.workers = workers
        self.total_devices = total_devices
        self.tables = {s.name: SparseTable(s, shard_id, shards) for s in specs}
        self._version = version
        self._held: dict[int, Mapping[str, RowGrads] | None] = {}  # worker -> its rows (None: skip)
        self._last_step: dict[int, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._schedule = schedule
        self.checkpoints = checkpoints
        self._turns = HandOverTurns()  # due snapshots reach ``on_snapshot`` in version order (``_hand_over``)
        self._undo: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # table -> (ids ascending, rows before the
        # last completed step), for pulls of the version before it
        self._undo_known = False  # a step completed here: ``_undo`` says how the version before differs (a shard
        # restored from a checkpoint has not seen that step, so it cannot answer for the version before it)

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def version_now(self) -> int:
        """``version`` without the lock (reading an int is atomic), ``NotReady`` once closed: for the servicer's event
        loop, which waits for a version there rather than in a thread the pushes need (``VersionMarks``)."""
        self._check_open()
        return self._version

    def progress(self, worker_id: int) -> tuple[int, int]:
        """(this shard's version, the last step ``worker_id`` pushed rows for, -1 if none): what a replacement
        checks against the dense version (``worker/row_store.rows_behind``)."""
        if not 0 <= worker_id < self.workers:
            raise UnknownWorker(f"unknown worker {worker_id}: this job has workers 0..{self.workers - 1}")
        with self._cond:
            return self._version, self._last_step.get(worker_id, -1)

    # ------------------------------------------------------------------ pull

    def pull(
        self, min_version: int, ids: Mapping[str, torch.Tensor], timeout_s: float
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait for version ``min_version``, then the rows of ``ids`` per table as of it (created on first touch).

        Returns ``min_version`` and the rows. A shard one step further answers from its pre-update copy
        (module docstring); one further behind raises ``StepConflict``.
        """
        for name, table_ids in ids.items():
            self._table(name).check(table_ids, "pull", unique=True)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_open()
                if self._version >= min_version:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(
                        f"sparse shard {self.shard_id} is at version {self._version}; version {min_version} did not "
                        f"appear within {timeout_s:.1f}s (are all {self.workers} workers pushing rows?)"
                    )
                self._cond.wait(remaining)
            if self._version > min_version + 1 or (self._version == min_version + 1 and not self._undo_known):
                kept = "it keeps the rows of one version back" if self._undo_known else "it was restored at that one"
                raise StepConflict(
                    f"stale pull: rows of version {min_version} asked of sparse shard {self.shard_id}, which is at "
                    f"version {self._version} ({kept})"
                )
            rows = {name: self.tables[name].read(table_ids) for name, table_ids in ids.items()}
            if self._version == min_version + 1:
                for name, table_ids in ids.items():
                    if name in self._undo:
                        _restore_before(rows[name], table_ids, *self._undo[name])
            return min_version, rows

    # ------------------------------------------------------------------ push

    def push(
        self,
        worker_id: int,
        step: int,
        rows: Mapping[str, RowGrads] | None,
        device_count: int,
    ) -> RowsPushResult:
        """One worker's row gradients for ``step`` (``None``: it skips the step); the last one updates."""
        if not 0 <= worker_id < self.workers:
            raise UnknownWorker(f"unknown worker {worker_id}: this job has workers 0..{self.workers - 1}")
        if device_count < 1:
            raise InvalidArgument(f"device_count must be at least 1, got {device_count}")
        if rows is not None:
            for name, grads in rows.items():
                self._check_grads(name, grads, device_count, worker_id, step)
        with self._cond:
            self._check_open()
            if self._classify_step(worker_id, step):
                return RowsPushResult(self._version, duplicate=True, completed=False)
            self._held[worker_id] = rows
            self._last_step[worker_id] = step
            if len(self._held) < self.workers:
                return RowsPushResult(self._version, duplicate=False, completed=False)
            result, snapshot = self._finish_step()
        self._hand_over(snapshot)
        return result

    def _finish_step(self) -> tuple[RowsPushResult, _Snapshot | None]:
        """Every worker is in (the lock held): update, publish, and snapshot if a checkpoint is due.

        The snapshot takes its turn here, under the lock, so the turns follow the versions."""
        started = time.perf_counter()
        skipped = any(r is None for r in self._held.values())
        self._undo = {} if skipped else self._apply()
        self._undo_known = True
        self._held.clear()
        self._version += 1
        snapshot = None
        if self.checkpoints is not None and self.checkpoints.due(self._version):
            tables = {name: t.snapshot() for name, t in self.tables.items()}
            snapshot = _Snapshot(self._version, tables, self._turns.take())
        self._cond.notify_all()
        update_s = time.perf_counter() - started
        return RowsPushResult(self._version, False, True, skipped, update_s), snapshot

    def _hand_over(self, snapshot: _Snapshot | None) -> None:
        """Outside the lock: hand a due checkpoint's snapshot to the writer, after every earlier one.

        Why in turn: once the lock is let go the new version is published, and the workers may complete the next
        due step while this thread is preempted or waits for the writer (backpressure). Handed over first, the
        newer snapshot would be written first; the writer then drops the older one (``SnapshotWriter._in_order``),
        so that step's sparse file is never written and the coordinator never commits it.
        """
        if snapshot is None:
            return
        assert self.checkpoints is not None
        with self._turns.in_turn(snapshot.turn):
            self.checkpoints.on_snapshot(snapshot.version, snapshot.tables)  # may wait for the previous write

    def lr_factor(self, step: int) -> float:
        """The dense schedule's factor of ``step`` (its warmup), which tables with ``lr_schedule: follow`` take."""
        if self._schedule is None or self._schedule.scaled_lr <= 0:
            return 1.0
        return learning_rate(self._schedule, step) / self._schedule.scaled_lr

    def _check_grads(self, name: str, grads: RowGrads, device_count: int, worker_id: int, step: int) -> None:
        table = self._table(name)
        ids, values, counts = grads
        table.check(ids, "push")
        n, dim = int(ids.numel()), table.spec.dim
        if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or tuple(values.shape) != (n, dim):
            got = f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
            raise InvalidArgument(f"table {name!r}: gradients must be float32 of shape ({n}, {dim}), got {got}")
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or tuple(counts.shape) != (n,):
            got = f"{counts.dtype} {tuple(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts).__name__
            raise InvalidArgument(f"table {name!r}: counts must be int32 of shape ({n},), got {got}")
        if n and (int(counts.min()) < 1 or int(counts.max()) > device_count):
            raise InvalidArgument(
                f"table {name!r}: an id occurs on 1..{device_count} devices of a worker, got counts in "
                f"[{int(counts.min())}, {int(counts.max())}]"
            )
        if n and int(torch.unique(ids).numel()) != n:
            raise InvalidArgument(f"table {name!r}: a push lists each row id once (sum a worker's devices first)")
        if not all_finite(values):
            raise InvalidArgument(
                f"worker {worker_id}'s row gradients of table {name!r} for step {step} have NaN or Inf values"
            )

    def _classify_step(self, worker_id: int, step: int) -> bool:
        if self._last_step.get(worker_id) == step:
            return True
        if step != self._version:
            kind = "stale push" if step < self._version else "push ahead of the shard"
            raise StepConflict(
                f"{kind}: worker {worker_id} pushed rows for step {step} but sparse shard {self.shard_id} is at "
                f"step {self._version}"
            )
        return False

    def _apply(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Sum the held contributions per row in worker order, divide per the table's rule, update each row once.

        Returns, per table, the ids updated (ascending) and their rows before the update.
        """
        undo = {}
        factor = self.lr_factor(self._version)
        for name, table in self.tables.items():
            held = [self._held[w] or {} for w in range(self.workers)]  # no None here: a skip applies nothing
            parts = [h[name] for h in held if name in h]
            parts = [p for p in parts if p[0].numel()]
            if not parts:
                continue
            all_ids = torch.cat([p[0] for p in parts])
            unique, inverse = torch.unique(all_ids, return_inverse=True)
            sums = torch.zeros(len(unique), table.spec.dim, dtype=torch.float32)
            counts = torch.zeros(len(unique), dtype=torch.int64)
            offset = 0
            for ids, grads, occurred in parts:  # worker order; ids are unique within a part, so each add is exact
                where = inverse[offset : offset + len(ids)]
                sums.index_put_((where,), grads, accumulate=True)
                counts.index_put_((where,), occurred.to(torch.int64), accumulate=True)
                offset += len(ids)
            if table.spec.averaging == "count":
                divisor = counts
            else:
                divisor = torch.full((len(unique),), self.total_devices, dtype=torch.int64)
            lr = table.spec.lr * (factor if table.spec.lr_schedule == "follow" else 1.0)
            undo[name] = (unique, table.apply(unique, sums, divisor, lr))
        return undo

    # ------------------------------------------------------------------ state

    def states(self) -> tuple[int, dict[str, TableState]]:
        """Every table's rows at the current version (copies), for checkpoints and export."""
        with self._cond:
            return self._version, {name: t.state() for name, t in self.tables.items()}

    def read_table(self, name: str, min_version: int, timeout_s: float) -> tuple[int, TableState]:
        """One table's rows once ``min_version`` exists (the export reads the final version)."""
        self._table(name)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._version < min_version:
                self._check_open()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"sparse shard {self.shard_id} did not reach version {min_version}")
                self._cond.wait(remaining)
            return self._version, self.tables[name].state()

    @classmethod
    def restore(
        cls,
        shard_id: int,
        shards: int,
        version: int,
        states: Mapping[str, TableState],
        workers: int,
        total_devices: int,
        schedule: pb.LrSchedule | None = None,
        checkpoints: SparseCheckpoints | None = None,
    ) -> SparseShard:
        specs = [s.spec for s in states.values()]
        shard = cls(shard_id, shards, specs, workers, total_devices, version, schedule, checkpoints)
        shard.tables = {name: SparseTable.restore(s, shard_id, shards) for name, s in states.items()}
        return shard

    def bytes_held(self) -> int:
        with self._cond:
            return sum(t.bytes_held for t in self.tables.values())

    def rows_held(self) -> dict[str, int]:
        with self._cond:
            return {name: len(t) for name, t in self.tables.items()}

    def _table(self, name: str) -> SparseTable:
        table = self.tables.get(name)
        if table is None:
            raise InvalidArgument(f"no sparse table {name!r}; this job has {', '.join(sorted(self.tables)) or 'none'}")
        return table

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady(f"sparse shard {self.shard_id} is shutting down")

    def iter_tables(self) -> Iterator[str]:
        return iter(self.tables)
