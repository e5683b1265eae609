"""A set of non-negative integers kept as disjoint ranges: the completed data shards of a long job.

Data shards complete roughly in id order (slot ``w`` of ``n`` takes ``w, w + n, …``, and the slots
advance together), so the ids done so far are a few runs with holes only where data shards are still
in flight. As a list, they grew by one id per data shard for the whole job, in the coordinator's
memory and in every journal snapshot and checkpoint manifest (megabytes after a few hundred thousand
data shards); as ranges, their size is the number of holes, however long the job runs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


class IdRanges:
    """Sorted, disjoint, non-adjacent half-open ranges ``[start, end)``; a run of ids is one range."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for i in ids:
            self.add(i)

    @classmethod
    def from_json(cls, ranges: Iterable[Iterable[int]]) -> IdRanges:
        """From ``to_json``'s pairs, which must be as it writes them: increasing, disjoint, not adjacent."""
        out = cls()
        for pair in ranges:
            start, end = (int(v) for v in pair)
            if not (0 <= start < end and (not out._ends or start > out._ends[-1])):
                raise ValueError(f"id range [{start}, {end}) is empty, negative or not after the one before it")
            out._starts.append(start)
            out._ends.append(end)
        return out

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends, strict=True)]

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int):
            return False
        k = bisect_right(self._starts, i) - 1
        return k >= 0 and i < self._ends[k]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends, strict=True):
            yield from range(s, e)

    @property
    def runs(self) -> int:
        return len(self._starts)

    def add(self, i: int) -> bool:
        """Add ``i``; False (and nothing changes) if it was there already."""
        if i < 0:
            raise ValueError(f"ids are non-negative, got {i}")
        k = bisect_right(self._starts, i) - 1
        if k >= 0 and i < self._ends[k]:
            return False
        joins_left = k >= 0 and self._ends[k] == i
        joins_right = k + 1 < len(self._starts) and self._starts[k + 1] == i + 1
        if joins_left and joins_right:  # i fills the hole between two runs
            self._ends[k] = self._ends[k + 1]
            del self._starts[k + 1], self._ends[k + 1]
        elif joins_left:
            self._ends[k] = i + 1
        elif joins_right:
            self._starts[k + 1] = i
        else:
            self._starts.insert(k + 1, i)
            self._ends.insert(k + 1, i + 1)
        return True

    def discard(self, i: int) -> bool:
        """Remove ``i``; False if it was not there."""
        k = bisect_right(self._starts, i) - 1
        if k < 0 or i >= self._ends[k]:
            return False
        start, end = self._starts[k], self._ends[k]
        if start == i and end == i + 1:
            del self._starts[k], self._ends[k]
        elif start == i:
            self._starts[k] = i + 1
        elif end == i + 1:
            self._ends[k] = i
        else:  # split the run around i
            self._ends[k] = i
            self._starts.insert(k + 1, i + 1)
            self._ends.insert(k + 1, end)
        return True
