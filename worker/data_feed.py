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

from protos import pstrain_pb2 as pb


class ShardSource(Protocol):
    """Where data shards come from: the coordinator over gRPC, or a list in tests."""

    def request(self) -> pb.DataShard: ...

    def complete(self, shard_id: int) -> None: ...


@dataclass
class DataFeed:
    dataset: torch.utils.data.Dataset
    source: ShardSource
    _queue: deque[int] = field(default_factory=deque)
    _current: int | None = None
    _exhausted: list[int] = field(default_factory=list)

    def next_indices(self, count: int) -> list[int]:
        indices: list[int] = []
        while len(indices) < count:
            if not self._queue:
                if self._current is not None:
                    self._exhausted.append(self._current)
                shard = self.source.request()
                if not shard.indices:
                    raise RuntimeError(f"coordinator sent data shard {shard.shard_id} without samples")
                self._current = shard.shard_id
                self._queue.extend(shard.indices)
            take = min(count - len(indices), len(self._queue))
            indices.extend(self._queue.popleft() for _ in range(take))
        if not self._queue and self._current is not None:
            self._exhausted.append(self._current)
            self._current = None
        return indices

    def peek_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``count`` samples without consuming them (the probe trains on nothing)."""
        while len(self._queue) < count:
            if self._current is not None:
                self._exhausted.append(self._current)
            shard = self.source.request()
            self._current = shard.shard_id
            self._queue.extend(shard.indices)
        batch = default_collate([self.dataset[i] for i in list(self._queue)[:count]])
        return batch[0], batch[1]

    def next_batch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = default_collate([self.dataset[i] for i in self.next_indices(count)])
        inputs, targets = batch[0], batch[1]
        return inputs, targets

    def commit(self) -> None:
        """The step that used the exhausted shards is safely pushed: report them done."""
        for shard_id in self._exhausted:
            self.source.complete(shard_id)
        self._exhausted.clear()
