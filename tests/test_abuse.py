"""Bounded resources (issue 8): waiting pulls are limited per shard and per peer, sizes are checked before
allocation, and a live job keeps training while it is flooded from 127.0.0.1."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import uuid

import grpc
import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import CodecError, decode_named_tensors, encode_chunks
from pstrain.runtime.admission import Overloaded, PullAdmission, PullLimits, checked_tensor_stream
from pstrain.runtime.identity import HEADER, MemberKeys
from pstrain.runtime.transport import open_channel
from tests.helpers import REPO_ROOT, guarded_shard, pids_with_marker

NUMEL = 4
DEADLINE_S = 30.0


def test_pull_admission_holds_per_peer_and_per_shard_limits():
    admission = PullAdmission(PullLimits(per_shard=3, per_peer=2, max_wait_s=5.0))
    with admission.admit("a", None) as wait_a, admission.admit("a", 60.0):
        assert wait_a == 5.0  # no client deadline: the server's
        with pytest.raises(Overloaded, match="a already has 2 pulls waiting"), admission.admit("a", 1.0):
            pass
        with admission.admit("b", 1.0) as wait_b:
            assert wait_b == 1.0  # the client's, when shorter
            with pytest.raises(Overloaded, match="3 pulls already wait on this shard"), admission.admit("c", 1.0):
                pass
    assert admission.waiting == 0
    with admission.admit("a", None), admission.admit("a", None):  # places are given back
        pass


def test_announced_tensors_are_checked_before_allocation():
    expected = {"w": (pb.FLOAT32, (2, 3))}
    good = list(encode_chunks(torch.ones(2, 3), 8, name="w"))
    assert torch.equal(decode_named_tensors(checked_tensor_stream(iter(good), expected))["w"], torch.ones(2, 3))
    huge = pb.TensorChunk(name="w", dtype=pb.FLOAT32, shape=[2**40], data=b"\0" * 8)
    with pytest.raises(CodecError, match=r"announced as FLOAT32 \(1099511627776,\); expected FLOAT32 \(2, 3\)"):
        decode_named_tensors(checked_tensor_stream(iter([huge]), expected))
    with pytest.raises(CodecError, match="no tensor named 'x'"):
        decode_named_tensors(checked_tensor_stream(iter([pb.TensorChunk(name="x", shape=[1])]), expected))
    with pytest.raises(Overloaded, match="more than the 24 bytes"):
        flood = pb.TensorChunk(name="w", dtype=pb.FLOAT32, shape=[2, 3], data=b"\0" * 25)
        decode_named_tensors(checked_tensor_stream(iter([flood]), expected))


@pytest.fixture
def limited_shard():
    with guarded_shard(NUMEL, 2, PullLimits(per_shard=5, per_peer=3, max_wait_s=1.0)) as guarded:
        channel = open_channel(guarded.address)
        yield guarded.keys, guarded.servicer, guarded.shard, pb_grpc.ParameterServerStub(channel)
        channel.close()


def as_worker(keys: MemberKeys, worker: int) -> list[tuple[str, str]]:
    return [(HEADER, keys.mint("worker", worker).encode())]


def push(stub, keys, worker: int, value: float):  # type: ignore[no-untyped-def]
    header = pb.PushHeader(shard_id=0, worker_id=worker, step=0, device_count=1, dtype=pb.FLOAT32, numel=NUMEL)
    requests = [
        pb.PushRequest(header=header),
        *(pb.PushRequest(chunk=c) for c in encode_chunks(torch.full((4,), value))),
    ]
    return stub.Push(iter(requests), metadata=as_worker(keys, worker), timeout=DEADLINE_S)


def test_a_pull_flood_from_one_peer_is_held_to_its_limit_and_others_train_on(limited_shard):
    keys, servicer, shard, stub = limited_shard
    flood = [
        stub.Pull(pb.PullRequest(shard_id=0, min_version=1), metadata=as_worker(keys, 1), timeout=DEADLINE_S)
        for _ in range(3)
    ]
    assert servicer.wait_until_pulls_waiting(3, DEADLINE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(pb.PullRequest(shard_id=0, min_version=1), metadata=as_worker(keys, 1), timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 3 per peer" in err.value.details()
    honest = stub.Pull(pb.PullRequest(shard_id=0, min_version=1), metadata=as_worker(keys, 0), timeout=DEADLINE_S)
    assert servicer.wait_until_pulls_waiting(4, DEADLINE_S)
    assert not push(stub, keys, 0, 1.0).completed  # pushes go on while the flood waits
    assert push(stub, keys, 1, 3.0).completed and shard.version == 1
    for call in [*flood, honest]:
        data = b"".join(r.chunk.data for r in call)
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), torch.full((NUMEL,), -2.0))


def test_waiting_pulls_have_a_server_side_deadline_and_a_shard_limit(limited_shard):
    keys, servicer, _, stub = limited_shard
    far = pb.PullRequest(shard_id=0, min_version=10**9)
    with pytest.raises(grpc.RpcError) as err:  # no client deadline: the server's 1 s applies
        list(stub.Pull(far, metadata=as_worker(keys, 0)))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    held = [stub.Pull(far, metadata=as_worker(keys, peer), timeout=DEADLINE_S) for peer in (0, 0, 1, 1, 2)]
    assert servicer.wait_until_pulls_waiting(5, DEADLINE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(far, metadata=as_worker(keys, 3), timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 5" in err.value.details()
    for call in held:
        call.cancel()


def test_a_live_job_keeps_training_under_bounded_floods(tmp_path):
    """Forged pushes (from gRPC's client and as raw HTTP/2) and a pull flood at 200 calls/s and 100 status calls/s
    each leave training at >= 30% of its speed (30%, not the benchmark's 80% target: this machine's 2 cores also run
    the attacker and other tests)."""
    from bench.abuse import forged_pushes, pull_flood, run_attack, start_cluster, status_load
    from tests.helpers import stop_local

    cluster = start_cluster(tmp_path)
    try:
        for name, attack in (
            ("push", forged_pushes(200.0)),
            ("raw push", forged_pushes(200.0, "raw")),
            ("pull", pull_flood(200.0)),
            ("status", status_load(100.0)),
        ):
            outcome, before, during = run_attack(cluster, name, attack, 3.0)
            assert outcome.calls > 0 and "OK" not in outcome.codes or name == "status", outcome
            if name == "raw push":
                assert "raw HTTP/2" in outcome.note and outcome.calls > sum(outcome.codes.values()), outcome
            if name.endswith("push"):  # the raw flood's codes: the calls sent through gRPC's client beside it
                assert outcome.codes and set(outcome.codes) <= {"PERMISSION_DENIED", "FAILED_PRECONDITION"}, (
                    outcome.codes
                )
            if name == "pull":
                assert set(outcome.codes) == {"PERMISSION_DENIED"}, outcome.codes
            assert during >= 0.3 * before and during > 0, (name, before, during)
        assert cluster.proc.poll() is None
    finally:
        stop_local(cluster.proc, cluster.marker)
    model = torch.load(cluster.out / "model.pt") if (cluster.out / "model.pt").exists() else None
    assert model is None or all(math.isfinite(float(t.sum())) for t in model.values())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for the job, one for the attacker")
def test_the_benchmark_keeps_the_job_and_the_attacker_on_their_own_cpus(tmp_path):
    """``bench/abuse.py --job-cpus A --attacker-cpus B``: every process of the job runs on A, and every thread of the
    attacker's process on B, gRPC's own threads included (they carry the gRPC client's I/O)."""
    from bench.abuse import format_cpus, parse_cpus

    assert parse_cpus("0") == {0} and format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("", "x", "1-0", "0-", "99999"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    job, attacker = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "abuse.md"
    cmd = [sys.executable, "bench/abuse.py", "--phase-s", "0.5", "--rates", "50", "--clients", "raw"]
    cmd += ["--only", "GetJobStatus", "--job-cpus", str(job), "--attacker-cpus", str(attacker), "--out", str(out)]
    # The bench gives its job a marker of its own; this one, inherited by the bench and everything it starts,
    # finds whatever a killed bench would leave behind.
    marker = uuid.uuid4().hex
    env = {**os.environ, "PSTRAIN_BENCH_RUN": marker}
    try:
        result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        left = pids_with_marker(marker, "PSTRAIN_BENCH_RUN")  # the bench stops its job before it exits
    finally:
        for pid in pids_with_marker(marker, "PSTRAIN_BENCH_RUN"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not left, left
    text = out.read_text()
    assert f"CPUs of the job's processes: {job}; of the attacker's threads at the end: {attacker}." in text, text
    assert "| GetJobStatus at 50/s, raw HTTP/2 | OK" in text
