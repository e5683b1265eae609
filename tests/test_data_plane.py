"""``ShardDataPlane`` without a network: what the servicer calls, driven on an event loop of the test's own."""

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import PushPart, TensorAssembler, decode_pull_reply, decode_push_request, encode_push_chunks
from pstrain.ps_server.bulk import BulkSocket
from pstrain.ps_server.data_plane import (
    BULK_IO_THREADS,
    PUSHES_STAGED,
    PullCall,
    PushCall,
    ShardDataPlane,
    slots_per_worker,
)
from pstrain.ps_server.errors import InvalidArgument, PayloadTimeout, StepConflict, WaitTimeout
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.shm import StaleRegion
from pstrain.runtime import shm_region
from pstrain.runtime.identity import PermissionDenied
from pstrain.runtime.shard_map import ShardRange

NUMEL = 10
SGD = pb.OptimizerSpec(name="sgd")
LR = pb.LrSchedule(scaled_lr=1.0)


def plane(workers: int = 2) -> tuple[ShardDataPlane, torch.Tensor]:
    initial = torch.linspace(-1, 1, NUMEL)
    data_plane = ShardDataPlane()
    data_plane.shared_memory = False
    data_plane.attach(ParameterShard(0, 0, NUMEL, initial.clone(), SGD, LR, workers=workers), chunk_bytes=12)
    return data_plane, initial


def admit(wait_s: float = 5.0):
    @contextlib.contextmanager
    def admitted() -> Iterator[float]:
        yield wait_s

    return admitted


async def chunks(tensor: torch.Tensor) -> AsyncIterator[PushPart]:
    for raw in encode_push_chunks(tensor, chunk_bytes=12):
        yield decode_push_request(raw)


def header(worker: int, step: int, **fields) -> PushCall:
    return PushCall(0, worker, step, 1, pb.FLOAT32, NUMEL, **fields)


def decoded(replies) -> tuple[int, torch.Tensor]:
    parts = [decode_pull_reply(replies[i]) for i in range(len(replies))]
    assembler = TensorAssembler(torch.float32, NUMEL)
    for part in parts:
        assembler.add(part.chunk)
    return parts[0].version, assembler.result()


def test_a_pull_waits_for_both_pushes_and_gets_the_update():
    data_plane, initial = plane()
    g0, g1 = torch.randn(NUMEL), torch.randn(NUMEL)

    async def run():
        pull = asyncio.ensure_future(data_plane.pull_encoded(PullCall(0, 1), admit()))
        first = await data_plane.push(header(0, 0), None, chunks(g0), lambda: None)
        await asyncio.sleep(0)
        assert not pull.done() and not first.completed  # one worker of two has pushed
        second = await data_plane.push(header(1, 0), None, chunks(g1), lambda: None)
        return first, second, await pull

    first, second, replies = asyncio.run(run())
    assert second.completed and second.version == 1
    version, params = decoded(replies)
    assert version == 1 and torch.allclose(params, initial - (g0 + g1) / 2)


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 2, 0), (2, 0, 1)])
def test_received_pushes_become_accumulators_and_staging_buffers_stay_apart(order):
    """Issue 12: a streamed push's staging buffer is kept as the accumulator and the pool gets the old one back;
    over steps in every arrival order the shard's parameters are those of an in-process shard that copies, and no
    buffer is ever both in the pool and the shard's."""
    data_plane, initial = plane(workers=3)
    reference = ParameterShard(0, 0, NUMEL, initial.clone(), SGD, LR, workers=3)
    gen = torch.Generator().manual_seed(3)

    async def run():
        piece = data_plane.shard.piece(0, NUMEL)
        for step in range(4):
            grads = [torch.randn(NUMEL, generator=gen) * 10 ** (3 * w) for w in range(3)]
            for worker in (0, 1, 2):
                reference.push(worker, step, grads[worker], 1)
            before = piece._accum
            for worker in order:
                await data_plane.push(header(worker, step), None, chunks(grads[worker]), lambda: None)
                pooled = [b for free in data_plane._pool._free.values() for b in free]
                assert all(b is not piece._accum for b in pooled)
                assert len({id(b) for b in pooled}) == len(pooled)
            assert piece._accum is not before  # a received buffer was kept, not copied

    asyncio.run(run())
    assert data_plane.shard.version == 4
    assert torch.equal(data_plane.shard.parameters()[1], reference.parameters()[1])


def test_a_repeated_push_is_a_duplicate_and_one_ahead_a_conflict():
    data_plane, _ = plane(workers=1)
    grad = torch.ones(NUMEL)

    async def run():
        done = await data_plane.push(header(0, 0), None, chunks(grad), lambda: None)
        again = await data_plane.push(header(0, 0), None, chunks(grad), lambda: None)
        with pytest.raises(StepConflict):
            await data_plane.push(header(0, 5), None, chunks(grad), lambda: None)
        return done, again

    done, again = asyncio.run(run())
    assert done.completed and again.duplicate and again.version == 1 and not again.completed


def test_bad_calls_are_refused_before_anything_moves():
    data_plane, initial = plane(workers=1)

    async def run():
        with pytest.raises(InvalidArgument, match="not where a piece"):
            await data_plane.pull_encoded(PullCall(0, 0, piece=3), admit())
        with pytest.raises(InvalidArgument, match="shm_nonce"):
            await data_plane.push_shared(header(0, 0, piece=0))
        with pytest.raises(InvalidArgument, match="names the caller's pull region"):
            await data_plane.pull_shared(PullCall(0, 0), admit())
        with pytest.raises(InvalidArgument, match="skips its step carries no payload"):
            await data_plane.push(header(0, 0, skip=True), None, chunks(torch.ones(NUMEL)), lambda: None)
        return await data_plane.pull_encoded(PullCall(0, 0), admit())

    version, params = decoded(asyncio.run(run()))
    assert version == 0 and torch.equal(params, initial) and data_plane.shard.version == 0


def test_a_refused_pull_learns_nothing_of_the_pieces_and_starts_no_follower():
    data_plane, _ = plane()

    @contextlib.contextmanager
    def refused() -> Iterator[float]:
        raise PermissionDenied("no credential")
        yield 0.0

    async def run():
        for piece in (None, 0, 7):  # the whole shard, a piece, a piece this shard does not have
            with pytest.raises(PermissionDenied):
                await data_plane.pull_encoded(PullCall(0, 0, piece=piece), refused)

    asyncio.run(run())
    assert data_plane.pulls_waiting == 0 and not data_plane._versions  # no thread reads or encodes the shard


def test_a_pull_waits_no_longer_than_its_admission_allows():
    data_plane, _ = plane()

    async def run():
        with pytest.raises(WaitTimeout, match="version 1 did not appear within 0.1s"):
            await data_plane.pull_encoded(PullCall(0, 1), admit(0.1))

    asyncio.run(run())


def test_a_colocated_piece_is_pushed_and_pulled_through_the_regions():
    """Shared memory, as a worker on this host uses it: the header is all the call carries."""
    initial = torch.linspace(-1, 1, NUMEL)
    data_plane = ShardDataPlane()
    data_plane.attach(ParameterShard(0, 0, NUMEL, initial.clone(), SGD, LR, workers=1), chunk_bytes=12)
    pair = data_plane.regions.open(0, "ipv4:127.0.0.1:40000")
    push = shm_region.attach(pair.push.path, NUMEL, pair.nonce)
    pull = shm_region.attach(pair.pull.path, NUMEL, pair.nonce)
    grad = torch.randn(NUMEL)
    push.data[:] = grad

    async def run():
        pushed = await data_plane.push_shared(header(0, 0, piece=0, shm_nonce=pair.nonce))
        again = await data_plane.push_shared(header(0, 0, piece=0, shm_nonce=pair.nonce))
        pulled = await data_plane.pull_shared(PullCall(0, 1, piece=0, shm_worker=0, shm_nonce=pair.nonce), admit())
        with pytest.raises(StaleRegion):
            await data_plane.pull_shared(PullCall(0, 1, piece=0, shm_worker=0, shm_nonce=b"x" * 16), admit())
        return pushed, again, pulled

    try:
        pushed, again, (version, slot) = asyncio.run(run())
        assert pushed.completed and again.duplicate and (version, slot) == (1, None)
        assert torch.allclose(pull.data, initial - grad)
    finally:
        push.close()
        pull.close()
        data_plane.close()


@pytest.mark.parametrize("call", ["a pull waiting for its version", "a push stream waiting for its end"])
def test_regions_replaced_during_a_call_make_it_stale_and_change_nothing(call):
    """The worker opens its regions again (or closes them) while a call that found the old pair still waits: the
    call is told its regions are stale (ABORTED: the worker opens again or streams), never reads or writes the
    emptied tensors of the old pair, and the shard is as it was."""
    initial = torch.linspace(-1, 1, NUMEL)
    data_plane = ShardDataPlane()
    shard = ParameterShard(0, 0, NUMEL, initial.clone(), SGD, LR, workers=1)
    data_plane.attach(shard, chunk_bytes=12)
    old = data_plane.regions.open(0, "ipv4:127.0.0.1:40000")

    async def run():
        if call == "a pull waiting for its version":
            waiting = data_plane.pull_shared(PullCall(0, 1, piece=0, shm_worker=0, shm_nonce=old.nonce), admit())
            pending = asyncio.ensure_future(waiting)
            await asyncio.sleep(0)  # the pull runs up to its wait for version 1, the pair found before that
            new = data_plane.regions.open(0, "ipv4:127.0.0.1:40000")
            new.push.data[:] = torch.ones(NUMEL)
            await data_plane.push_shared(header(0, 0, piece=0, shm_nonce=new.nonce))  # version 1 appears
        else:
            reading, ended = asyncio.Event(), asyncio.Event()

            async def tail() -> AsyncIterator[PushPart]:  # the stream's half-close comes a moment later
                reading.set()  # the push found its pair and now reads the rest of its stream
                await ended.wait()
                return
                yield

            pending = asyncio.ensure_future(data_plane.push(header(0, 0, shm_nonce=old.nonce), None, tail(), lambda: 5))
            await asyncio.wait_for(reading.wait(), 10)
            data_plane.regions.open(0, "ipv4:127.0.0.1:40000")
            ended.set()
        with pytest.raises(StaleRegion, match="replaced or closed during the call"):
            await pending

    try:
        asyncio.run(run())
        if call == "a push stream waiting for its end":
            assert shard.version == 0 and torch.equal(shard.parameters()[1], initial)
        else:
            assert shard.version == 1  # the new pair's push went through
    finally:
        data_plane.close()


def test_a_cancelled_push_keeps_its_staging_slot_until_its_thread_is_done():
    """A push cancelled while its thread still works (here: waiting for a piece whose lock an update holds) keeps
    its staging slot and buffer until that thread ends, so no more than ``PUSHES_STAGED`` pushes hold buffers and
    bulk threads at once however often workers give up and retry, and a bulk pull of another piece still finds a
    thread to be sent on."""
    shard = PiecedShard.build([ShardRange(0, 0, 4), ShardRange(0, 4, 8)], torch.zeros(8), SGD, LR, 1)
    data_plane = ShardDataPlane()
    data_plane.shared_memory = False
    data_plane.attach(shard, chunk_bytes=12)
    acquired = []
    real_acquire = data_plane._pool.acquire
    data_plane._pool.acquire = lambda *args: acquired.append(args) or real_acquire(*args)  # type: ignore[method-assign]
    peers: list[socket.socket] = []

    def bulk_socket(ticket: bytes, payload: torch.Tensor | None) -> BulkSocket:
        ours, theirs = socket.socketpair()
        peers.extend([ours, theirs])
        if payload is not None:
            theirs.sendall(payload.numpy().tobytes())
        return BulkSocket(ours, 0, ticket)

    async def run() -> tuple[bool, int]:
        for i in range(BULK_IO_THREADS):  # every one of them cancelled, as a worker's deadline would
            call = PushCall(0, 0, 0, 1, pb.FLOAT32, 4, piece=0)
            push = asyncio.ensure_future(
                data_plane.push(call, bulk_socket(bytes([i]) * 16, torch.ones(4)), None, lambda: 5.0)
            )
            await asyncio.sleep(0.02)
            push.cancel()
            await asyncio.gather(push, return_exceptions=True)
        pull = PullCall(0, 0, piece=4, bulk_numel=4)
        puller = bulk_socket(b"p" * 16, None)
        sent = asyncio.ensure_future(data_plane.pull_bulk(pull, puller, admit(), lambda: 5.0, 5.0))
        done, _ = await asyncio.wait({sent}, timeout=5.0)
        return bool(done), len(acquired)

    busy = shard.pieces[0]._cond
    busy.acquire()  # an update of piece 0 holds its lock
    try:
        pulled, buffers = asyncio.run(run())
    finally:
        busy.release()
    try:
        assert pulled, "no bulk thread was left for the pull of piece 1"
        assert buffers == PUSHES_STAGED  # the other pushes were cancelled waiting for a slot: no buffer, no thread
        with shard.pieces[0].read(1, 10) as (version, _):  # the threads go on once the lock is free
            assert version == 1  # the first push applied; the rest were its duplicates
    finally:
        data_plane.close()
        for s in peers:
            s.close()


async def stalled(tensor: torch.Tensor, resume: asyncio.Event) -> AsyncIterator[PushPart]:
    """A push stream that sends its first chunk and then nothing until ``resume`` (a worker that stopped sending)."""
    raws = list(encode_push_chunks(tensor, chunk_bytes=12))
    yield decode_push_request(raws[0])
    await resume.wait()
    for raw in raws[1:]:
        yield decode_push_request(raw)


@pytest.mark.parametrize("workers, slots", [(1, PUSHES_STAGED), (2, 4), (3, 3), (4, 2), (8, 2), (100, 2)])
def test_a_worker_may_hold_its_share_of_the_staging_slots_and_never_fewer_than_its_client_sends(workers, slots):
    assert slots_per_worker(workers) == slots


def test_one_worker_whose_pushes_stall_cannot_take_every_staging_slot():
    """Worker 0 opens ``PUSHES_STAGED`` pushes and stops sending: it holds its share of the slots (4 of 8 in a job
    of 2 workers), its other pushes wait for its own, and worker 1's push goes through at once."""
    data_plane, _ = plane(workers=2)
    acquired = []
    real_acquire = data_plane._pool.acquire
    data_plane._pool.acquire = lambda *args: acquired.append(args) or real_acquire(*args)  # type: ignore[method-assign]

    async def run() -> None:
        resume = asyncio.Event()
        stuck = [
            asyncio.ensure_future(data_plane.push(header(0, 0), None, stalled(torch.ones(NUMEL), resume), lambda: 60))
            for _ in range(PUSHES_STAGED)
        ]
        other = asyncio.ensure_future(data_plane.push(header(1, 0), None, chunks(torch.ones(NUMEL)), lambda: 60))
        done, _ = await asyncio.wait({other}, timeout=10)
        assert done, "worker 1's push waited for worker 0's stalled ones"
        assert not other.result().completed  # worker 0 has not pushed step 0 yet
        assert len(acquired) == slots_per_worker(2) + 1  # worker 0's other pushes hold no buffer
        resume.set()  # worker 0 sends the rest: its first push completes the step, the others are duplicates
        results = await asyncio.wait_for(asyncio.gather(*stuck), timeout=10)
        assert sum(r.completed for r in results) == 1 and sum(r.duplicate for r in results) == PUSHES_STAGED - 1

    try:
        asyncio.run(run())
        assert data_plane.shard.version == 1
    finally:
        data_plane.close()


def test_a_push_whose_payload_stops_arriving_is_refused_and_frees_its_slot():
    data_plane, initial = plane()
    data_plane.push_timeout_s = 0.2  # the job's transport.push_timeout_s

    async def run() -> None:
        resume = asyncio.Event()
        with pytest.raises(PayloadTimeout, match="transport.push_timeout_s"):
            await asyncio.wait_for(
                data_plane.push(header(0, 0), None, stalled(torch.ones(NUMEL), resume), lambda: 60), timeout=10
            )
        assert data_plane._staging_slots._value == PUSHES_STAGED  # freed, and the worker's own slot too
        for worker in (0, 1):  # the same push, whole, then the other worker's: the step completes
            await data_plane.push(header(worker, 0), None, chunks(torch.ones(NUMEL)), lambda: 60)

    try:
        version, params = data_plane.shard.parameters()
        assert version == 0 and torch.equal(params, initial)  # the refused push changed nothing
        asyncio.run(run())
        assert data_plane.shard.version == 1
    finally:
        data_plane.close()
