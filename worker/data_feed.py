"""Turns the coordinator's data shards into this worker's per-step batches.

A step's batch may span shards. A shard is reported done only after the step that consumed
its last sample has been pushed, so a worker that dies mid-step never loses a data shard (S2.5).

With ``prefetch`` the trainer asks for the next step's batch (``prefetch``) as soon as it has this
step's: its samples are read and collated in a background thread while the step computes, as torch's
``DataLoader`` workers would. Only the reading moves: which samples a step takes, and when their data
shards count as done, is decided by ``next_indices`` on the trainer's thread exactly as without it, and a
prefetched batch is used only for the very indices it was read for (else it is dropped and read again).
The dataset is never read by two threads at once: the trainer waits for the background read before it reads.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils.data import default_collate

from pstrain.protos import pstrain_pb2 as pb


class ShardSource(Protocol):
    """Where data shards come from: the coordinator over gRPC, or a list in tests."""

    def request(self) -> pb.DataShard: ...

    def complete(self, data_shard_id: int) -> None: ...


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DataFeed:
    dataset: torch.utils.data.Dataset
    source: ShardSource
    prefetch_batches: bool = False  # the JobSpec's data.prefetch: read the next step's batch in the background
    _queue: deque[tuple[int, int]] = field(default_factory=deque)  # (sample index, data shard id)
    _left: dict[int, int] = field(default_factory=dict)  # data shard id -> samples not consumed yet
    _exhausted: list[int] = field(default_factory=list)
    _ahead: tuple[list[int], Future[Batch]] | None = None  # the indices read in the background, and their batch

    def _fill(self, count: int) -> None:
        """Request data shards until at least ``count`` samples are queued."""
        while len(self._queue) < count:
            data_shard = self.source.request()
            if not data_shard.indices:
                raise RuntimeError(f"coordinator sent data shard {data_shard.data_shard_id} without samples")
            self._queue.extend((index, data_shard.data_shard_id) for index in data_shard.indices)
            self._left[data_shard.data_shard_id] = len(data_shard.indices)

    def next_indices(self, count: int) -> list[int]:
        self._fill(count)
        indices = []
        for _ in range(count):
            index, data_shard_id = self._queue.popleft()
            indices.append(index)
            self._left[data_shard_id] -= 1
            if self._left[data_shard_id] == 0:  # its last sample is in this step
                del self._left[data_shard_id]
                self._exhausted.append(data_shard_id)
        return indices

    def peek_batch(self, count: int) -> Batch:
        """The next ``count`` samples without consuming them (the probe trains on nothing)."""
        if self._ahead is not None:
            self._ahead[1].exception()  # wait: the dataset is read by one thread at a time
        self._fill(count)
        return self._collate([index for index, _ in list(self._queue)[:count]])

    def next_batch(self, count: int) -> Batch:
        indices = self.next_indices(count)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead[0] == indices:
                return ahead[1].result()  # its error, if reading failed, is this step's (as a read here would raise)
            ahead[1].exception()  # other samples (a step of another size): wait, one reader at a time, and drop it
        return self._collate(indices)

    def prefetch(self, count: int) -> None:
        """Start reading the batch of the next ``count`` samples (the next step's) in the background; a no-op
        without ``prefetch_batches``. Requests the data shards it needs now, on the caller's thread."""
        if not self.prefetch_batches or self._ahead is not None:
            return
        self._fill(count)
        indices = [index for index, _ in list(self._queue)[:count]]
        read: Future[Batch] = Future()

        def run() -> None:
            if read.set_running_or_notify_cancel():
                try:
                    read.set_result(self._collate(indices))
                except BaseException as exc:  # noqa: BLE001 - raised by the step that takes this batch
                    read.set_exception(exc)

        # A daemon thread per read, not a pool's: a pool's threads are joined at exit, so a read that hangs (a
        # network file system) would hold a stopping worker past its unit's stop timeout.
        threading.Thread(target=run, name="data-prefetch", daemon=True).start()
        self._ahead = (indices, read)

    def close(self) -> None:
        """Forget the read in flight (it ends on its own; nothing waits for it)."""
        if self._ahead is not None:
            self._ahead[1].cancel()  # not started yet: never will be
        self._ahead = None

    def _collate(self, indices: list[int]) -> Batch:
        """One batch, fetched as torch's ``DataLoader`` fetches it: a dataset with ``__getitems__`` (``Subset``, a
        user's batched reader) gets the whole index list in one call, any other is indexed sample by sample; either
        way the samples are ``(input, target)`` pairs and ``default_collate`` makes the batch."""
        fetch = getattr(self.dataset, "__getitems__", None)
        samples = fetch(indices) if fetch else [self.dataset[i] for i in indices]
        batch = default_collate(samples)
        return batch[0], batch[1]

    def commit(self) -> None:
        """The step that used the exhausted shards is safely pushed: report them done."""
        for data_shard_id in self._exhausted:
            self.source.complete(data_shard_id)
        self._exhausted.clear()
