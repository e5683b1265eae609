"""An in-memory ``SparseRowsClient``: calls ``SparseShard``s directly, no network.

The same contract as the gRPC ``SparseClient``: the shard's errors become ``ps_api`` errors,
one pull per owning shard, one push to every shard. Pushes run one thread per shard, since a
shard's push never waits for peers but a worker's pull does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pstrain.ps_server.errors import StepConflict
from pstrain.ps_server.local_client import _translated
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime.sparse_api import RowGrads, RowsAck, merge_rows, split_ids, split_rows


class LocalSparseClient:
    """A client over sparse shards in this process; ``close`` leaves them open (other workers share them)."""

    def __init__(self, shards: Sequence[SparseShard], pull_timeout_s: float = 600.0) -> None:
        if not shards or [s.shard_id for s in shards] != list(range(len(shards))):
            raise ValueError("pass every sparse shard, in shard order")
        self._shards = list(shards)
        self.shards = len(shards)
        self._dims = {name: t.spec.dim for name, t in shards[0].tables.items()}
        self._pull_timeout_s = pull_timeout_s
        self.pull_requests = 0  # requests sent, for tests: one per owning shard per step

    def pull_rows(self, min_version: int, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = []
        for shard, (shard_ids, where) in zip(self._shards, split_ids(ids, self.shards), strict=True):
            if not shard_ids:
                continue
            self.pull_requests += 1
            with _translated():
                _, rows = shard.pull(min_version, shard_ids, self._pull_timeout_s)
            parts.append((rows, where))
        return merge_rows(ids, self._dims, parts)

    def push_rows(
        self, worker_id: int, step: int, rows: Mapping[str, RowGrads] | None, device_count: int
    ) -> list[RowsAck]:
        pieces: list[dict[str, RowGrads] | None] = (
            [None] * self.shards if rows is None else list(split_rows(rows, self.shards))
        )
        acks = []
        for shard, piece in zip(self._shards, pieces, strict=True):
            with _translated():
                try:
                    r = shard.push(worker_id, step, piece, device_count)
                except StepConflict:
                    if shard.version not in (step - 1, step):  # step: the peer's rows landed since the refusal
                        raise
                    shard.pull(step, {}, self._pull_timeout_s)  # one ahead of a shard the step's pull did not wait for
                    r = shard.push(worker_id, step, piece, device_count)
            acks.append(RowsAck(shard.shard_id, r.version, r.duplicate, r.completed, r.skipped))
        return acks

    def progress(self, worker_id: int) -> list[tuple[int, int]]:
        out = []
        for shard in self._shards:
            with _translated():
                out.append(shard.progress(worker_id))
        return out

    def close(self, cancel: bool = False) -> None:
        return None
