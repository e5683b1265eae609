"""Which contiguous range of the flat parameter vector each PS shard owns.

This is the one function every service calls (coordinator to plan, PS to check a push,
worker to slice its summed gradient), so the three can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardRange:
    shard_id: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def shard_ranges(total: int, num_shards: int) -> list[ShardRange]:
    """Split ``[0, total)`` into ``num_shards`` contiguous ranges whose sizes differ by at most 1.

    The first ``total % num_shards`` shards take one extra element (S1.1 "evenly sharded").
    """
    if num_shards <= 0:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    if total < 0:
        raise ValueError(f"total must be non-negative, got {total}")
    base, extra = divmod(total, num_shards)
    ranges = []
    start = 0
    for shard_id in range(num_shards):
        end = start + base + (1 if shard_id < extra else 0)
        ranges.append(ShardRange(shard_id, start, end))
        start = end
    return ranges
