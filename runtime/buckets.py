"""Gradient buckets and the pieces they cut the PS shards into (S4: overlap push with backward).

A **bucket** is a contiguous group of *whole* parameters of the flat vector, taken in reverse
layout order (the order backward produces gradients), about ``bucket_bytes`` each. A worker
pushes a bucket as soon as backward has produced every gradient in it, and pulls buckets back
in forward order before the next step's forward needs them.

A **piece** is a bucket range intersected with a PS shard range, so the pieces partition the
flat vector. A shard collects and updates each of its pieces on its own (its own version and
optimizer state), so the update of the last layers runs while workers still compute the
backward of the first ones.

Both sides derive the pieces from the same inputs with the pure functions below — the layout
(the job spec's parameter names and shapes), the shard map and ``bucket_bytes`` — instead of
the coordinator shipping a list of boundaries: the job spec already carries all three, and a
function called on both ends cannot drift from itself (the same reason ``shard_map`` is one
function).

Never splitting a parameter across buckets matters beyond the push: per-parameter optimizer
rules (LARS/LAMB trust ratios) see whole parameters within a bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.shard_map import ShardRange

# Measured (bench/step.py, issue 12): on the 2-core CPU benchmark 8 MiB buckets cost the shards and workers less
# per step than 4 MiB (fewer pieces, calls and wake-ups) and still leave several buckets for an 8.4M-parameter
# model to overlap; 16 MiB and more, or one bucket, expose more of the push and pull.
DEFAULT_BUCKET_BYTES = 8 << 20
ELEMENT_BYTES = 4  # float32 on the wire and at the PS


@dataclass(frozen=True)
class Bucket:
    """Parameters ``params`` (layout indices, ascending) occupying ``[start, end)`` of the flat vector."""

    index: int  # 0 = the last parameters of the layout: the first bucket backward completes
    start: int
    end: int
    params: tuple[int, ...]
    pieces: tuple[ShardRange, ...]  # this bucket's range cut by the shard map, in shard order

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one job, in backward order; ``bucket_of[i]`` is parameter ``i``'s bucket."""

    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]
    total: int

    @property
    def forward_order(self) -> tuple[Bucket, ...]:
        return tuple(reversed(self.buckets))

    @property
    def pieces(self) -> tuple[ShardRange, ...]:
        """Every piece, in flat-vector order."""
        return tuple(p for b in self.forward_order for p in b.pieces)


def bucket_bounds(layout: ParamLayout, bucket_bytes: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(start, end, parameter indices)`` per bucket, in backward (reverse layout) order.

    Parameters are added from the last one backwards until a bucket holds at least
    ``bucket_bytes``; a parameter bigger than that is a bucket alone. ``bucket_bytes <= 0``
    means one bucket for the whole vector (no overlap: the step is pushed after backward).
    Parameters with no elements join their neighbours' bucket.
    """
    count = len(layout.names)
    if count == 0:
        return []
    sizes = [layout.offsets[i + 1] - layout.offsets[i] for i in range(count - 1)] + [layout.total - layout.offsets[-1]]
    if bucket_bytes <= 0:
        return [(0, layout.total, tuple(range(count)))]
    limit = max(1, bucket_bytes // ELEMENT_BYTES)
    bounds: list[tuple[int, int, tuple[int, ...]]] = []
    members: list[int] = []
    held = 0
    for i in reversed(range(count)):
        # A parameter bigger than the target is a bucket alone. One of exactly the target's size is not: it closes
        # the bucket it joins (a Linear(1024)'s 4 MiB weight and its bias make one bucket of 4 MiB, not
        # a bias-only bucket and a weight-only one: half the pushes and pulls per step, each with its RPC cost).
        if sizes[i] > limit and held:
            bounds.append(_bound(layout, members, sizes))
            members, held = [], 0
        members.append(i)
        held += sizes[i]
        if held >= limit:
            bounds.append(_bound(layout, members, sizes))
            members, held = [], 0
    if members:
        if bounds and held == 0:  # only empty parameters left: they join the last bucket
            start, end, params = bounds.pop()
            members = list(params) + members
        bounds.append(_bound(layout, members, sizes))
    return bounds


def _bound(layout: ParamLayout, members: list[int], sizes: list[int]) -> tuple[int, int, tuple[int, ...]]:
    first, last = min(members), max(members)
    return layout.offsets[first], layout.offsets[last] + sizes[last], tuple(sorted(members))


def cut_by_shards(start: int, end: int, ranges: Sequence[ShardRange]) -> tuple[ShardRange, ...]:
    """``[start, end)`` intersected with every shard range that overlaps it (empty ones dropped)."""
    return tuple(
        ShardRange(r.shard_id, max(start, r.start), min(end, r.end))
        for r in ranges
        if max(start, r.start) < min(end, r.end)
    )


def plan_buckets(layout: ParamLayout, ranges: Sequence[ShardRange], bucket_bytes: int) -> BucketPlan:
    """The job's buckets and their pieces: what workers push and pull, and shards collect."""
    bucket_of = [0] * len(layout.names)
    buckets = []
    for index, (start, end, params) in enumerate(bucket_bounds(layout, bucket_bytes)):
        for p in params:
            bucket_of[p] = index
        buckets.append(Bucket(index, start, end, params, cut_by_shards(start, end, ranges)))
    return BucketPlan(tuple(buckets), tuple(bucket_of), layout.total)


def shard_pieces(layout: ParamLayout, shard: ShardRange, bucket_bytes: int) -> list[ShardRange]:
    """The pieces of one shard, in flat order: what a PS shard collects and updates separately.

    Equal to the pieces ``plan_buckets`` gives the workers for this shard (a test checks it);
    a shard with no elements has one empty piece.
    """
    inner = sorted({start for start, _, _ in bucket_bounds(layout, bucket_bytes) if shard.start < start < shard.end})
    edges = [shard.start, *inner, shard.end]
    return [ShardRange(shard.shard_id, a, b) for a, b in zip(edges, edges[1:], strict=False)]
