"""A GPU's bucket copied straight into the shards' push regions (issue 12): real aio gRPC shards on 127.0.0.1.

A worker with one GPU asks the client for its pieces' spans of the colocated shards' push regions, page-locked
(``runtime.host_pinning``); the GPU copies each bucket there, and the push names those pieces as placed, so the
client copies nothing. Here a recording stand-in does the page-locking (the CUDA runtime's calls need a GPU) and
the test writes the spans as the GPU would; the CUDA-only tests at the bottom do it with a real GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.runtime import host_pinning, shm_region
from pstrain.runtime.buckets import Bucket, BucketPlan, plan_buckets
from pstrain.runtime.host_pinning import HostPinning
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.ps_api import InvalidRequest
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import start_server
from pstrain.worker import overlap
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.overlap import BucketPusher, StagedBucket
from pstrain.worker.replicas import Replica, ReplicaSet
from pstrain.worker.trainer import Trainer
from tests.helpers import odd_mlp
from tests.test_overlap import build_shards as overlap_shards
from tests.test_shm_path import LR, SGD, TOTAL, WORKERS, Cluster, pieces_of, start_cluster
from tests.test_trainer import (
    DATA,
    DEVICES,
    LAYOUT,
    PER_DEVICE,
    PS_SHARDS,
    STEPS,
    ListSource,
    Reporter,
    final_parameters,
    reference,
    seeded_model,
    start,
    worker_samples,
)


@dataclass
class Pins:
    """The page-locking a client asked for: region addresses pinned and released, in order."""

    ok: bool = True
    pinned: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def pinning(self) -> HostPinning:
        def pin(t: torch.Tensor) -> bool:
            if self.ok:
                self.pinned.append(t.data_ptr())
            return self.ok

        def unpin(t: torch.Tensor) -> None:
            assert t.numel() > 0, "released after the region was unmapped"
            self.released.append(t.data_ptr())

        return HostPinning(pin, unpin)


def client(cluster: Cluster, pins: Pins | None, shared_memory: bool = True, bf16: bool = False) -> PsClient:
    return PsClient(cluster.addresses, TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10,
                    shared_memory=shared_memory, push_dtype=torch.bfloat16 if bf16 else torch.float32,
                    pinning=None if pins is None else pins.pinning())  # fmt: skip


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def gradient(step: int, worker: int) -> torch.Tensor:
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * step + worker))


def all_pieces(c: PsClient) -> list[ShardRange]:
    return [p for r in c.ranges for p in pieces_of(r)]


def train(cluster: Cluster, place: bool, steps: int = 3) -> tuple[torch.Tensor, list[PsClient]]:
    """Two workers push every piece and pull it back for ``steps`` steps; with ``place`` each gradient is written
    into the push targets only (``flat`` holds zeros), as proof that a placed push is read from the region."""
    pins = [Pins() for _ in range(WORKERS)]
    clients = [client(cluster, p if place else None) for p in pins]
    try:
        return train_with(clients, pins, place, steps), clients
    except BaseException:
        for c in clients:
            c.close(cancel=True)
        raise


def train_with(clients: list[PsClient], pins: list[Pins], place: bool, steps: int) -> torch.Tensor:
    pieces = all_pieces(clients[0])
    out = [torch.empty(TOTAL) for _ in clients]
    for step in range(steps):
        pulls = []
        for w, c in enumerate(clients):
            grad = gradient(step, w)
            flat, placed = grad, None
            if place:
                targets = c.push_targets(pieces, w)
                assert all(t is not None for t in targets)
                for p, t in zip(pieces, targets, strict=True):
                    t.copy_(grad[p.start : p.end])  # type: ignore[union-attr]
                flat, placed = torch.zeros(TOTAL), targets
            pushed, pulled = c.push_pull_pieces(flat, pieces, w, step, 1, out[w], placed)
            pulls.append((pushed, pulled))
        for pushed, pulled in pulls:
            pushed.wait()
            pulled.wait()
    assert torch.equal(out[0], out[1])
    for p, c in zip(pins, clients, strict=True):
        assert c.shared.counts.placed_pushes == (steps * len(pieces) if place else 0)
        if place:
            assert len(p.pinned) == len(c.ranges)  # each shard's push region, once
    return out[0]


def test_placed_pieces_are_sent_from_the_region_and_train_bit_for_bit() -> None:
    results = {}
    for place in (False, True):
        c = start_cluster()
        try:
            params, clients = train(c, place)
            for k in clients:
                k.close()
            results[place] = params
        finally:
            c.stop()
    assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("given_up", [False, True], ids=["in-use", "given-up"])
def test_regions_are_released_before_they_are_unmapped(cluster: Cluster, given_up: bool) -> None:
    """Released at ``close`` while still mapped (the stand-in checks), also a region the client gave up."""
    pins = Pins()
    c = client(cluster, pins)
    try:
        targets = c.push_targets(all_pieces(c), 0)
        assert len(pins.pinned) == 2 and pins.released == []
        assert sorted({t.untyped_storage().data_ptr() for t in targets if t is not None}) == sorted(pins.pinned)
        if given_up:
            c.shared.disable(0)
            assert c.push_targets(all_pieces(c), 0)[:3] == [None] * 3  # shard 0's pieces: no target any more
    finally:
        c.close()
    assert sorted(pins.released) == sorted(pins.pinned)
    assert c.shared.active == []


def test_a_cancelled_client_leaves_the_regions_page_locked_to_the_exit(cluster: Cluster) -> None:
    """The trainer's thread may still be copying into a target when a stopping worker cancels its client."""
    pins = Pins()
    c = client(cluster, pins)
    c.push_targets(all_pieces(c), 0)
    c.close(cancel=True)
    assert len(pins.pinned) == 2 and pins.released == []
    assert c.shared.active == [] and c.push_targets(all_pieces(c), 0) == [None] * 6


@pytest.mark.parametrize("case", ["no-pinning", "pinning-refused", "shared-memory-off", "bfloat16-push"])
def test_no_targets_where_nothing_is_page_locked(cluster: Cluster, case: str) -> None:
    pins = Pins(ok=case != "pinning-refused")
    c = client(
        cluster,
        None if case == "no-pinning" else pins,
        shared_memory=case != "shared-memory-off",
        bf16=case == "bfloat16-push",
    )
    try:
        pieces = all_pieces(c)
        assert c.push_targets(pieces, 0) == [None] * len(pieces)
        if case == "pinning-refused":
            assert c.shared.active == [0, 1]  # the regions are still used, the client copies into them
    finally:
        c.close()


def test_a_placed_piece_whose_regions_the_shard_dropped_is_streamed_from_its_span(cluster: Cluster) -> None:
    """Shard 0 drops its regions after the device wrote them: its push is refused (ABORTED), and the client
    streams the piece from where it lies."""
    clients = [client(cluster, Pins()) for _ in range(WORKERS)]
    pieces = all_pieces(clients[0])
    out = torch.empty(TOTAL)
    handles = []
    try:
        targets_of = [c.push_targets(pieces, w) for w, c in enumerate(clients)]
        cluster.servicers[0].close_shared_memory()
        for w, c in enumerate(clients):
            grad = gradient(0, w)
            targets = targets_of[w]
            for p, t in zip(pieces, targets, strict=True):
                t.copy_(grad[p.start : p.end])  # type: ignore[union-attr]
            flat = torch.full((TOTAL,), float("nan"))  # never read: every piece is placed
            handles.append(c.push_pull_pieces(flat, pieces, w, 0, 1, out, targets)[0])
        for handle in handles:  # a piece pushed and pulled in one call is acknowledged once every worker pushed
            handle.wait()
        reference = start_cluster()
        try:
            plain = [client(reference, None, shared_memory=False) for _ in range(WORKERS)]
            for w, k in enumerate(plain):
                k.push_pieces(gradient(0, w), pieces, w, 0, 1).wait()
            expected = torch.empty(TOTAL)
            plain[0].pull(1, expected)
            for k in plain:
                k.close()
        finally:
            reference.stop()
        got = torch.empty(TOTAL)
        clients[0].pull(1, got)
        assert torch.equal(got, expected)
        first = [p for p in pieces if p.shard_id == 0]
        for c in clients:
            # Shard 1's pieces, and at least one of shard 0's (sent before its refusal came back); the pieces go out
            # on the push pool at once, so how many more of shard 0's were sent before the refusal is up to timing.
            assert len(pieces) - len(first) < c.shared.counts.placed_pushes <= len(pieces)
            assert c.shared.counts.streamed_bytes >= sum(p.numel for p in first) * 4  # then streamed
            assert c.shared.active == [1]  # shard 0's refusal turned its regions off
    finally:
        for c in clients:
            c.close()


def test_placed_must_fit_the_pieces_and_nothing_is_pushed_otherwise(cluster: Cluster) -> None:
    c = client(cluster, Pins())
    pieces = all_pieces(c)
    out = torch.empty(TOTAL)
    try:
        targets = c.push_targets(pieces, 0)
        with pytest.raises(InvalidRequest, match="placed names 1 pieces for a push of 6"):
            c.push_pull_pieces(gradient(0, 0), pieces, 0, 0, 1, out, targets[:1])
        wrong = [torch.zeros(p.numel + 1) for p in pieces]
        with pytest.raises(
            InvalidRequest, match=r"piece \[0, 166\) placed in a cpu torch.float32 tensor of shape \(167,\)"
        ):
            c.push_pull_pieces(gradient(0, 0), pieces, 0, 0, 1, out, wrong)
        doubles = [None, torch.zeros(pieces[1].numel, dtype=torch.float64), *[None] * (len(pieces) - 2)]
        with pytest.raises(InvalidRequest, match="it needs a contiguous 1-D float32 host tensor of 167 elements"):
            c.push_pull_pieces(gradient(0, 0), pieces, 0, 0, 1, out, doubles)
        elsewhere = [torch.zeros(p.numel, device="meta") for p in pieces]
        with pytest.raises(InvalidRequest, match=r"placed in a meta torch.float32 tensor"):
            c.push_pull_pieces(gradient(0, 0), pieces, 0, 0, 1, out, elsewhere)
        strided = [torch.zeros(2 * p.numel)[::2] for p in pieces]
        with pytest.raises(InvalidRequest, match="it needs a contiguous"):
            c.push_pull_pieces(gradient(0, 0), pieces, 0, 0, 1, out, strided)
        assert all(s.version == 0 and s.snapshot().pushes_waiting == 0 for s in cluster.shards)
    finally:
        c.close()


# ---------------------------------------------------------------- the worker's side: BucketPusher with one device


def one_bucket_plan(c: PsClient) -> BucketPlan:
    """One parameter of ``TOTAL`` elements in one bucket, cut into the test shards' pieces."""
    return BucketPlan((Bucket(0, 0, TOTAL, (0,), tuple(all_pieces(c))),), (0,), TOTAL)


class FakeGpu:
    """What ``Replica.stage_bucket`` does on a GPU, done by the CPU: copy each piece into its target or else the
    staging buffer, and report the finiteness the device's sum would (or, ``flag``, a given verdict)."""

    def __init__(self, grads: torch.Tensor, staging: torch.Tensor, flag: bool | None = None) -> None:
        self.grads, self.staging, self.flag = grads, staging, flag
        self.targets_seen: list[int] = []

    def stage(self, bucket: Bucket, targets: Sequence[torch.Tensor | None]) -> StagedBucket:
        for piece, target in zip(bucket.pieces, targets or [None] * len(bucket.pieces), strict=True):
            into = self.staging[piece.start : piece.end] if target is None else target
            into.copy_(self.grads[piece.start : piece.end])
        self.targets_seen.append(sum(t is not None for t in targets))
        flag = torch.isfinite(self.grads[bucket.start : bucket.end].sum()).reshape(1)
        return StagedBucket(None, flag if self.flag is None else torch.tensor([self.flag]), tuple(targets))


@pytest.mark.parametrize("place", [True, False], ids=["placed", "copied-by-the-client"])
def test_a_one_device_pusher_places_its_buckets_and_checks_them_on_the_device(
    cluster: Cluster, place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_checks = []
    monkeypatch.setattr(overlap, "all_finite", lambda t: host_checks.append(t.numel()) or all_finite(t))
    clients = [client(cluster, Pins()) for _ in range(WORKERS)]
    staging = [torch.zeros(TOTAL) for _ in clients]
    params = [torch.empty(TOTAL) for _ in clients]
    plan = one_bucket_plan(clients[0])
    pushers = [
        BucketPusher(plan, 1, c, w, torch.empty(TOTAL), params[w], [staging[w]], True, place_on_device=place)
        for w, c in enumerate(clients)
    ]
    try:
        gpus = []
        for w, pusher in enumerate(pushers):
            gpus.append(FakeGpu(gradient(0, w), staging[w]))
            pusher.start(0)
            pusher.gradient_ready(0, 0, gpus[-1].stage)
        results = [p.finish() for p in pushers]
        for r in results:
            assert r.finite
            for _, _, handle in r.handles:
                handle.wait()
            for pull in r.pulls.values():
                assert pull.wait() == 1
        assert torch.equal(params[0], params[1])
        assert host_checks == []  # the device's finite sum stood for the host's pass
        pieces = len(plan.buckets[0].pieces)
        for w, (c, gpu) in enumerate(zip(clients, gpus, strict=True)):
            assert gpu.targets_seen == [pieces if place else 0]
            assert c.shared.counts.placed_pushes == (pieces if place else 0)
            assert torch.equal(staging[w], torch.zeros(TOTAL) if place else gpu.grads)  # placed: the host copied none
            bucket = plan.buckets[0]
            assert pushers[w].host_gradient(results[w], bucket) is staging[w]  # what a repeated push would send
            assert torch.equal(staging[w], gpu.grads)
    finally:
        for p in pushers:
            p.close()
        for c in clients:
            c.close()


def two_bucket_plan(c: PsClient) -> BucketPlan:
    """Two parameters, each a bucket of one shard's pieces; bucket 0 (backward's first) is the second half."""
    pieces = all_pieces(c)
    half = TOTAL // 2
    first = Bucket(0, half, TOTAL, (1,), tuple(p for p in pieces if p.start >= half))
    second = Bucket(1, 0, half, (0,), tuple(p for p in pieces if p.start < half))
    return BucketPlan((first, second), (1, 0), TOTAL)


@pytest.mark.parametrize("values", ["finite", "nan"])
@pytest.mark.parametrize("buckets", ["one bucket", "a bucket that starts mid-vector"])
def test_a_device_sum_that_is_not_finite_leaves_the_verdict_to_the_host(
    cluster: Cluster, values: str, buckets: str
) -> None:
    """The device's flag says "look": the host's pass over the bucket decides, with the placed pieces gathered
    from the push regions to their own offsets (a finite bucket whose device sum overflowed is pushed, exactly as
    computed; a NaN is not), in a bucket at the start of the flat vector and in one further on."""
    c = client(cluster, Pins())
    plan = one_bucket_plan(c) if buckets == "one bucket" else two_bucket_plan(c)
    bucket = plan.buckets[0]
    grads = gradient(0, 0)
    if values == "nan":
        grads[bucket.start + 7] = float("nan")  # in the bucket's first piece: placed, so only the region has it
    staging = torch.zeros(TOTAL)
    pusher = BucketPusher(plan, 1, c, 0, torch.empty(TOTAL), torch.empty(TOTAL), [staging], True, True)
    try:
        pusher.start(0)
        pusher.gradient_ready(0, bucket.params[0], FakeGpu(grads, staging, flag=False).stage)
        pusher.device_done(0, FakeGpu(grads, staging).stage)  # the other bucket, if any: placed, found finite
        result = pusher.finish()
        assert result.finite is (values == "finite")
        assert [skipped for _, skipped, _ in result.handles][:1] == [values == "nan"]
        # The host looked at the bucket's own values: gathered to their offsets, nothing else overwritten.
        torch.testing.assert_close(
            staging[bucket.start : bucket.end], grads[bucket.start : bucket.end], rtol=0, atol=0, equal_nan=True
        )
        assert not staging[: bucket.start].any()
    finally:
        pusher.close()
        c.close(cancel=True)  # worker 1 never pushes: the pulls the pushes started would wait for it


def test_staged_bucket_flags() -> None:
    assert not StagedBucket(None).surely_finite()
    assert StagedBucket(None, torch.tensor([True])).surely_finite()
    assert not StagedBucket(None, torch.tensor([False])).surely_finite()


def test_host_pinning_is_for_one_gpu_only() -> None:
    assert host_pinning.for_devices([torch.device("cpu")]) is None
    assert host_pinning.for_devices([torch.device("cuda", 0), torch.device("cuda", 1)]) is None
    expected = torch.cuda.is_available()
    assert (host_pinning.for_devices([torch.device("cuda", 0)]) is not None) is expected


# ---------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_page_locks_a_shared_memory_region_and_copies_a_bucket_into_it() -> None:
    model = odd_mlp()
    layout = ParamLayout.of(model)
    region = shm_region.create(layout.total, shm_region.new_nonce())
    cuda = host_pinning.CudaPinning(torch.device("cuda", 0))
    pinned = False
    try:
        pinned = cuda.pin(region.data)
        assert pinned and region.data.is_pinned()
        assert not cuda.pin(region.data)  # registered already: refused on the helper thread, nothing left behind
        torch.ones(4, device="cuda").sum().item()  # a launch on this thread still succeeds
        replica = Replica.build(model, torch.device("cuda", 0), layout, pin=True, memory=None)
        replica.finite_flags = {}  # as ReplicaSet sets it for one GPU
        bucket = plan_buckets(layout, shard_ranges(layout.total, 2), 0).buckets[0]  # one bucket, two pieces
        replica.flat_grads.copy_(torch.randn(layout.total))
        first = bucket.pieces[0]
        targets = [region.data[first.start : first.end], None]  # the first piece placed, the second staged
        replica.staging.zero_()
        staged = replica.stage_bucket(bucket, targets)
        assert staged is not None
        staged.wait()
        assert staged.placed == tuple(targets) and staged.surely_finite()
        expected = replica.flat_grads.cpu()
        assert torch.equal(region.data[first.start : first.end], expected[first.start : first.end])
        assert torch.equal(replica.staging[first.end :], expected[first.end :])
        assert not replica.staging[: first.end].any()  # a placed piece does not cross PCIe twice
        replica.flat_grads[3] = float("inf")
        staged = replica.stage_bucket(bucket, ())
        assert staged is not None
        staged.wait()
        assert staged.placed == () and not staged.surely_finite()
        assert torch.equal(replica.staging, replica.flat_grads.cpu())
        cuda.unpin(region.data)
        pinned = False
        assert not region.data.is_pinned()
    finally:
        if pinned:
            cuda.unpin(region.data)
        region.close()
        shm_region.unlink(region.path)


def test_the_in_process_client_reads_placed_pieces_too() -> None:
    """``LocalPsClient`` (through ``push_then_pull``) honours ``placed`` as the gRPC client does."""
    initial = torch.randn(TOTAL, generator=torch.Generator().manual_seed(5))
    grad = gradient(0, 0)
    results = []
    for place in (False, True):
        shards = [
            PiecedShard.build(pieces_of(r), initial[r.start : r.end].clone(), SGD, LR, 1)
            for r in shard_ranges(TOTAL, 2)
        ]
        local = LocalPsClient(shards, pull_timeout_s=10)
        pieces = [p for r in local.ranges for p in pieces_of(r)]
        placed = [grad[p.start : p.end].clone() for p in pieces] if place else None
        flat = torch.zeros(TOTAL) if place else grad
        out = torch.empty(TOTAL)
        pushed, pulled = local.push_pull_pieces(flat, pieces, 0, 0, 1, out, placed)
        pushed.wait()
        assert pulled.wait() == 1
        if place:
            assert not flat.any()  # gathered into a copy, the caller's vector untouched
        results.append(out)
        local.close()
        for s in shards:
            s.close()
    assert torch.equal(results[0], results[1])


def test_a_one_gpu_trainer_stand_in_places_its_pieces_and_trains_like_one_process() -> None:
    """The trainer's whole path with a stand-in for the GPU: one device per worker with a staging buffer of its own
    (so the trainer asks for push targets), whose copies ``FakeGpu`` makes; real gRPC shards cut into pieces."""
    shards = overlap_shards(workers=2)
    servers = []
    for shard in shards:
        servicer = ParameterServerServicer()
        server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
        servicer.attach(shard, 64)
        server.set_serving(True)
        servers.append(server)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    pins = [Pins() for _ in range(2)]
    trainers: list[Trainer] = []
    try:
        for w in range(2):
            ps = PsClient(addresses, LAYOUT.total, chunk_bytes=64, pull_timeout_s=60, pinning=pins[w].pinning())
            replicas = ReplicaSet(seeded_model, [torch.device("cpu")], LAYOUT)
            replica = replicas.replicas[0]
            replica.staging = torch.zeros(LAYOUT.total)  # as a GPU's pinned buffer: the gradient is copied out
            gpu = FakeGpu(replica.flat_grads, replica.staging)
            replica.stage_bucket = gpu.stage  # type: ignore[method-assign]
            assert replicas.places_on_device
            job = pb.JobSpec(
                steps=STEPS, per_device_batch=DEVICES * PER_DEVICE, total_params=LAYOUT.total, bucket_bytes=64
            )
            feed = DataFeed(DATA, ListSource(w, worker_samples(w)))
            trainer = Trainer(
                w, job, replicas, ps, feed, torch.nn.functional.cross_entropy, Reporter(), threading.Event()
            )
            trainers.append(trainer)
        runs = [start(t) for t in trainers]
        for thread, _ in runs:
            thread.join(120)
            assert not thread.is_alive(), "a trainer hung"
        assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
        expected = reference(workers=2)
        torch.testing.assert_close(final_parameters(shards), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
        pieces = sum(len(b.pieces) for b in trainers[0].plan.buckets)
        for t, p in zip(trainers, pins, strict=True):
            assert t.ps.shared.counts.placed_pushes == STEPS * pieces  # type: ignore[attr-defined]
            assert len(p.pinned) == PS_SHARDS
            assert not t.replicas.replicas[0].staging.any()  # every piece went to its push region, none to staging
    finally:
        for t in trainers:
            t.ps.close(cancel=True)
            t.replicas.close()
        for shard in shards:
            shard.close()
        for server in servers:
            server.stop(0)
