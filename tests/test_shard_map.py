import pytest

from pstrain.runtime.shard_map import shard_ranges


@pytest.mark.parametrize("total", [0, 1, 2, 74, 100, 1001, 25_000_000])
@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_ranges_are_contiguous_cover_everything_and_differ_by_at_most_one(total, shards):
    ranges = shard_ranges(total, shards)
    assert [r.shard_id for r in ranges] == list(range(shards))
    assert ranges[0].start == 0 and ranges[-1].end == total
    for a, b in zip(ranges, ranges[1:], strict=False):
        assert a.end == b.start
    sizes = [r.numel for r in ranges]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_known_split():
    assert [(r.start, r.end) for r in shard_ranges(74, 3)] == [(0, 25), (25, 50), (50, 74)]


@pytest.mark.parametrize("total, shards", [(10, 0), (10, -1), (-1, 2)])
def test_bad_arguments(total, shards):
    with pytest.raises(ValueError):
        shard_ranges(total, shards)
