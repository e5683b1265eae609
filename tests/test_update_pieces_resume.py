"""A checkpoint of pieces whose optimizer step counts differ resumes into other pieces exactly, or is refused.

Under ``fault.on_nonfinite: skip`` a bucket found non-finite after earlier buckets were pushed skips the pieces from
it on, while the earlier ones step: Adam's ``step`` (its bias correction) then differs between the pieces of one
shard. Resumed with another ``transport.bucket_bytes``, each new piece must keep the count of the elements it holds.
"""

from __future__ import annotations

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointError, load_state, save_state
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import CheckpointPolicy
from pstrain.runtime.shard_map import ShardRange

ADAM = pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LR = pb.LrSchedule(base_lr=0.1, scaled_lr=0.1, warmup_steps=4)
WRITTEN = [ShardRange(0, 0, 4), ShardRange(0, 4, 10)]


def grad(step: int) -> torch.Tensor:
    return torch.randn(10, generator=torch.Generator().manual_seed(step))


def unequal_checkpoint(tmp_path):
    """A live shard and its checkpoint at version 3, written from disk: step 1 skipped the second piece only."""
    saved: list = []
    live = PiecedShard.build(
        WRITTEN, torch.linspace(-1, 1, 10), ADAM, LR, 1, checkpoints=CheckpointPolicy(3, 9, saved.append)
    )
    for step in range(3):
        if step == 1:  # the first bucket was pushed, the second found non-finite: skipped
            live.push(0, step, grad(step)[:4].clone(), 1, piece_start=0)
            live.push(0, step, None, 1, skip=True, piece_start=4)
        else:
            live.push(0, step, grad(step), 1)
    assert [s.version for s in saved] == [3]
    save_state(tmp_path, saved[0])
    return live, load_state(tmp_path, 0, 0, 10, 3)


def steps(shard: PiecedShard) -> list[float]:
    return [float(p._optimizer.state[p._param]["step"]) for p in shard.pieces]


def test_pieces_inside_the_written_ones_keep_their_own_step_counts(tmp_path):
    live, state = unequal_checkpoint(tmp_path)
    finer = [ShardRange(0, 0, 2), ShardRange(0, 2, 4), ShardRange(0, 4, 7), ShardRange(0, 7, 10)]
    restored = PiecedShard.restore(state, finer, ADAM, LR, 1)
    assert steps(live) == [3.0, 2.0] and steps(restored) == [3.0, 3.0, 2.0, 2.0]
    for step in range(3, 7):
        for shard in (live, restored):
            shard.push(0, step, grad(step), 1)
    assert steps(restored) == [7.0, 7.0, 6.0, 6.0]  # each piece its own counter, none shared
    torch.testing.assert_close(restored.parameters()[1], live.parameters()[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cut", [[10], [6, 4], [2, 8]])
def test_a_piece_spanning_written_pieces_that_differ_is_refused_by_name(tmp_path, cut):
    _, state = unequal_checkpoint(tmp_path)
    pieces, start = [], 0
    for n in cut:
        pieces.append(ShardRange(0, start, start + n))
        start += n
    with pytest.raises(CheckpointError, match=r"pieces of \[4, 6\] elements whose optimizer state 'step' differs"):
        PiecedShard.restore(state, pieces, ADAM, LR, 1)
