"""Data shards: which samples each worker trains on, and who holds which data shard (S2.5 bookkeeping).

A data shard is a slice of one epoch's sample order, never a PS shard (see ``runtime.shard_map``).
An epoch is a permutation of the dataset (seeded by job seed + epoch) cut into data shards of
``data_shard_size`` samples (the job file's ``data.shard_size``); data shard ``k`` is the
``k % per_epoch``-th slice of epoch ``k // per_epoch``.

Data order is a function of (seed, epoch, worker slot, step): worker slot ``w`` of ``slots``
gets data shards ``w, w + slots, w + 2 * slots, ...`` in that order, whenever it asks. So the
samples of a step do not depend on which worker asked first, and a job resumed from the
checkpoint of step ``t`` (``resume``) trains on exactly the samples an uninterrupted run would.

A data shard is recorded against the worker it is dispatched to and the record is cleared when
that worker reports it done; the data shards of a failed worker can be requeued for its slot
(``outstanding``/``requeue``, S2.5), so its replacement trains on them and no data is lost.
A replacement that resumes the slot at step ``t`` (the version it pulled) gets the slot
``reposition``-ed there: what the failed worker consumed before ``t`` counts as done (it was
pushed), the data shard it was inside is handed out again from the first sample of step ``t``.
Every completion is kept (``completed_ids``): the ledger that shows each sample trained once.

A restarted coordinator rebuilds the tracker from its journal (``coordinator/journal.py``): the
state at the last compaction (``snapshot``/``restore``) and then the same calls again, which are
deterministic. A request numbered ``seq`` that is asked again (its reply was lost with the old
coordinator) gets the same data shard; a completion asked again is refused (NOT_FOUND), which the
worker's retry takes as done (``worker/coordinator_link.py``).

Thread-safe on its own: the tracker's lock is a leaf lock, never held while calling out.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from pstrain.coordinator.errors import UnknownMember


@dataclass(frozen=True)
class DataShardAssignment:
    data_shard_id: int
    epoch: int
    indices: list[int]


@dataclass(frozen=True)
class DataShardCounts:
    todo: int  # left in the current epoch (plus requeued)
    doing: int
    done: int


class DataShardTracker:
    def __init__(self, dataset_size: int, data_shard_size: int, shuffle: bool, seed: int, slots: int = 1) -> None:
        if dataset_size <= 0:
            raise ValueError("the dataset is empty")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.dataset_size = dataset_size
        self.data_shard_size = data_shard_size
        self.shuffle = shuffle
        self.seed = seed
        self.slots = slots
        self.data_shards_per_epoch = -(-dataset_size // data_shard_size)
        self._next = list(range(slots))  # per slot: the next fresh data shard id
        self._requeued: list[deque[DataShardAssignment]] = [deque() for _ in range(slots)]
        self._doing: dict[int, tuple[int, DataShardAssignment]] = {}  # data shard id -> (worker, data shard)
        self._done = 0
        self._completed: list[int] = []  # data shard ids in completion order (a resumed tracker: since the resume)
        self._last: dict[int, tuple[int, DataShardAssignment]] = {}  # worker -> (seq, data shard) of its last request
        self._perm_epoch = -1
        self._perm = torch.arange(0)
        self._lock = threading.Lock()

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.dataset_size, generator=gen)
            else:
                self._perm = torch.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def _slot(self, worker_id: int) -> int:
        return worker_id % self.slots

    def _fresh(self, slot: int) -> DataShardAssignment:
        data_shard_id = self._next[slot]
        self._next[slot] += self.slots
        epoch, k = divmod(data_shard_id, self.data_shards_per_epoch)
        order = self._order(epoch)
        size = self.data_shard_size
        return DataShardAssignment(data_shard_id, epoch, order[k * size : (k + 1) * size].tolist())

    def dispatch(self, worker_id: int, seq: int = 0) -> DataShardAssignment:
        """The next data shard of the worker's slot; request ``seq`` (> 0) asked again gets the same one."""
        with self._lock:
            last = self._last.get(worker_id)
            if seq > 0 and last is not None and last[0] == seq and last[1].data_shard_id in self._doing:
                return last[1]
            queue = self._requeued[self._slot(worker_id)]
            data_shard = queue.popleft() if queue else self._fresh(self._slot(worker_id))
            self._doing[data_shard.data_shard_id] = (worker_id, data_shard)
            if seq > 0:
                self._last[worker_id] = (seq, data_shard)
            return data_shard

    def resume(self, step: int, samples_per_step: int) -> None:
        """Position every slot where an uninterrupted run is after ``step`` steps.

        Each worker consumes ``samples_per_step`` samples a step from its slot's sequence, so
        the position is known from the step alone: whole data shards behind it count as done,
        and the one it is inside is handed out again from the first unconsumed sample.
        """
        with self._lock:
            if self._doing or any(self._requeued) or self._next != list(range(self.slots)):
                raise RuntimeError("resume() positions a fresh tracker; this one has dispatched data shards")
            for slot in range(self.slots):
                left = step * samples_per_step
                while left > 0:
                    data_shard = self._fresh(slot)
                    taken = min(left, len(data_shard.indices))
                    left -= taken
                    if taken == len(data_shard.indices):
                        self._done += 1
                    else:
                        rest = DataShardAssignment(
                            data_shard.data_shard_id, data_shard.epoch, data_shard.indices[taken:]
                        )
                        self._requeued[slot].append(rest)

    def complete(self, worker_id: int, data_shard_id: int) -> None:
        with self._lock:
            holder = self._doing.get(data_shard_id)
            if holder is None or holder[0] != worker_id:
                raise UnknownMember(f"data shard {data_shard_id} is not held by worker {worker_id}")
            del self._doing[data_shard_id]
            self._done += 1
            self._completed.append(data_shard_id)

    def reposition(self, worker_id: int, step: int, samples_per_step: int) -> list[int]:
        """A replacement resumes ``worker_id``'s slot at ``step``: position the slot where an
        uninterrupted run is after ``step`` steps (S2.5); returns the ids counted done here.

        The slot's dispatched-but-unfinished data shards (held, or already requeued by ``requeue``) are
        dropped: the ones wholly behind the position were trained and pushed by the failed worker before
        it could report them, so they count as done now; the one the position is inside is requeued from
        its first unconsumed sample.
        """
        with self._lock:
            slot = self._slot(worker_id)
            doing = {dsid for dsid, (w, _) in self._doing.items() if self._slot(w) == slot}
            for dsid in doing:
                del self._doing[dsid]
            # Held, never completed: in flight, or requeued when the worker was declared failed (``requeue``
            # runs first), or the partial data shard a ``resume`` left. Those behind the position were pushed.
            held = doing | {data_shard.data_shard_id for data_shard in self._requeued[slot]}
            for worker in [w for w in self._last if self._slot(w) == slot]:
                del self._last[worker]
            dispatched_before = self._next[slot]
            self._requeued[slot].clear()
            self._next[slot] = slot
            finished: list[int] = []
            left = step * samples_per_step
            while left > 0:
                data_shard = self._fresh(slot)
                taken = min(left, len(data_shard.indices))
                left -= taken
                if taken < len(data_shard.indices):
                    rest = DataShardAssignment(data_shard.data_shard_id, data_shard.epoch, data_shard.indices[taken:])
                    self._requeued[slot].append(rest)
                elif data_shard.data_shard_id in held or data_shard.data_shard_id >= dispatched_before:
                    finished.append(data_shard.data_shard_id)
            self._done += len(finished)
            self._completed.extend(finished)
            return finished

    def completed_ids(self) -> list[int]:
        """Every data shard completed through this tracker, in completion order (duplicates would be a bug)."""
        with self._lock:
            return list(self._completed)

    def outstanding(self, worker_id: int) -> list[int]:
        """The ids of the data shards a worker holds and has not completed (S2.5: what a failure loses)."""
        with self._lock:
            return sorted(dsid for dsid, (w, _) in self._doing.items() if w == worker_id)

    def requeue(self, worker_id: int) -> list[int]:
        """Put a failed worker's unfinished data shards first in line for its slot (S2.5); returns their ids."""
        with self._lock:
            mine = sorted(dsid for dsid, (w, _) in self._doing.items() if w == worker_id)
            queue = self._requeued[self._slot(worker_id)]
            for dsid in reversed(mine):
                queue.appendleft(self._doing.pop(dsid)[1])
            self._last.pop(worker_id, None)
            return mine

    # ------------------------------------------------------------------ the journal's snapshot

    def _ref(self, data_shard: DataShardAssignment) -> list[int]:
        """A data shard as (id, samples skipped): every assignment is a suffix of its slice of the epoch."""
        full = min(
            self.data_shard_size,
            self.dataset_size - (data_shard.data_shard_id % self.data_shards_per_epoch) * self.data_shard_size,
        )
        return [data_shard.data_shard_id, full - len(data_shard.indices)]

    def _unref(self, ref: list[int]) -> DataShardAssignment:
        data_shard_id, skipped = ref
        epoch, k = divmod(data_shard_id, self.data_shards_per_epoch)
        size = self.data_shard_size
        indices = self._order(epoch)[k * size : (k + 1) * size].tolist()[skipped:]
        return DataShardAssignment(data_shard_id, epoch, indices)

    def snapshot(self) -> dict[str, Any]:
        """The tracker's state as plain JSON (sample lists as (id, skipped) references)."""
        with self._lock:
            return {
                "next": list(self._next),
                "requeued": [[self._ref(d) for d in queue] for queue in self._requeued],
                "doing": [[worker, *self._ref(d)] for worker, d in self._doing.values()],
                "last": [[worker, seq, *self._ref(d)] for worker, (seq, d) in self._last.items()],
                "done": self._done,
                "completed": list(self._completed),
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Take a ``snapshot``'s state (a restarted coordinator, before replaying its journal)."""
        with self._lock:
            if len(state["next"]) != self.slots:
                raise ValueError(f"the snapshot has {len(state['next'])} slots, this tracker {self.slots}")
            self._next = [int(n) for n in state["next"]]
            self._requeued = [deque(self._unref(r) for r in queue) for queue in state["requeued"]]
            self._doing = {}
            for worker, *ref in state["doing"]:
                data_shard = self._unref(ref)
                self._doing[data_shard.data_shard_id] = (worker, data_shard)
            self._last = {worker: (seq, self._unref(ref)) for worker, seq, *ref in state["last"]}
            self._done = int(state["done"])
            self._completed = [int(dsid) for dsid in state["completed"]]

    def counts(self) -> DataShardCounts:
        with self._lock:
            fresh = sum((nxt - slot) // self.slots for slot, nxt in enumerate(self._next))
            left_in_epoch = self.data_shards_per_epoch - fresh % self.data_shards_per_epoch
            requeued = sum(len(q) for q in self._requeued)
            return DataShardCounts(todo=left_in_epoch + requeued, doing=len(self._doing), done=self._done)
