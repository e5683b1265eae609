"""Turns the coordinator's data shards into this worker's per-step batches.

A step's batch may span shards. A shard is reported done only after the step that consumed
its last sample has been pushed, so a worker that dies mid-step never loses a data shard (S2.5).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils.data import default_collate

from pstrain.protos import pstrain_pb2 as pb


class ShardSource(Protocol):
    """Where data shards come from: the coordinator over gRPC, or a list in tests."""

    def request(self) -> pb.DataShard: ...

    def complete(self, data_shard_id: int) -> None: ...


@dataclass
class DataFeed:
    dataset: torch.utils.data.Dataset
    source: ShardSource
    _queue: deque[tuple[int, int]] = field(default_factory=deque)  # (sample index, data shard id)
    _left: dict[int, int] = field(default_factory=dict)  # data shard id -> samples not consumed yet
    _exhausted: list[int] = field(default_factory=list)

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

    def peek_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``count`` samples without consuming them (the probe trains on nothing)."""
        self._fill(count)
        return self._collate([index for index, _ in list(self._queue)[:count]])

    def next_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._collate(self.next_indices(count))

    def _collate(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
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
