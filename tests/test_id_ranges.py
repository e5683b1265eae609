"""``IdRanges``: a set of ids kept as runs (the completed data shards of a long job)."""

import random

import pytest

from pstrain.coordinator.id_ranges import IdRanges


def test_it_behaves_as_a_set_under_random_adds_and_discards():
    rng = random.Random(7)
    ranges, model = IdRanges(), set()
    for _ in range(5_000):
        i = rng.randrange(200)
        if rng.random() < 0.6:
            assert ranges.add(i) == (i not in model)
            model.add(i)
        else:
            assert ranges.discard(i) == (i in model)
            model.discard(i)
        assert (i in ranges) == (i in model)
    assert list(ranges) == sorted(model) and len(ranges) == len(model)
    pairs = ranges.to_json()
    assert all(a[1] < b[0] for a, b in zip(pairs, pairs[1:], strict=False))  # disjoint, not even adjacent
    assert list(IdRanges.from_json(pairs)) == sorted(model)


def test_a_run_is_one_range_and_filling_a_hole_joins_two():
    ranges = IdRanges([0, 1, 2, 4, 5])
    assert ranges.to_json() == [[0, 3], [4, 6]] and ranges.runs == 2
    ranges.add(3)
    assert ranges.to_json() == [[0, 6]]
    ranges.discard(2)
    assert ranges.to_json() == [[0, 2], [3, 6]]


@pytest.mark.parametrize("pairs", [[[3, 3]], [[-1, 2]], [[4, 6], [0, 2]], [[0, 2], [2, 4]], [[0, 3], [1, 5]]])
def test_malformed_json_is_refused(pairs):
    with pytest.raises(ValueError, match="id range"):
        IdRanges.from_json(pairs)


def test_negative_ids_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        IdRanges().add(-1)
