"""The worker's counters against what goes on the wire (the shard counts the same bytes)."""

from types import SimpleNamespace

from prometheus_client import REGISTRY

from pstrain.protos import pstrain_pb2 as pb
from pstrain.worker.trainer import Trainer

NUMEL = 1000


def pushed_by_one_step(push_dtype: int) -> float:
    """``Trainer._record`` of one step of a NUMEL-parameter model pushed as ``push_dtype``: bytes counted."""
    trainer = SimpleNamespace(job=pb.JobSpec(total_params=NUMEL, push_dtype=push_dtype))
    before = REGISTRY.get_sample_value("pstrain_worker_pushed_bytes_total") or 0.0
    Trainer._record(trainer, 0, [1.0], 4, 0.01, 0.01, 0.01, 0.03)
    return REGISTRY.get_sample_value("pstrain_worker_pushed_bytes_total") - before


def test_float32_pushes_count_four_bytes_a_parameter():
    assert pushed_by_one_step(pb.FLOAT32) == 4 * NUMEL


def test_bfloat16_pushes_count_two_bytes_a_parameter_like_the_shard():
    assert pushed_by_one_step(pb.BFLOAT16) == 2 * NUMEL
