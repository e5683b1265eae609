"""Data shards: which samples each worker trains on, and who holds which data shard (S2.5 bookkeeping).

A data shard is a slice of one epoch's sample order, never a PS shard (see ``runtime.shard_map``).
An epoch is a permutation of the dataset (seeded by job seed + epoch) cut into data shards of
``data_shard_size`` samples (the job file's ``data.shard_size``). A data shard is recorded against
the worker it is dispatched to and the record is cleared when that worker reports it done; the
data shards of a failed worker can be requeued (``outstanding``/``requeue``, used by the fault
tolerance of S2.5) so no data is lost.

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
    def __init__(self, dataset_size: int, data_shard_size: int, shuffle: bool, seed: int) -> None:
        if dataset_size <= 0:
            raise ValueError("the dataset is empty")
        self.dataset_size = dataset_size
        self.data_shard_size = data_shard_size
        self.shuffle = shuffle
        self.seed = seed
        self.data_shards_per_epoch = -(-dataset_size // data_shard_size)
        self._next = 0  # next fresh data shard id
        self._requeued: deque[DataShardAssignment] = deque()
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

    def _fresh(self) -> DataShardAssignment:
        data_shard_id = self._next
        self._next += 1
        epoch, k = divmod(data_shard_id, self.data_shards_per_epoch)
        order = self._order(epoch)
        size = self.data_shard_size
        return DataShardAssignment(data_shard_id, epoch, order[k * size : (k + 1) * size].tolist())

    def dispatch(self, worker_id: int) -> DataShardAssignment:
        with self._lock:
            data_shard = self._requeued.popleft() if self._requeued else self._fresh()
            self._doing[data_shard.data_shard_id] = (worker_id, data_shard)
            return data_shard

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
        """Put a failed worker's unfinished data shards first in line (S2.5); returns their ids."""
        with self._lock:
            mine = sorted(dsid for dsid, (w, _) in self._doing.items() if w == worker_id)
            for dsid in reversed(mine):
                self._requeued.appendleft(self._doing.pop(dsid)[1])
            return mine

    def counts(self) -> DataShardCounts:
        with self._lock:
            left_in_epoch = self.data_shards_per_epoch - self._next % self.data_shards_per_epoch
            return DataShardCounts(todo=left_in_epoch + len(self._requeued), doing=len(self._doing), done=self._done)
