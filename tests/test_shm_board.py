"""The shard's published board (issue 12): colocated workers copy each version straight out of shared memory.

A shard publishes every version into one of two halves of its board and stamps it; a piece's pull names the
slot and the worker copies it out, checking the stamp afterwards. What must hold: the board shows exactly the
versions the shard published (a half a reader still holds is never rewritten: that version goes off the board
and is copied as before), a copy the stamp refuses is pulled again through the pull region, the results equal
streaming bit for bit, a client that cannot map the board still gets its pulls copied, and a board dies with
its shard (no name in ``/dev/shm``).
"""

from __future__ import annotations

import gc
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.shm import SharedRegions
from pstrain.runtime import ps_client, shm_board
from pstrain.runtime.ps_api import Cancelled
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.shm_board import WRITING, Board
from pstrain.runtime.shm_region import ShmError
from pstrain.runtime.transport import ServingServer, open_channel, start_server
from tests.helpers import wait_for
from tests.test_shm_path import TOTAL, WORKERS, Cluster, pieces_of, start_cluster, train

pytestmark = pytest.mark.skipif(not shm_board.SUPPORTED, reason="the published board is x86-64 only")

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(scaled_lr=0.1)
N = 64


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster()
    yield c
    c.stop()


def _step(shard: ParameterShard, step: int) -> None:
    shard.push(0, step, torch.full((N,), float(step + 1)), 1)


def test_each_version_goes_into_the_other_half_with_its_stamp() -> None:
    board = shm_board.create(N, 1)
    try:
        shard = ParameterShard(0, 0, N, torch.randn(N), SGD, LR, workers=1)
        piece = board.piece(0, 0, N)
        shard.publish_on(piece)
        assert board.stamps.tolist() == [0, WRITING]
        assert torch.equal(board.halves[0], shard.parameters()[1])
        for step in range(3):
            _step(shard, step)
            half = (step + 1) % 2
            assert board.stamp(half) == step + 1 and board.stamp(1 - half) == step
            assert torch.equal(board.halves[half], shard.parameters()[1])
            assert shard.board_slot(step + 1) == (step + 1, half)
            assert shard.board_slot(step + 2) is None  # not published yet
            with shard.read(step + 1, 1.0) as (_, published):
                assert published is piece.halves[half]  # in-process readers read the board too
    finally:
        board.close()


def test_a_half_a_reader_holds_is_never_rewritten_and_its_version_goes_off_the_board() -> None:
    board = shm_board.create(N, 1)
    try:
        shard = ParameterShard(0, 0, N, torch.randn(N), SGD, LR, workers=1)
        shard.publish_on(board.piece(0, 0, N))
        _step(shard, 0)  # version 1 in half 1
        with shard.read_at(0, 1.0) as held:  # a reader holds version 0 (half 0)
            before = held.clone()
            _step(shard, 1)  # version 2 would go into half 0: held, so off the board
            assert torch.equal(board.halves[0], before) and board.stamps.tolist() == [0, 1]
            assert shard.board_slot(2) is None and shard.board_slot(1) == (1, 1)
        _step(shard, 2)  # version 3: into the older half (0), the board in use again
        assert board.stamps.tolist() == [3, 1]
        assert torch.equal(board.halves[0], shard.parameters()[1])
        _step(shard, 3)
        assert board.stamps.tolist() == [3, 4] and torch.equal(board.halves[1], shard.parameters()[1])
    finally:
        board.close()


def test_a_copy_counts_only_if_the_stamp_still_names_the_version() -> None:
    board = shm_board.create(N, 2)
    try:
        seen = shm_board.attach(board.path, N, 2, board.nonce)  # the worker's end: read-only
        piece = board.piece(1, 16, 8)
        piece.write(1, torch.arange(8.0), 5)
        dest = torch.zeros(8)
        assert seen.copy_out(3, 5, slice(16, 24), dest) and torch.equal(dest, torch.arange(8.0))
        assert not seen.copy_out(3, 4, slice(16, 24), dest)  # another version
        assert not seen.copy_out(2, 5, slice(16, 24), dest)  # the other half
        assert not seen.copy_out(9, 5, slice(16, 24), dest)  # no such slot
        piece.stamps[1] = WRITING
        assert not seen.copy_out(3, 5, slice(16, 24), dest)  # being written
        seen.close()
        with pytest.raises(ShmError):
            shm_board.attach(board.path, N, 2, b"x" * 16)  # not the nonce announced
        with pytest.raises(ShmError):
            shm_board.attach(board.path, N + 1, 2, board.nonce)  # not the size
        with pytest.raises(ShmError):
            shm_board.attach("/dev/shm/elsewhere", N, 2, board.nonce)
    finally:
        board.close()


def test_the_board_has_no_name_and_goes_with_the_shard() -> None:
    regions = SharedRegions(0, N, True, pieces=2)
    board = regions.board
    assert board is not None and board.path.startswith(f"/proc/{os.getpid()}/fd/")
    assert os.readlink(board.path).startswith("/memfd:pstrain-board")  # no file in /dev/shm
    regions.close()
    assert board._fd is None and board.halves[0].numel() == 0
    assert SharedRegions(0, N, False, pieces=2).board is None  # shared memory off: no board


def test_a_shard_keeps_publishing_after_its_regions_are_closed() -> None:
    """``ps_server.main`` closes shared memory before the server stops: the shard's published buffers are views
    of the board and must stay mapped until the last of them goes (closing the map under them would crash)."""
    reference = ParameterShard(0, 0, N, torch.ones(N), SGD, LR, workers=1)
    shard = ParameterShard(0, 0, N, torch.ones(N), SGD, LR, workers=1)
    regions = SharedRegions(0, N, True, pieces=1)
    assert regions.board is not None
    shard.publish_on(regions.board.piece(0, 0, N))
    regions.close()
    gc.collect()
    for step in range(3):
        _step(reference, step)
        _step(shard, step)  # writes into the board's halves
    assert torch.equal(shard.parameters()[1], reference.parameters()[1])
    assert shard.board_slot(3) == (3, 1)


def test_the_board_is_sealed_so_only_the_shard_can_write_it(tmp_path: Path) -> None:
    board = shm_board.create(N, 1)
    try:
        fd = os.open(board.path, os.O_RDWR)  # same uid, read-write: the seals still say no
        try:
            with pytest.raises(PermissionError):
                os.write(fd, b"x")
            with pytest.raises(PermissionError):
                mmap.mmap(fd, shm_board.board_bytes(N, 1))
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        board.piece(0, 0, N).write(0, torch.full((N,), 2.0), 7)  # the shard's own mapping predates the seal
        seen = shm_board.attach(board.path, N, 1, board.nonce)
        assert seen.stamp(0) == 7 and torch.equal(seen.halves[0], torch.full((N,), 2.0))
        seen.close()
    finally:
        board.close()
    unsealed = os.memfd_create("pstrain-board", os.MFD_CLOEXEC)  # right name and size, but writable by anyone
    plain = os.open(tmp_path / "board", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        for fd in (unsealed, plain):
            os.ftruncate(fd, shm_board.board_bytes(N, 1))
            with pytest.raises(ShmError):
                shm_board.attach(f"/proc/{os.getpid()}/fd/{fd}", N, 1, b"n" * 16)
    finally:
        os.close(unsealed)
        os.close(plain)


def test_a_copy_racing_the_writer_is_never_accepted_torn() -> None:
    """The seqlock under a real race: one thread keeps rewriting a half while another copies it out through the
    read-only mapping. Every copy that ``copy_out`` accepts must hold one version, whole."""
    numel = 1 << 18
    board = shm_board.create(numel, 1)
    seen = shm_board.attach(board.path, numel, 1, board.nonce)
    piece = board.piece(0, 0, numel)
    done = threading.Event()
    newest = [0]  # the newest version the reader accepted
    accepted_one = threading.Condition()

    def write() -> None:
        for version in range(1, 300):
            piece.write(0, torch.full((numel,), float(version)), version)
            if version % 25 == 0:  # now and then the reader gets a whole version (on a loaded host it may lose
                with accepted_one:  # every race): the test then checks copies that were accepted, not none
                    accepted_one.wait_for(lambda v=version: newest[0] >= v, timeout=10)
        done.set()

    writer = threading.Thread(target=write)
    accepted = 0
    dest = torch.empty(numel)
    writer.start()
    try:
        while not done.is_set():
            version = seen.stamp(0)
            if version == WRITING:
                continue
            if seen.copy_out(0, version, slice(0, numel), dest):
                accepted += 1
                assert dest.min().item() == dest.max().item() == float(version)
                with accepted_one:
                    newest[0] = version
                    accepted_one.notify_all()
    finally:
        writer.join(timeout=60)
        seen.close()
        board.close()
    assert accepted >= 299 // 25  # at least each version the writer waited for


def test_pulls_come_from_the_board_and_equal_streaming_bit_for_bit() -> None:
    results = {}
    for shared in (False, True):
        c = start_cluster()
        try:
            params, clients = train(c, shared)
            for client in clients:
                counts = client.shared.counts
                pulls = 3 * len(pieces_of(client.ranges[0])) * len(client.ranges)  # steps x pieces
                assert counts.board_pulls == (pulls if shared else 0) and counts.board_retries == 0
                client.close()
            results[shared] = params
        finally:
            c.stop()
    assert torch.equal(results[True], results[False])


def test_a_copy_the_stamp_refuses_is_pulled_again_through_the_pull_region(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = [2]
    real = Board.copy_out

    def refuse_twice(self: Board, slot: int, version: int, where: slice, dest: torch.Tensor) -> bool:
        if refusals[0] > 0:
            refusals[0] -= 1
            return False  # as if the half moved on under the copy
        return real(self, slot, version, where, dest)

    monkeypatch.setattr(Board, "copy_out", refuse_twice)
    params, clients = train(cluster, True, steps=2)
    streamed = start_cluster()
    try:
        expected, others = train(streamed, False, steps=2)
        for other in others:
            other.close()
    finally:
        streamed.stop()
    assert torch.equal(params, expected)
    assert sum(c.shared.counts.board_retries for c in clients) == 2
    for client in clients:
        client.close()


def test_a_client_that_cannot_map_the_board_gets_its_pulls_copied(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot(*args: object) -> Board:
        raise ShmError("another pid namespace")

    monkeypatch.setattr(shm_board, "attach", cannot)
    _, clients = train(cluster, True, steps=2)
    for client in clients:
        assert client.shared.active == [0, 1] and client.shared.counts.board_pulls == 0
        assert client.shared.counts.shared_bytes == 2 * 2 * TOTAL * 4  # still shared memory both ways
        client.close()


def test_a_board_pull_of_a_whole_shard_or_without_the_flag_is_copied(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    reply = stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)
    assert reply.board_path and reply.board_pieces == len(cluster.shards[0].pieces)
    piece = cluster.shards[0].pieces[1]
    base = pb.PullRequest(shard_id=0, min_version=0, shm_worker=0, shm_nonce=reply.nonce)
    named = pb.PullRequest(board=True, piece_start=piece.start)
    named.MergeFrom(base)
    assert stub.PullShared(named, timeout=10).board_slot == 2  # piece 1, half 0
    plain = pb.PullRequest(piece_start=piece.start)
    plain.MergeFrom(base)
    assert not stub.PullShared(plain, timeout=10).HasField("board_slot")
    whole = pb.PullRequest(board=True)
    whole.MergeFrom(base)
    assert not stub.PullShared(whole, timeout=10).HasField("board_slot")
    stub.CloseSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=10)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("pieces", [1, 3], ids=["whole-shards", "pieces"])
def test_a_lone_worker_is_read_in_place_and_pulls_off_the_board(
    pieces: int, devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker: every push is the step's only contribution, so the shard's update reads it where it lies in the
    worker's push region (``lent``; with two devices the fused step's division lands there), through ``Push`` for a
    whole shard and ``PushShared`` for a piece. Each pull is copied straight out of the board: a piece's, and a whole
    shard's where the shard is one piece (the layout of ``bench/pushpull.py``). The results equal streaming's bit for
    bit."""
    lone: list[bool] = []
    real = ParameterShard._lone_contribution

    def seen(self: ParameterShard, grad: torch.Tensor) -> bool:
        lone.append(real(self, grad))
        return lone[-1]

    monkeypatch.setattr(ParameterShard, "_lone_contribution", seen)
    results = {}
    for shared in (False, True):
        lone.clear()
        servers: list[tuple[ServingServer, ParameterServerServicer]] = []
        shards: list[PiecedShard] = []
        every: list[ShardRange] = []  # every shard's pieces
        client = None
        try:
            for r in shard_ranges(TOTAL, 2):
                servicer = ParameterServerServicer()
                server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
                servers.append((server, servicer))
                cuts = [r.start + r.numel * i // pieces for i in range(pieces)] + [r.end]
                own = [ShardRange(r.shard_id, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
                every += own
                shard = PiecedShard.build(own, torch.arange(r.numel) / r.numel, SGD, LR, 1)
                servicer.attach(shard, 64)
                shards.append(shard)
            addresses = [f"127.0.0.1:{server.port}" for server, _ in servers]
            client = PsClient(addresses, TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10,
                              shared_memory=shared)  # fmt: skip
            params = torch.empty(TOTAL)
            for step in range(3):
                grad = torch.randn(TOTAL, generator=torch.Generator().manual_seed(step))
                if pieces == 1:
                    client.push(grad, 0, step, devices).wait()
                    assert client.pull(step + 1, params) == step + 1
                else:
                    pushed, pulled = client.push_pull_pieces(grad, every[::-1], 0, step, devices, params)
                    pushed.wait()
                    assert pulled.wait() == step + 1
            counts = client.shared.counts
            moves = 3 * 2 * pieces  # steps x shards x pieces
            assert lone == ([True] * moves if shared else [])  # streamed pushes are received into the shard's buffer
            assert counts.board_pulls == (moves if shared else 0) and counts.board_retries == 0
            assert counts.streamed_bytes == (0 if shared else 3 * 2 * TOTAL * 4)
            results[shared] = params
        finally:
            if client is not None:
                client.close()
            for shard in shards:
                shard.close()
            for server, servicer in servers:
                server.stop(0)
                servicer.close_shared_memory()
    assert torch.equal(results[True], results[False])


def _train_pushing_and_pulling(
    cluster: Cluster, shared: bool, orders: tuple[int, int] = (-1, -1)
) -> tuple[torch.Tensor, list[PsClient]]:
    """``train`` as the trainer calls: each worker pushes its pieces and pulls them back (``push_pull_pieces``), in
    the piece order ``orders[w]`` (1: forward, -1: backward)."""
    clients = [cluster.client(w, shared) for w in range(WORKERS)]
    try:
        pieces = [p for r in clients[0].ranges for p in pieces_of(r)]
        out = [torch.empty(TOTAL) for _ in clients]
        for step in range(3):
            calls = []
            for w, client in enumerate(clients):
                grad = torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * step + w))
                calls.append(client.push_pull_pieces(grad, pieces[:: orders[w]], w, step, 1, out[w]))
            assert [pulled.wait() for _, pulled in calls] == [step + 1] * WORKERS
            acks = [pushed.wait()[:: orders[w]] for w, (pushed, _) in enumerate(calls)]  # in piece order
            for i in range(len(pieces)):  # each piece: exactly one worker's push completed the step
                assert sum(worker[i].completed for worker in acks) == 1
        assert torch.equal(out[0], out[1])
    except BaseException:
        for client in clients:
            client.close(cancel=True)
        raise
    return out[0], clients


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16-push"])
def test_a_colocated_push_and_its_pull_are_one_call_equal_to_streaming(bf16: bool) -> None:
    results = {}
    for shared in (False, True):
        c = start_cluster(bf16=bf16)
        try:
            params, clients = _train_pushing_and_pulling(c, shared)
            for client in clients:
                counts = client.shared.counts
                pieces = len(pieces_of(client.ranges[0])) * len(client.ranges)
                assert counts.push_pulls == (3 * pieces if shared else 0)
                assert counts.board_pulls == (3 * pieces if shared else 0)
                # A client thread waits through each call once the regions are known (steps 1 and 2 at least)
                assert (
                    (2 * pieces <= counts.waited_push_pulls <= 3 * pieces) if shared else counts.waited_push_pulls == 0
                )
                client.close()
            results[shared] = params
        finally:
            c.stop()
    assert torch.equal(results[True], results[False])
    streamed = start_cluster(bf16=bf16)
    try:
        expected, others = train(streamed, False)  # push_pieces, then pull_pieces: the same numbers
        for other in others:
            other.close()
    finally:
        streamed.stop()
    assert torch.equal(results[True], expected)


def test_pull_after_is_refused_on_a_push_stream_and_changes_nothing(cluster: Cluster) -> None:
    stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
    piece = cluster.shards[0].pieces[0]
    header = pb.PushHeader(
        shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=piece.numel,
        piece_start=piece.start, skip=True, pull_after=True,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as refused:
        stub.Push(iter([pb.PushRequest(header=header)]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pull_after" in refused.value.details()
    assert {p.version for p in cluster.shards[0].pieces} == {0} and cluster.shards[0].last_step_of(0) == -1


def test_combined_calls_beyond_the_waiting_threads_wait_for_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PIECE_WAITS calls a client thread waits through, a combined call waits for the other workers on the
    shard, not in a client thread: with one waiting thread and a pull pool of one, two workers that push their
    pieces in opposite orders still complete every step."""
    monkeypatch.setattr(ps_client, "PIECE_PULLS", 1)
    monkeypatch.setattr(ps_client, "PIECE_WAITS", 1)
    c = start_cluster()
    try:
        _, clients = _train_pushing_and_pulling(c, True, orders=(1, -1))
        for client in clients:
            counts = client.shared.counts
            assert counts.push_pulls == 3 * len(pieces_of(client.ranges[0])) * len(client.ranges)
            assert counts.waited_push_pulls < counts.push_pulls  # each step's pieces are in flight at once
            client.close()
    finally:
        c.stop()


def test_a_shard_that_ignores_pull_after_is_pulled_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that predates ``pull_after`` takes the push and answers without ``pulled``: the client pulls."""
    real = ParameterServerServicer.PushShared

    async def predates(self: ParameterServerServicer, h: pb.PushHeader, context: object) -> pb.PushReply:
        h.pull_after = False
        return await real(self, h, context)

    monkeypatch.setattr(ParameterServerServicer, "PushShared", predates)
    c = start_cluster()
    try:
        params, clients = _train_pushing_and_pulling(c, True)
        for client in clients:
            counts = client.shared.counts
            assert counts.push_pulls == 0 and counts.board_pulls == 3 * len(pieces_of(client.ranges[0])) * 2
            client.close()
    finally:
        c.stop()
    streamed = start_cluster()
    try:
        expected, others = train(streamed, False)
        for other in others:
            other.close()
    finally:
        streamed.stop()
    assert torch.equal(params, expected)


def test_closing_the_client_ends_a_waiting_combined_call_with_cancelled(cluster: Cluster) -> None:
    client = cluster.client(0)
    pieces = [p for r in client.ranges for p in pieces_of(r)]
    pushed, pulled = client.push_pull_pieces(torch.ones(TOTAL), pieces, 0, 0, 1, torch.empty(TOTAL))
    # Worker 1 never pushes: every call waits on its shard once the push is taken.
    taken = lambda: all(p.snapshot().pushes_waiting == 1 for s in cluster.shards for p in s.pieces)  # noqa: E731
    wait_for(taken, 10, "worker 0's pushes")
    client.close(cancel=True)
    with pytest.raises(Cancelled):
        pulled.wait()
    with pytest.raises(Cancelled):
        pushed.wait()
    assert {p.version for s in cluster.shards for p in s.pieces} == {0}
