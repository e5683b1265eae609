"""S2.5: a worker that dies after pushing a step to some pieces only is replaced in place.

The pieces it pushed to move one version ahead once the live workers have pushed them too; the others wait
for its slot. A shard keeps the version before its current one (the spare of its double buffering), so the
replacement reads every piece at the held version (``read_at`` / ``PullAt`` / ``pull_at``), redoes the step
(its pushes to the pieces that moved on are duplicates) and the model equals the fault-free run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import StepConflict, WaitTimeout
from pstrain.ps_server.layerwise import InProcessExchange, Layers, segments_for
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime import ps_api
from pstrain.runtime.ps_api import PushHandle, ShardAck
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.transport import full_service_name, start_server
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.main import rejoin
from tests.helpers import wait_for
from tests.test_overlap import SMALL_BUCKETS, build_shards
from tests.test_sparse_rejoin import FakeMember
from tests.test_trainer import (  # noqa: F401 - make_trainer is a fixture
    DATA,
    DEVICES,
    LAYOUT,
    PER_DEVICE,
    PS_SHARDS,
    STEPS,
    ListSource,
    MakeTrainer,
    final_parameters,
    make_trainer,
    reference,
    start,
    worker_samples,
)

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)


def two_pieces(workers: int = 2) -> PiecedShard:
    initial = torch.arange(6, dtype=torch.float32)
    pieces = [
        ParameterShard(0, start, end, initial[start:end].clone(), SGD, pb.LrSchedule(scaled_lr=0.5), workers)
        for start, end in ((0, 3), (3, 6))
    ]
    return PiecedShard(pieces)


def push(shard: PiecedShard, worker: int, step: int, piece_start: int, value: float) -> None:
    piece = shard.piece(piece_start, 3)
    piece.push(worker, step, torch.full((3,), value), 1)


def read_at(shard: PiecedShard, version: int, timeout_s: float = 5.0) -> torch.Tensor:
    with shard.read_at(version, timeout_s) as params:
        return params.clone()


def test_a_piece_one_step_ahead_serves_the_version_before_it() -> None:
    shard = two_pieces()
    initial = shard.parameters()[1]
    push(shard, 1, 0, 0, 1.0)  # worker 1 pushed step 0 to the first piece only, then died
    push(shard, 0, 0, 0, 1.0)
    push(shard, 0, 0, 3, 1.0)
    assert [p.version for p in shard.pieces] == [1, 0]
    torch.testing.assert_close(read_at(shard, 0), initial, rtol=0, atol=0)  # the first piece's previous buffer
    with pytest.raises(WaitTimeout):
        read_at(shard, 1, timeout_s=0.05)  # the second piece waits for the replacement
    # The replacement redoes step 0: a duplicate for the first piece, the missing contribution for the second.
    assert shard.piece(0, 3).push(1, 0, torch.full((3,), 1.0), 1).duplicate
    push(shard, 1, 0, 3, 1.0)
    assert [p.version for p in shard.pieces] == [1, 1]
    reference = two_pieces()
    for worker in (0, 1):
        for at in (0, 3):
            push(reference, worker, 0, at, 1.0)
    torch.testing.assert_close(shard.parameters()[1], reference.parameters()[1], rtol=0, atol=0)
    torch.testing.assert_close(read_at(shard, 0), initial, rtol=0, atol=0)  # still kept: the one before the current
    with pytest.raises(StepConflict, match="no longer kept"):
        for step in (1, 2):
            for worker in (0, 1):
                for at in (0, 3):
                    push(shard, worker, step, at, 1.0)
        read_at(shard, 0)


def test_after_a_skipped_step_the_version_before_is_the_published_one() -> None:
    shard = two_pieces(workers=1)
    before = shard.parameters()[1]
    for at in (0, 3):
        shard.piece(at, 3).push(0, 0, None, 1, skip=True)
    assert shard.version == 1
    torch.testing.assert_close(read_at(shard, 0), before, rtol=0, atol=0)
    torch.testing.assert_close(read_at(shard, 1), before, rtol=0, atol=0)


def test_pull_at_over_grpc_reads_the_held_version_and_names_what_it_cannot() -> None:
    shard = two_pieces()
    initial = shard.parameters()[1]
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    servicer.attach(shard, 8)
    server.set_serving(True)
    client = PsClient([f"127.0.0.1:{server.port}"], 6, chunk_bytes=8, pull_timeout_s=0.5)
    try:
        push(shard, 1, 0, 0, 1.0)
        push(shard, 0, 0, 0, 1.0)
        push(shard, 0, 0, 3, 1.0)
        out = torch.full((6,), -1.0)
        client.pull_at(0, out)
        torch.testing.assert_close(out, initial, rtol=0, atol=0)
        with pytest.raises(ps_api.WaitTimeout):
            client.pull_at(1, out)
        assert client.contributed(1) == -1 and client.contributed(0) == 0  # worker 1 reached one piece of two
        with pytest.raises(ps_api.UnknownWorker):
            client.contributed(2)
        push(shard, 1, 0, 3, 1.0)
        assert client.contributed(1) == 0  # its push of step 0 is everywhere: a replacement goes on from step 1
        for worker in (0, 1):
            for at in (0, 3):
                push(shard, worker, 1, at, 1.0)
        with pytest.raises(ps_api.StepConflict, match="no longer kept"):
            client.pull_at(0, out)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        stub = channel.unary_stream(
            f"/{full_service_name('ParameterServer')}/PullAt",
            request_serializer=pb.PullAtRequest.SerializeToString,
            response_deserializer=pb.PullReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(stub(pb.PullAtRequest(shard_id=3, version=2), timeout=5))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        replies = list(stub(pb.PullAtRequest(shard_id=0, version=1), timeout=5))
        assert {r.version for r in replies} == {1}
        channel.close()
    finally:
        client.close()
        shard.close()
        server.stop(0)


def versions(shards: Sequence[PiecedShard]) -> set[int]:
    """Pieces the dead worker pushed move on once the survivor pushes them too; the others wait for its slot."""
    return {p.version for shard in shards for p in shard.pieces}


class DiesMidStep(LocalPsClient):
    """A worker's client that is cut off after pushing the first bucket of step ``dies_at``."""

    def __init__(self, shards: Sequence[PiecedShard], dies_at: int) -> None:
        super().__init__(shards, pull_timeout_s=60)
        self.dies_at = dies_at
        self.pushed: list[int] = []

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        if step == self.dies_at:
            if self.pushed:
                raise ps_api.Unavailable("the worker was killed")
            self.pushed.append(step)
        return super().push_pieces(flat, pieces, worker_id, step, device_count)


def test_a_replacement_redoes_a_step_its_predecessor_pushed_to_some_pieces_only(
    make_trainer: MakeTrainer,  # noqa: F811
) -> None:
    dies_at = 2
    shards = build_shards(workers=2)
    survivor = make_trainer(0, LocalPsClient(shards, pull_timeout_s=60), bucket_bytes=SMALL_BUCKETS)
    dying = make_trainer(1, DiesMidStep(shards, dies_at), bucket_bytes=SMALL_BUCKETS)
    runs = [start(survivor), start(dying)]
    runs[1][0].join(60)
    assert not runs[1][0].is_alive() and "error" in runs[1][1], runs[1][1]
    wait_for(lambda: versions(shards) == {dies_at, dies_at + 1}, 30, "the survivor's pushes of the step")
    client = LocalPsClient(shards, pull_timeout_s=60)
    replacement = make_trainer(1, client, bucket_bytes=SMALL_BUCKETS)
    per_step = DEVICES * PER_DEVICE
    replacement.feed = DataFeed(DATA, ListSource(1, worker_samples(1)[dies_at * per_step :]))  # its slot's data
    member = FakeMember()
    replacement.start_at = rejoin(member, 1, client, LAYOUT.total, None, dies_at)  # type: ignore[arg-type]
    assert replacement.start_at == dies_at and member.coordinator.requests[0].step == dies_at  # it redoes the step
    runs.append(start(replacement))
    for thread, _ in (runs[0], runs[2]):
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert runs[0][1] == {"ran": STEPS} and runs[2][1] == {"ran": STEPS - dies_at}, runs
    torch.testing.assert_close(final_parameters(shards), reference(workers=2), rtol=1e-5, atol=1e-6)


def lars_shards(workers: int = 2) -> list[PiecedShard]:
    """The test_overlap shards with LARS: ``0.weight`` spans shards 0 and 1, ``2.weight`` shards 1 and 2."""
    sizes = [math.prod(shape) for shape in LAYOUT.shapes]
    exchange = InProcessExchange(PS_SHARDS, timeout_s=60)
    lars = pb.OptimizerSpec(name="lars", momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)

    def layers(shard_id: int) -> Layers:
        return Layers(segments_for(sizes, PS_SHARDS, shard_id), exchange.combiner(shard_id))

    return build_shards(workers, lars, 0.5, layers)


class AtOnce(LocalPsClient):
    """Pushes each piece on a thread of its own, as the gRPC client's calls to the shards run at once: a LARS
    shard's update waits for its peers' norms, which may take this very worker's push to a peer."""

    def __init__(self, shards: Sequence[PiecedShard]) -> None:
        super().__init__(shards, pull_timeout_s=60)
        self.pushing = ThreadPoolExecutor(8, thread_name_prefix="push")

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        def one(piece: ShardRange) -> ShardAck:
            return LocalPsClient.push_pieces(self, flat, [piece], worker_id, step, device_count).wait()[0]

        return PushHandle([self.pushing.submit(one, piece) for piece in pieces])

    def close(self, cancel: bool = False) -> None:
        super().close(cancel=cancel)
        self.pushing.shutdown(wait=False)


class DiesInsideASplitParameter(AtOnce):
    """Cut off in step ``dies_at`` after pushing the last shard's piece of a parameter two shards hold only."""

    def __init__(self, shards: Sequence[PiecedShard], dies_at: int) -> None:
        super().__init__(shards)
        self.dies_at = dies_at

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        holders = {p.shard_id for p in pieces}
        if step == self.dies_at and len(holders) > 1:
            last = [p for p in pieces if p.shard_id == max(holders)]
            super().push_pieces(flat, last, worker_id, step, device_count)  # on its way: the shard takes it
            raise ps_api.Unavailable("the worker was killed")
        return super().push_pieces(flat, pieces, worker_id, step, device_count)


def test_with_lars_a_replacement_redoes_a_step_whose_split_parameter_reached_one_holder(
    make_trainer: MakeTrainer,  # noqa: F811
) -> None:
    """The holder that has both pushes updates and waits for the other's norms, which come only after the
    replacement's push there; it must answer the replacement meanwhile (it held its lock: the job rolled back)."""
    fault_free = lars_shards()
    runs = [start(make_trainer(w, AtOnce(fault_free), bucket_bytes=SMALL_BUCKETS)) for w in (0, 1)]
    for thread, outcome in runs:
        thread.join(120)
        assert not thread.is_alive() and outcome == {"ran": STEPS}, outcome
    dies_at = 2
    shards = lars_shards()
    survivor = make_trainer(0, AtOnce(shards), bucket_bytes=SMALL_BUCKETS)
    dying = make_trainer(1, DiesInsideASplitParameter(shards, dies_at), bucket_bytes=SMALL_BUCKETS)
    runs = [start(survivor), start(dying)]
    runs[1][0].join(60)
    assert not runs[1][0].is_alive() and "error" in runs[1][1], runs[1][1]
    split = shards[-1].pieces[0]  # 2.weight's part on the last shard: the dying worker pushed it, not the other part
    assert LAYOUT.offsets[2] < split.start < LAYOUT.offsets[3]
    wait_for(lambda: split._updating, 30, "the holder with both pushes to wait for its peer's norms")
    client = AtOnce(shards)
    replacement = make_trainer(1, client, bucket_bytes=SMALL_BUCKETS)
    per_step = DEVICES * PER_DEVICE
    replacement.feed = DataFeed(DATA, ListSource(1, worker_samples(1)[dies_at * per_step :]))
    member = FakeMember()
    replacement.start_at = rejoin(member, 1, client, LAYOUT.total, None, dies_at)  # type: ignore[arg-type]
    assert replacement.start_at == dies_at  # it redoes the step
    runs.append(start(replacement))
    for thread, _ in (runs[0], runs[2]):
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert runs[0][1] == {"ran": STEPS} and runs[2][1] == {"ran": STEPS - dies_at}, runs
    torch.testing.assert_close(final_parameters(shards), final_parameters(fault_free), rtol=1e-6, atol=1e-7)


def test_a_replacement_goes_on_after_a_step_its_predecessor_pushed_everywhere() -> None:
    """Its push stays counted (and the data shards it completed after it); the coordinator stands in for its report."""
    shard = two_pieces()
    for worker in (1, 0):
        for at in (0, 3):
            push(shard, worker, 0, at, 1.0)
    member = FakeMember()
    joined = rejoin(member, 1, LocalPsClient([shard]), 6, None, 0)  # type: ignore[arg-type]
    assert joined == 1 and member.coordinator.requests[0].step == 1
