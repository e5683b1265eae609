"""Issue 12: ``transport.push_dtype: bfloat16`` — half the push bytes, float32 master weights and sums.

A bfloat16 push must equal, bit for bit at the shard, a float32 push of the gradient rounded to
bfloat16 and widened back: the shard widens exactly and sums in float32. The in-memory and the
gRPC client round the same way, and a dtype the job did not configure changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.runtime.buckets import plan_buckets, shard_pieces
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.ps_api import InvalidRequest, ParameterServerClient
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import shard_ranges
from pstrain.runtime.transport import start_server

LAYOUT = ParamLayout.from_shapes(["a", "b", "c", "d"], [[7, 5], [5], [3, 7], [3]])
SHARDS = 2
WORKERS = 2
STEPS = 3
BUCKET_BYTES = 64  # several buckets: pieces are pushed during "backward"
SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)


def initial() -> torch.Tensor:
    return torch.randn(LAYOUT.total, generator=torch.Generator().manual_seed(1))


def gradients() -> list[list[torch.Tensor]]:
    """Per step, per worker: a float32 gradient whose values are not bfloat16 numbers (rounding matters)."""
    gen = torch.Generator().manual_seed(2)
    return [[torch.randn(LAYOUT.total, generator=gen) * 3.3 for _ in range(WORKERS)] for _ in range(STEPS)]


def build(push_dtype: int) -> list[PiecedShard]:
    start = initial()
    return [
        PiecedShard.build(
            shard_pieces(LAYOUT, r, BUCKET_BYTES),
            start[r.start : r.end].clone(),
            SGD,
            pb.LrSchedule(scaled_lr=0.05),
            WORKERS,
            push_dtype=push_dtype,
        )
        for r in shard_ranges(LAYOUT.total, SHARDS)
    ]


def train(clients: list[ParameterServerClient], grads: list[list[torch.Tensor]]) -> torch.Tensor:
    """Every worker pushes its gradient bucket by bucket (backward order) and pulls the next version."""
    plan = plan_buckets(LAYOUT, clients[0].ranges, BUCKET_BYTES)
    out = torch.empty(LAYOUT.total)
    for step, per_worker in enumerate(grads):
        for worker, (client, grad) in enumerate(zip(clients, per_worker, strict=True)):
            for bucket in plan.buckets:
                client.push_pieces(grad, bucket.pieces, worker, step, 1).wait()
        assert clients[0].pull(step + 1, out) == step + 1
    return out


def final(shards: list[PiecedShard]) -> torch.Tensor:
    return torch.cat([s.parameters()[1] for s in shards])


def rounded(grads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[g.to(torch.bfloat16).float() for g in step] for step in grads]


@contextmanager
def grpc_shards(shards: list[PiecedShard]) -> Iterator[list[str]]:
    servers = []
    try:
        for shard in shards:
            servicer = ParameterServerServicer()
            server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
            servicer.attach(shard, 64)
            server.set_serving(True)
            servers.append(server)
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for shard in shards:
            shard.close()
        for server in servers:
            server.stop(0)


def test_bfloat16_push_equals_float32_push_of_the_rounded_gradient_bit_for_bit() -> None:
    grads = gradients()
    bf16 = build(pb.BFLOAT16)
    got = train([LocalPsClient(bf16, 10, push_dtype=torch.bfloat16) for _ in range(WORKERS)], grads)
    fp32 = build(pb.FLOAT32)
    expected = train([LocalPsClient(fp32, 10) for _ in range(WORKERS)], rounded(grads))
    assert torch.equal(got, expected) and torch.equal(final(bf16), final(fp32))
    unrounded = build(pb.FLOAT32)
    plain = train([LocalPsClient(unrounded, 10) for _ in range(WORKERS)], grads)
    assert not torch.equal(got, plain), "the rounding made no difference: the test would not see a missing one"
    torch.testing.assert_close(got, plain, rtol=0.02, atol=0.02)  # bfloat16 is close, not equal


def test_shard_sums_bfloat16_pushes_in_float32() -> None:
    """Two bfloat16 pushes whose float32 sum is not a bfloat16 number: the shard keeps the float32 sum."""
    shard = PiecedShard.build(
        shard_pieces(LAYOUT, shard_ranges(LAYOUT.total, 1)[0], 0),
        torch.zeros(LAYOUT.total),
        pb.OptimizerSpec(name="sgd"),
        pb.LrSchedule(scaled_lr=1.0),
        2,
        push_dtype=pb.BFLOAT16,
    )
    one = torch.full((LAYOUT.total,), 1.0, dtype=torch.bfloat16)
    small = torch.full((LAYOUT.total,), 2.0**-9, dtype=torch.bfloat16)  # 1 + 2^-9 is not a bfloat16 number
    shard.push(0, 0, one, 1)
    shard.push(1, 0, small, 1)
    _, params = shard.parameters()
    assert params.dtype == torch.float32
    assert torch.equal(params, torch.full((LAYOUT.total,), -(1.0 + 2.0**-9) / 2))


def test_grpc_and_in_memory_clients_agree() -> None:
    """Streamed pushes (the shared-memory path, issue 12's other part, is left to its own tests)."""
    grads = gradients()
    local = build(pb.BFLOAT16)
    expected = train([LocalPsClient(local, 10, push_dtype=torch.bfloat16) for _ in range(WORKERS)], grads)
    remote = build(pb.BFLOAT16)
    with grpc_shards(remote) as addresses:
        clients = [
            PsClient(
                addresses,
                LAYOUT.total,
                chunk_bytes=64,
                pull_timeout_s=30,
                shared_memory=False,
                push_dtype=torch.bfloat16,
            )
            for _ in range(WORKERS)
        ]
        try:
            got = train(clients, grads)  # type: ignore[arg-type]
        finally:
            for c in clients:
                c.close()
    assert torch.equal(got, expected)


def rejected(push: Callable[[], object], shards: list[PiecedShard]) -> None:
    before = final(shards).clone(), [s.version for s in shards]
    with pytest.raises((InvalidRequest, InvalidArgument), match="transport.push_dtype"):
        push()
    assert torch.equal(final(shards), before[0]) and [s.version for s in shards] == before[1]


def test_a_dtype_the_job_did_not_configure_is_refused_and_changes_nothing() -> None:
    grad = gradients()[0][0]
    fp32 = build(pb.FLOAT32)
    rejected(lambda: LocalPsClient(fp32, 10, push_dtype=torch.bfloat16).push(grad, 0, 0, 1).wait(), fp32)
    bf16 = build(pb.BFLOAT16)
    rejected(lambda: LocalPsClient(bf16, 10).push(grad, 0, 0, 1).wait(), bf16)
    with grpc_shards(build(pb.FLOAT32)) as addresses:
        client = PsClient(addresses, LAYOUT.total, shared_memory=False, push_dtype=torch.bfloat16)
        try:
            with pytest.raises(InvalidRequest, match="transport.push_dtype"):
                client.push(grad, 0, 0, 1).wait()
        finally:
            client.close()
    with pytest.raises(InvalidArgument, match="FLOAT32 or BFLOAT16"):
        build(pb.FLOAT16)


def test_config_and_job_spec() -> None:
    raw = {"model": {"factory": "m:f"}, "data": {"factory": "d:f"}}
    assert parse_config(raw).transport.push_dtype == "float32"
    cfg = parse_config({**raw, "transport": {"push_dtype": "bfloat16"}})
    spec = job_spec(cfg, make_plan(cfg, per_device=4), LAYOUT, "job")
    assert spec.push_dtype == pb.BFLOAT16
    with pytest.raises(ConfigError, match=r"transport\.push_dtype: must be one of float32, bfloat16"):
        parse_config({**raw, "transport": {"push_dtype": "float16"}})
