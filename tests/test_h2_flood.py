"""The abuse benchmark's raw HTTP/2 client (bench/h2_flood.py) makes real gRPC calls: a real shard's handlers
answer every one of them (the refusal counter moves by as many), and a real one is served like gRPC's own."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from bench.h2_flood import H2Flood, RawCall, header_block
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import encode_chunks
from pstrain.runtime.admission import PullLimits
from pstrain.runtime.identity import HEADER
from pstrain.runtime.metrics import REJECTED
from tests.helpers import guarded_shard, wait_for

NUMEL = 5000  # a push of 20 KB: more than one DATA frame
SERVICE = "/" + pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name


@pytest.fixture
def shard_address():
    with guarded_shard(NUMEL, 1, PullLimits(per_shard=5, per_peer=3, max_wait_s=1.0)) as guarded:
        yield guarded.address, guarded.keys, guarded.shard


def raw_push(value: float, metadata: tuple[tuple[str, str], ...] = ()) -> RawCall:
    """Worker 0's push for step 0 of the whole shard, ``value`` everywhere."""
    header = pb.PushHeader(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=NUMEL)
    chunks = (pb.PushRequest(chunk=c).SerializeToString() for c in encode_chunks(torch.full((NUMEL,), value)))
    return RawCall(f"{SERVICE}/Push", (pb.PushRequest(header=header).SerializeToString(), *chunks), metadata)


def flood(address: str, calls: list[RawCall], rate: float, count: int) -> tuple[H2Flood, int]:
    """Runs the flood until ``count`` calls are answered (or a deadline); returns it and how many it sent."""
    stop = threading.Event()
    raw = H2Flood([address])
    turn = iter(range(10**9))
    thread = threading.Thread(target=raw.run, args=(rate, stop, lambda: (0, calls[next(turn) % len(calls)])))
    thread.start()
    try:
        wait_for(lambda: raw.stats.answered >= count, 30, f"{count} raw calls answered")
    finally:
        stop.set()
        thread.join(30)
        raw.close()
    return raw, raw.stats.sent


def test_the_shard_answers_every_raw_call_and_counts_each_refusal(shard_address):
    address, _, shard = shard_address
    push = raw_push(7.0)
    far = pb.PullRequest(shard_id=0, min_version=10**9)
    pull = RawCall(f"{SERVICE}/Pull", (far.SerializeToString(),))
    forged = raw_push(7.0, ((HEADER, "worker:0:0:" + "ab" * 32),))
    denied = REJECTED.labels("PERMISSION_DENIED")
    before = denied._value.get()
    raw, sent = flood(address, [push, pull, forged], 500.0, 300)
    stats = raw.stats
    assert stats.answered >= 300 and not stats.closed and stats.reset == 0, stats
    wait_for(lambda: denied._value.get() - before >= stats.answered, 10, "every answered call counted as refused")
    assert denied._value.get() - before <= sent  # no call counted twice, none from elsewhere
    assert shard.version == 0 and torch.equal(shard.parameters()[1], torch.zeros(NUMEL))  # nothing was applied


def test_a_raw_call_with_the_credential_is_served(shard_address):
    address, keys, shard = shard_address
    raw, _ = flood(address, [raw_push(2.0, ((HEADER, keys.mint("worker", 0).encode()),))], 50.0, 1)
    assert raw.stats.reset == 0 and not raw.stats.closed
    wait_for(lambda: shard.version == 1, 10, "the pushed step applied")
    assert torch.allclose(shard.parameters()[1], torch.full((NUMEL,), -2.0))  # sgd, lr 1, one device: 0 - 2


def test_a_flood_ends_when_the_server_closes_the_connection():
    """A peer that hangs up ends the flood with its figures (a closed socket stays readable: no spinning on it)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        raw = H2Flood([f"127.0.0.1:{listener.getsockname()[1]}"])
        accepted, _ = listener.accept()
        accepted.close()
        stop = threading.Event()
        thread = threading.Thread(target=raw.run, args=(100.0, stop, lambda: (0, RawCall("/a/B", (b"",)))))
        thread.start()
        thread.join(10)
        stop.set()
        alive = thread.is_alive()
        thread.join(10)
        raw.close()
    assert not alive and raw.stats.closed


def test_header_blocks_use_literals_only():
    """Literals without indexing: the same bytes decode alike on every stream, whatever came before."""
    block = header_block("h:1", RawCall("/a/B", (), (("k", "v" * 200),)))
    assert block.startswith(b"\x83\x86\x04\x04/a/B\x01\x03h:1\x0f\x10\x10application/grpc\x00\x02te\x08trailers")
    assert block.endswith(b"\x00\x01k\x7f\x49" + b"v" * 200)  # a length of 200 takes a second byte
