"""The worker's byte counters against what a run moves: pushes in the job's push dtype (as the shards count them),
pulls in float32."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from torch import nn

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.layout import ParamLayout
from tests.test_worker_models import STEPS, train


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.parametrize("push_dtype, push_bytes", [(pb.FLOAT32, 4), (pb.BFLOAT16, 2)])
def test_pushes_count_the_bytes_of_the_push_dtype_and_pulls_four(push_dtype: int, push_bytes: int) -> None:
    """A real trainer's STEPS steps. Before, a bfloat16 job's worker counted 4 bytes a parameter pushed, twice what
    its shards received."""
    params = ParamLayout.of(mlp()).total
    pushed, pulled = counted("pstrain_worker_pushed_bytes_total"), counted("pstrain_worker_pulled_bytes_total")
    train(mlp, None, push_dtype)
    assert counted("pstrain_worker_pushed_bytes_total") - pushed == STEPS * params * push_bytes
    assert counted("pstrain_worker_pulled_bytes_total") - pulled == STEPS * params * 4
