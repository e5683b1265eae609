"""Review of the colocated shared-memory path (issue 12) against real shard processes killed with SIGKILL.

A shard runs in its own process here, as in a job, so that SIGKILL skips every clean-up it has (``close``, the
atexit hook): whatever is left in ``/dev/shm`` then stays there until the host reboots.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime import shm_client, shm_region
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.transport import open_channel

TOTAL = 1000

# One shard of one worker on 127.0.0.1: prints its address, serves until stdin closes.
_SHARD = textwrap.dedent(
    """
    import sys, torch
    from pstrain.protos import pstrain_pb2 as pb
    from pstrain.ps_server.pieces import PiecedShard
    from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
    from pstrain.runtime.shard_map import ShardRange
    from pstrain.runtime.transport import start_server

    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    total = int(sys.argv[1])
    pieces = [ShardRange(0, 0, total // 2), ShardRange(0, total // 2, total)]
    shard = PiecedShard.build(pieces, torch.zeros(total), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=0.1), 1)
    servicer.attach(shard, 64)
    server.set_serving(True)
    print(f"127.0.0.1:{server.port}", flush=True)
    sys.stdin.read()
    """
)


class ShardProcess:
    """A shard in a process of its own (``sys.executable``), so that it can be killed for real."""

    def __init__(self, total: int = TOTAL) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SHARD, str(total)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()  # blocks until the server serves (or the process died)
        assert self.address, f"the shard process exited with {self.proc.wait()}"

    def regions(self) -> set[str]:
        """Its region files in /dev/shm (named after its pid)."""
        return set(glob.glob(f"{shm_region.SHM_DIR}/{shm_region.PREFIX}{self.proc.pid}-*"))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Kill it if it still runs, and remove what it left behind (a failed test must not fill /dev/shm)."""
        if self.proc.poll() is None:
            self.kill()
        for path in self.regions():
            os.unlink(path)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def shard() -> Iterator[ShardProcess]:
    proc = ShardProcess()
    yield proc
    proc.stop()


def test_a_shard_killed_before_its_regions_are_first_used_leaves_nothing_in_dev_shm(shard: ShardProcess) -> None:
    """The client unlinks the names as soon as it has mapped both regions: from then on nothing depends on a clean
    exit. (Before, the names went only with the first push or pull the shard read, so a shard SIGKILLed after
    granting the regions, or one whose worker died or was refused before its first push, left two files of the
    shard's size in /dev/shm for good.)"""
    client = PsClient([shard.address], TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10)
    try:
        assert client.shared.for_push(ShardRange(0, 0, TOTAL // 2), 0) is not None  # negotiated and mapped
        assert client.shared.active == [0]
        assert shard.regions() == set()  # mapped: no name is needed any more
        shard.kill()
        assert shard.regions() == set()
    finally:
        client.close(cancel=True)


def test_regions_still_work_after_the_client_dropped_their_names(shard: ShardProcess) -> None:
    """The mappings, not the names, carry the bytes: pushes and pulls through them give the streamed result."""
    pieces = [ShardRange(0, 0, TOTAL // 2), ShardRange(0, TOTAL // 2, TOTAL)]
    client = PsClient([shard.address], TOTAL, chunk_bytes=64, push_timeout_s=10, pull_timeout_s=10)
    try:
        client.push_pieces(torch.ones(TOTAL), pieces, 0, 0, 1).wait()
        out = torch.empty(TOTAL)
        client.pull_pieces(1, out, pieces).wait()
        assert torch.equal(out, torch.full((TOTAL,), -0.1))  # sgd, lr 0.1, from zeros
        assert client.shared.counts.shared_bytes > 0 and client.shared.counts.streamed_bytes == 0
        assert shard.regions() == set()
    finally:
        client.close()


def test_the_open_waits_as_long_as_the_shard_needs_to_reserve_big_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard reserves every page of both regions before it answers (about a second per GiB of shard here): a
    fixed 10 s deadline made every colocated worker of a shard of some GiB give up, stream for the whole job, and
    leave the shard holding the pair it went on to make. The deadline now grows with the shard's size; the fixed
    part is cut to 20 ms here so that a shard of 100 MB (200 MB of regions) needs more than it."""
    monkeypatch.setattr(shm_client, "OPEN_TIMEOUT_S", 0.02)
    total = 25_000_000
    big = ShardProcess(total)
    client = PsClient([big.address], total, chunk_bytes=1 << 20, push_timeout_s=10, pull_timeout_s=10)
    try:
        assert client.shared.for_push(ShardRange(0, 0, total // 2), 0) is not None
        assert client.shared.active == [0]
    finally:
        client.close(cancel=True)
        big.stop()
    assert shm_client.open_timeout_s(10 * 2**30 // 4) > 120  # a 10 GiB shard: 20 GiB of pages to reserve


def test_regions_are_refused_for_a_worker_id_outside_the_job_and_nothing_is_made() -> None:
    """Without per-worker credentials (insecure or token-only) any worker id passed the check, and each open made a
    pair of regions the shard's size: 50 opens for ids 1000-1049 held 100 files in /dev/shm for the shard's life."""
    from tests.test_shm_path import ours, start_cluster

    cluster = start_cluster()
    try:
        before = ours()
        stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
        for worker_id in (2, 1000):  # the job has workers 0 and 1
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=worker_id), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "workers 0..1" in info.value.details()
        assert ours() == before
        stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=1), timeout=10)
        assert len(ours() - before) == 2
    finally:
        cluster.stop()


def test_an_open_the_worker_gave_up_on_leaves_no_regions_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard went on making the pair after the worker's deadline; the worker streamed, and the pair stayed
    named in /dev/shm for the shard's life (SIGKILL included). Now the shard drops it once it is made."""
    from tests.helpers import wait_for
    from tests.test_shm_path import ours, start_cluster

    create = shm_region.create
    made = []

    def slow_create(numel: int, nonce: bytes) -> shm_region.Region:
        time.sleep(0.6)
        made.append(numel)
        return create(numel, nonce)

    cluster = start_cluster()
    try:
        before = ours()
        monkeypatch.setattr(shm_region, "create", slow_create)
        stub = pb_grpc.ParameterServerStub(open_channel(cluster.addresses[0]))
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenSharedMemory(pb.ShmRequest(shard_id=0, worker_id=0), timeout=0.2)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: len(made) == 2, 10, "the shard to finish making the pair")
        wait_for(lambda: ours() == before, 10, "the abandoned pair to be dropped")
        assert not cluster.servicers[0].regions.paths
    finally:
        cluster.stop()
