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

Thread-safe on its own: the tracker's lock is a leaf lock, never held while calling out.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

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

    def dispatch(self, worker_id: int) -> DataShardAssignment:
        with self._lock:
            queue = self._requeued[self._slot(worker_id)]
            data_shard = queue.popleft() if queue else self._fresh(self._slot(worker_id))
            self._doing[data_shard.data_shard_id] = (worker_id, data_shard)
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
            return mine

    def counts(self) -> DataShardCounts:
        with self._lock:
            fresh = sum((nxt - slot) // self.slots for slot, nxt in enumerate(self._next))
            left_in_epoch = self.data_shards_per_epoch - fresh % self.data_shards_per_epoch
            requeued = sum(len(q) for q in self._requeued)
            return DataShardCounts(todo=left_in_epoch + requeued, doing=len(self._doing), done=self._done)
