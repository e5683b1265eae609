"""S4 buckets and pieces: whole parameters per bucket, pieces partition the vector, worker and shard agree."""

from __future__ import annotations

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointError, load_state, save_state
from pstrain.ps_server.errors import InvalidArgument, StepConflict
from pstrain.ps_server.pieces import PiecedShard, join_states, split_optimizer_state
from pstrain.ps_server.shard import CheckpointPolicy
from pstrain.runtime.buckets import bucket_bounds, plan_buckets, shard_pieces
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.shard_map import ShardRange, shard_ranges

SHAPES = [(300,), (7, 40), (1,), (50, 50), (0,), (90,), (4096,), (3, 3)]
LAYOUT = ParamLayout.from_shapes([f"p{i}" for i in range(len(SHAPES))], SHAPES)


@pytest.mark.parametrize("bucket_bytes", [0, 1, 400, 1024, 4096, 1 << 20])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_buckets_hold_whole_parameters_and_pieces_partition_the_vector(bucket_bytes: int, num_shards: int) -> None:
    ranges = shard_ranges(LAYOUT.total, num_shards)
    plan = plan_buckets(LAYOUT, ranges, bucket_bytes)
    ends = [
        LAYOUT.offsets[i] + (LAYOUT.offsets[i + 1] if i + 1 < len(SHAPES) else LAYOUT.total) - LAYOUT.offsets[i]
        for i in range(len(SHAPES))
    ]
    for bucket in plan.buckets:  # a bucket's range is exactly its parameters': none is split
        assert bucket.start == LAYOUT.offsets[min(bucket.params)] and bucket.end == ends[max(bucket.params)]
        assert list(bucket.params) == list(range(min(bucket.params), max(bucket.params) + 1))
    assert sorted(i for b in plan.buckets for i in b.params) == list(range(len(SHAPES)))
    assert all(plan.bucket_of[i] == b.index for b in plan.buckets for i in b.params)
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    assert plan.buckets[0].end == LAYOUT.total, "bucket 0 holds the last parameters: backward's first"
    covered = [(p.start, p.end) for p in plan.pieces]
    assert covered[0][0] == 0 and covered[-1][1] == LAYOUT.total
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), "pieces tile the vector"
    for r in ranges:  # the shard derives the same pieces from its range alone
        mine = [p for p in plan.pieces if p.shard_id == r.shard_id]
        assert shard_pieces(LAYOUT, r, bucket_bytes) == (mine or [r])


def test_a_parameter_bigger_than_the_target_is_a_bucket_alone() -> None:
    bounds = bucket_bounds(LAYOUT, 1024)
    big = [b for b in bounds if 6 in b[2]]
    assert big == [(LAYOUT.offsets[6], LAYOUT.offsets[7], (6,))]
    assert bucket_bounds(LAYOUT, 0) == [(0, LAYOUT.total, tuple(range(len(SHAPES))))]


def _pieced(workers: int = 2) -> PiecedShard:
    r = shard_ranges(LAYOUT.total, 2)[1]
    pieces = shard_pieces(LAYOUT, r, 1024)
    assert len(pieces) >= 2
    initial = torch.linspace(-1, 1, r.numel)
    spec = pb.OptimizerSpec(name="sgd", momentum=0.9)
    return PiecedShard.build(pieces, initial, spec, pb.LrSchedule(scaled_lr=0.1), workers)


def test_a_piece_completes_and_updates_while_another_still_waits() -> None:
    shard = _pieced()
    first, second = shard.pieces[0], shard.pieces[1]
    g = torch.ones(first.numel)
    assert not shard.push(0, 0, g, 1, piece_start=first.start).completed
    assert shard.push(1, 0, g, 1, piece_start=first.start).completed
    assert first.version == 1 and second.version == 0 and shard.version == 0
    assert not shard.push(0, 0, torch.ones(second.numel), 1, piece_start=second.start).completed
    assert second.version == 0, "the other piece waits for worker 1"
    with shard.read(1, 1.0, piece_start=first.start) as (version, params):
        assert version == 1
    # per piece: duplicates are acknowledged, ahead is refused, a piece that is not ours is refused
    with pytest.raises(StepConflict):
        shard.push(0, 2, g, 1, piece_start=first.start)
    with pytest.raises(InvalidArgument):
        shard.push(0, 0, torch.ones(3), 1, piece_start=first.start + 1)
    with pytest.raises(InvalidArgument):
        shard.push(0, 1, torch.full((first.numel,), float("nan")), 1, piece_start=first.start)
    assert first.version == 1


def test_whole_shard_push_and_read_equal_the_pieces_and_checkpoints_join() -> None:
    shard = _pieced(workers=1)
    g = torch.linspace(0, 1, shard.numel)
    assert shard.push(0, 0, g, 1).completed
    with shard.read(1, 1.0) as (version, params):
        assert version == 1 and params.numel() == shard.numel
    state = shard.checkpoint_state()
    assert state.version == 1 and state.params.numel() == shard.numel
    assert state.optimizer["state"][0]["momentum_buffer"].numel() == shard.numel
    parts = split_optimizer_state(state.optimizer, [p.numel for p in shard.pieces])
    rejoined = join_states([p.checkpoint_state() for p in shard.pieces])
    assert torch.equal(rejoined.params, state.params)
    for piece, part in zip(shard.pieces, parts, strict=True):
        assert part is not None and part["state"][0]["momentum_buffer"].numel() == piece.numel


def test_transport_bucket_bytes_is_validated_and_defaults_to_8_mib() -> None:
    base = {"model": {"factory": "m:f"}, "data": {"factory": "d:f"}}
    assert parse_config(base).transport.bucket_bytes == 8 << 20
    assert parse_config({**base, "transport": {"bucket_bytes": 0}}).transport.bucket_bytes == 0
    with pytest.raises(ConfigError, match=r"transport\.bucket_bytes"):
        parse_config({**base, "transport": {"bucket_bytes": 100}})


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("skipped", ["first piece", "last piece"])
def test_a_checkpoint_of_pieces_that_stepped_unequally_resumes_bit_for_bit(optimizer, skipped, tmp_path) -> None:
    """A bucket found non-finite during backward: the pieces pushed before it step, it and the ones after are
    skipped; at step 0 that leaves some pieces with optimizer state and others (never stepped) without. Written
    and read back as a checkpoint file, the shard resumes with the same pieces exactly as it would have gone on,
    and into other pieces (another ``bucket_bytes``) it is refused by name rather than restored wrong."""
    spec = (
        pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8)
        if optimizer == "adam"
        else pb.OptimizerSpec(name="sgd", momentum=0.9, dampening=0.5)
    )
    lr = pb.LrSchedule(scaled_lr=0.1)
    pieces = [ShardRange(0, 0, 4), ShardRange(0, 4, 10)]
    saved: list = []
    every_step = CheckpointPolicy(1, 100, saved.append)
    live = PiecedShard.build(pieces, torch.arange(10.0), spec, lr, 1, checkpoints=every_step)
    g = torch.linspace(-1, 1, 10)
    stepped, skips = (pieces[1], pieces[0]) if skipped == "first piece" else (pieces[0], pieces[1])
    live.push(0, 0, g[stepped.start : stepped.end].clone(), 1, piece_start=stepped.start)
    live.push(0, 0, None, 1, skip=True, piece_start=skips.start)
    assert saved and saved[-1].version == 1
    save_state(tmp_path, saved[-1])
    state = load_state(tmp_path, 0, 0, 10, 1)  # read back through the checkpoint file format
    restored = PiecedShard.restore(state, pieces, spec, lr, 1)
    for step in (1, 2):
        grad = g * (step + 3) ** 2 + step
        for shard in (live, restored):
            shard.push(0, step, grad.clone(), 1)
    assert torch.equal(live.parameters()[1], restored.parameters()[1])
    for other in ([ShardRange(0, 0, 10)], [ShardRange(0, 0, 6), ShardRange(0, 6, 10)]):  # as many pieces, or not
        with pytest.raises(CheckpointError, match=r"pieces of \[4, 6\] elements.*not \[(10|6, 4)\]"):
            PiecedShard.restore(state, other, spec, lr, 1)
