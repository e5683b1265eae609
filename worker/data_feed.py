"""Turns the coordinator's data shards into this worker's per-step batches.

A step's batch may span shards. A shard is reported done only after the step that consumed
its last sample has been pushed, so a worker that dies mid-step never loses a shard (S2.5).
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

    def complete(self, shard_id: int) -> None: ...


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
            shard = self.source.request()
            if not shard.indices:
                raise RuntimeError(f"coordinator sent data shard {shard.shard_id} without samples")
            self._queue.extend((index, shard.shard_id) for index in shard.indices)
            self._left[shard.shard_id] = len(shard.indices)

    def next_indices(self, count: int) -> list[int]:
        self._fill(count)
        indices = []
        for _ in range(count):
            index, shard_id = self._queue.popleft()
            indices.append(index)
            self._left[shard_id] -= 1
            if self._left[shard_id] == 0:  # its last sample is in this step
                del self._left[shard_id]
                self._exhausted.append(shard_id)
        return indices

    def peek_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``count`` samples without consuming them (the probe trains on nothing)."""
        self._fill(count)
        return self._collate([index for index, _ in list(self._queue)[:count]])

    def next_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._collate(self.next_indices(count))

    def _collate(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = default_collate([self.dataset[i] for i in indices])
        return batch[0], batch[1]

    def commit(self) -> None:
        """The step that used the exhausted shards is safely pushed: report them done."""
        for shard_id in self._exhausted:
            self.source.complete(shard_id)
        self._exhausted.clear()
