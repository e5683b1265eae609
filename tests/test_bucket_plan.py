"""S4.2: the bucket-size chooser on synthetic profiles, and its agreement with runtime.buckets."""

from __future__ import annotations

import pytest

from pstrain.planner.bucket_plan import (
    CommModel,
    Layer,
    choose_bucket_bytes,
    describe,
    exposed_s,
    free_groups,
    measure_update_rate,
    uniform_groups,
)
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.buckets import bucket_bounds
from pstrain.runtime.layout import ParamLayout

MIB = 1 << 20


def mlp(layers: int = 8, layer_bytes: int = 4 * MIB, backward_s: float = 0.02) -> list[Layer]:
    return [Layer(f"l{i}", layer_bytes, backward_s, backward_s / 2) for i in range(layers)]


def test_long_backward_picks_small_buckets_that_hide_communication() -> None:
    layers = mlp(backward_s=0.05)  # 50 ms per layer; a 4 MiB layer takes ~3 ms to push at 1.25 GB/s
    model = CommModel(update_bytes_s=2e9)
    choice = choose_bucket_bytes(layers, model)
    assert 0 < choice.bucket_bytes < 8 * 4 * MIB and len(choice.buckets) > 1
    assert choice.exposed_s < 0.5 * choice.one_bucket_s


def test_per_message_overhead_that_dominates_gives_one_bucket() -> None:
    layers = mlp(layer_bytes=64 << 10, backward_s=1e-4)  # tiny layers, fast backward
    model = CommModel(message_s=0.05, update_call_s=0.01)  # 50 ms per message
    choice = choose_bucket_bytes(layers, model)
    assert choice.bucket_bytes == 0 and choice.buckets == (8 * (64 << 10),)


def test_slower_network_never_exposes_less() -> None:
    layers = mlp()
    groups = uniform_groups(layers, 4 * MIB)
    fast = exposed_s(layers, groups, CommModel(network_bytes_s=10e9))
    slow = exposed_s(layers, groups, CommModel(network_bytes_s=0.5e9))
    assert slow > fast


def test_free_communication_exposes_nothing() -> None:
    model = CommModel(network_bytes_s=1e18, update_bytes_s=1e18, message_s=0.0, update_call_s=0.0)
    assert exposed_s(mlp(), [1] * 8, model) == pytest.approx(0.0, abs=1e-9)


def test_more_workers_per_shard_cost_more() -> None:
    layers, groups = mlp(), [2, 2, 2, 2]
    assert exposed_s(layers, groups, CommModel(workers=8, ps_shards=1)) > exposed_s(
        layers, groups, CommModel(workers=8, ps_shards=8)
    )


def test_bfloat16_pushes_expose_less() -> None:
    layers, groups = mlp(backward_s=0.001), [8]
    assert exposed_s(layers, groups, CommModel(push_ratio=0.5)) < exposed_s(layers, groups, CommModel())


def test_free_boundaries_are_never_worse_and_can_be_better() -> None:
    """One size cannot start the pipeline early with a small first bucket and then save messages."""
    layers = [Layer(f"l{i}", MIB, 1e-3) for i in range(16)]
    model = CommModel(message_s=5e-3, update_bytes_s=2e9)
    choice = choose_bucket_bytes(layers, model)
    assert choice.free_exposed_s < choice.exposed_s - 5e-4
    assert len(set(choice.free_buckets)) > 1  # non-uniform
    assert exposed_s(layers, free_groups(layers, model, [16]), model) <= exposed_s(layers, [16], model)
    assert "non-uniform buckets" in describe(choice, model)


@pytest.mark.parametrize("bucket_bytes", [0, 4096, 100, 64, 12 * 4])
def test_uniform_groups_follow_runtime_buckets(bucket_bytes: int) -> None:
    """One parameter per layer: the chooser's rule cuts where ``runtime.buckets`` cuts (incl. empty params)."""
    shapes = [[3, 4], [4], [0], [5, 5], [5], [2, 5], [2]]
    layout = ParamLayout.from_shapes([f"p{i}" for i in range(len(shapes))], shapes)
    layers = [
        Layer(n, 4 * (layout.offsets[i + 1] if i + 1 < len(shapes) else layout.total) - 4 * o, 0.0)
        for i, (n, o) in enumerate(zip(layout.names, layout.offsets, strict=True))
    ]
    assert uniform_groups(layers, bucket_bytes) == [len(p) for _, _, p in bucket_bounds(layout, bucket_bytes)]


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        exposed_s(mlp(), [3, 3], CommModel())
    with pytest.raises(ValueError, match="positive"):
        CommModel(network_bytes_s=0)


def test_measured_update_rate_and_printout() -> None:
    rate = measure_update_rate(pb.OptimizerSpec(name="sgd", momentum=0.9), numel=1 << 16)
    assert rate > 1e6  # more than 1 MB/s of parameters on any machine this runs on
    model = CommModel(update_bytes_s=rate)
    text = describe(choose_bucket_bytes(mlp(), model), model)
    assert "transport.bucket_bytes" in text and "modelled exposed communication" in text
