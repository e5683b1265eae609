"""Cheap refusals and job-file pull limits (issue 8), against real objects and real gRPC servers on 127.0.0.1.

A refusal must cost the service as little as possible, since a flood of them shares the host with training:
a forged push is refused before the shard's lock (so even while an update holds it), a forged step report
before the job's lock, and GetJobStatus under load answers from one build per short period. The waiting-pull
limits are job-file keys that reach the shard and are named in its refusal.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch

from pstrain.coordinator.config import ConfigError, parse_config
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.coordinator.service import StatusCache
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.admission import ShardGate, pull_limits
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.admission import PullLimits
from pstrain.runtime.identity import HEADER, Credential, MemberKeys
from pstrain.runtime.transport import open_channel, start_server
from tests import test_identity
from tests.test_identity import meta, raw_push, step_report
from tests.test_job import RAW, make_job, report, start

DEADLINE_S = 30.0
guarded_shard = test_identity.guarded_shard  # the fixtures of the identity tests: a keyed shard, a coordinator
guarded_coordinator = test_identity.guarded_coordinator
PROMPT_S = 5.0  # a refusal that waited for a held lock would run into this deadline instead


# ------------------------------------------------------------------ pull limits as job-file keys


def test_pull_limits_are_job_file_keys_that_reach_the_shards_spec() -> None:
    cfg = parse_config({**RAW, "transport": {"max_waiting_pulls": 8, "max_waiting_pulls_per_peer": 2}})
    spec = job_spec(cfg, make_plan(cfg), ModelState(cfg).layout, "limits")
    assert (spec.max_waiting_pulls, spec.max_waiting_pulls_per_peer) == (8, 2)
    assert pull_limits(spec) == PullLimits(per_shard=8, per_peer=2, max_wait_s=cfg.transport.pull_timeout_s)
    default = parse_config(RAW).transport
    assert (default.max_waiting_pulls, default.max_waiting_pulls_per_peer) == (PullLimits().per_shard, 256)
    assert pull_limits(pb.JobSpec()) == PullLimits()  # a spec without them (an older coordinator): the defaults


@pytest.mark.parametrize(
    ("transport", "message"),
    [
        ({"max_waiting_pulls": 0}, "transport.max_waiting_pulls: must be at least 1, got 0"),
        ({"max_waiting_pulls": 2**21}, "transport.max_waiting_pulls: must be at most 1048576"),
        (
            {"max_waiting_pulls": 8, "max_waiting_pulls_per_peer": 9},
            "transport.max_waiting_pulls_per_peer: must be in [1, transport.max_waiting_pulls = 8], got 9",
        ),
        ({"max_waiting_pulls_per_peer": 0}, "transport.max_waiting_pulls_per_peer: must be in [1,"),
        (
            {"max_waiting_pulls": 1, "max_waiting_pulls_per_peer": 1},
            "transport.max_waiting_pulls: must be at least cluster.workers (2), got 1",
        ),
        ({"max_waiting_pulls": 2.5}, "transport.max_waiting_pulls"),
    ],
)
def test_bad_pull_limits_are_refused_naming_the_key(transport, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**RAW, "transport": transport})


@pytest.fixture
def shard_with_job_limits():
    """A real shard whose gate is built from a JobSpec as ``pstrain-ps`` builds it (``pull_limits``)."""
    keys = MemberKeys.generate()
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    shard = ParameterShard(0, 0, 4, torch.zeros(4), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1.0), 2)
    servicer.attach(shard, 1024)
    spec = pb.JobSpec(max_waiting_pulls=3, max_waiting_pulls_per_peer=2, pull_timeout_s=DEADLINE_S)
    servicer.gate = ShardGate(keys, 1, pull_limits(spec))
    server.set_serving(True)
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield keys, servicer, pb_grpc.ParameterServerStub(channel)
    channel.close()
    shard.close()
    server.stop(0)


def test_a_shard_refuses_the_pull_past_the_job_files_limits_naming_limit_and_key(shard_with_job_limits) -> None:  # type: ignore[no-untyped-def]
    keys, servicer, stub = shard_with_job_limits
    far = pb.PullRequest(shard_id=0, min_version=10**9)

    def as_worker(worker: int) -> list[tuple[str, str]]:
        return [(HEADER, keys.mint("worker", worker).encode())]

    held = [stub.Pull(far, metadata=as_worker(0), timeout=DEADLINE_S) for _ in range(2)]
    assert servicer.wait_until_pulls_waiting(2, DEADLINE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(far, metadata=as_worker(0), timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 2 per peer, transport.max_waiting_pulls_per_peer" in err.value.details()
    held.append(stub.Pull(far, metadata=as_worker(1), timeout=DEADLINE_S))
    assert servicer.wait_until_pulls_waiting(3, DEADLINE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(far, metadata=as_worker(2), timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 3, transport.max_waiting_pulls)" in err.value.details()
    for call in held:
        call.cancel()


# ------------------------------------------------------------------ refusal comes first, and costs no lock


def test_a_forged_push_is_refused_before_the_shard_is_asked_even_while_an_update_holds_it(guarded_shard) -> None:  # type: ignore[no-untyped-def]
    keys, shard, stub = guarded_shard
    wrong_step = pb.PushHeader(shard_id=0, worker_id=0, step=7, device_count=1, dtype=pb.FLOAT32, numel=3)
    malformed = [pb.PushRequest(header=wrong_step)]  # a step conflict and a wrong size, were the shard asked
    made_up = meta(Credential("worker", 0, 0, "00" * 32))
    with shard._cond:  # held as an update holds it: a refusal that needed the shard would wait for it
        for metadata in (None, made_up, meta(keys.mint("worker", 1))):
            with pytest.raises(grpc.RpcError) as err:
                stub.Push(iter(malformed), metadata=metadata, timeout=PROMPT_S)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                raw_push(stub, torch.full((6,), float("nan")), 0, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert shard.version == 0 and shard.snapshot().pushes_waiting == 0
    with shard.read(0, DEADLINE_S) as (version, published):
        assert version == 0 and torch.equal(published, torch.zeros(6))
    # The worker itself, with a malformed push, still learns what is wrong with it.
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter(malformed), metadata=meta(keys.mint("worker", 0)), timeout=PROMPT_S)
    assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


def test_a_forged_step_report_is_refused_without_the_jobs_lock(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, _, workers = guarded_coordinator
    with job._cond:  # the job's lock, held as a long step report or the journal would hold it
        for metadata in (None, meta(workers[1]), meta(Credential("worker", 0, 0, "00" * 32))):
            for call, request in (
                (stub.ReportStep, step_report(0, loss=float("nan"), samples=-2000)),
                (stub.RequestDataShard, pb.DataShardRequest(worker_id=0)),
                (stub.Heartbeat, pb.HeartbeatRequest(role="worker", id=0)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=metadata, timeout=PROMPT_S)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert job.records == [] and job.ledger.completed == 0


# ------------------------------------------------------------------ GetJobStatus under load


def test_job_status_is_built_once_per_fresh_period_and_again_when_the_job_moves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job, _, _, _ = make_job(tmp_path)
    start(job)
    now = [0.0]
    cache = StatusCache(job, fresh_s=0.2, clock=lambda: now[0])
    first = cache.get()
    assert first.state == pb.RUNNING and first.step == 0 and len(first.members) == 5
    now[0] += 0.1
    assert cache.get() is first  # a poller within the period gets the same build
    for worker in range(2):
        job.report_step(report(worker, 0))
    moved = cache.get()  # the step moved: built afresh at once
    assert moved is not first and moved.step == 1
    now[0] += 0.25
    again = cache.get()
    assert again is not moved and again.step == 1  # the period passed: built afresh
    job.close()


def test_get_job_status_answers_from_the_cache_over_grpc(guarded_coordinator) -> None:  # type: ignore[no-untyped-def]
    job, stub, _, _ = guarded_coordinator
    statuses = [stub.GetJobStatus(pb.JobStatusRequest(), timeout=DEADLINE_S) for _ in range(50)]
    assert {s.state for s in statuses} == {job.status().state} and all(len(s.members) == 5 for s in statuses)
