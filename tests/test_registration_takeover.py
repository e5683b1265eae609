"""A registration naming a live member's address is not that member's restart (the 2026-11-27 review).

Anyone holding the job's bearer token can call ``RegisterParameterServer`` or ``RegisterWorker`` with any
address. Taken as the restart of the live member there, one call failed or rolled back a running job, or took
a worker's slot and a genuine credential for it. Now a registration takes a live holder's slot only with that
holder's current credential (its own process registering again); without it the coordinator answers
UNAVAILABLE and changes nothing, and the registering member retries until the holder has been silent for
``transport.heartbeat_timeout_s`` (a real restart's predecessor is dead: it falls silent). The coordinator's
clock is the test's (``make_job``'s): no test sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.membership import TAKEOVER_GRACE_S
from pstrain.coordinator.service import CoordinatorServicer
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.identity import HEADER, Credential, MemberRegistry
from pstrain.runtime.transport import open_channel, start_server
from tests.test_job import Clock, make_job

TIMEOUT_S = 30.0  # make_job's heartbeat timeout
PS = [f"127.0.0.1:{5000 + i}" for i in range(3)]
WORKERS = ["127.0.0.1:6000", "127.0.0.1:6001"]


def meta(credential: str) -> list[tuple[str, str]]:
    return [(HEADER, credential)]


class Aborted(Exception):
    """What ``FakeContext.abort`` raises, as gRPC's does: the handler ends there."""


@dataclass
class FakeContext:
    """The servicer's view of one call, without a network: its metadata, and the status it was aborted with."""

    metadata: Sequence[tuple[str, str]] = ()
    code: grpc.StatusCode | None = None
    details: str = ""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


@dataclass
class Served:
    """A job and its servicer (in-process): its clock, its registry, each member's credential."""

    job: Job
    clock: Clock
    registry: MemberRegistry
    servicer: CoordinatorServicer
    ps: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)

    def call(self, method: str, request: object, credential: str = "") -> tuple[Any, FakeContext]:
        context = FakeContext(meta(credential) if credential else ())
        try:
            return getattr(self.servicer, method)(request, context), context
        except Aborted:
            return None, context

    def register_ps(self, shard: int, credential: str = "") -> tuple[pb.RegisterPsReply | None, FakeContext]:
        return self.call("RegisterParameterServer", pb.RegisterPsRequest(shard_id=shard, address=PS[shard]), credential)

    def register_worker(
        self, slot: int, credential: str = "", hostname: str = "h"
    ) -> tuple[pb.RegisterWorkerReply | None, FakeContext]:
        request = pb.RegisterWorkerRequest(address=WORKERS[slot], hostname=hostname)
        return self.call("RegisterWorker", request, credential)

    def beat(self, role: str, member_id: int, credential: str) -> pb.Directive:
        directive, context = self.call("Heartbeat", pb.HeartbeatRequest(role=role, id=member_id), credential)
        assert context.code is None, context.details  # the credential still works
        return directive

    def others_beat(self, role: str, member_id: int) -> None:
        """Every member but ``role`` ``member_id`` is heard from now (that one is silent)."""
        for i, credential in enumerate(self.ps):
            if ("ps", i) != (role, member_id):
                self.beat("ps", i, credential)
        for i, credential in enumerate(self.workers):
            if ("worker", i) != (role, member_id):
                self.beat("worker", i, credential)


def serve(tmp_path, workers: int) -> Served:  # type: ignore[no-untyped-def]
    """Three PS shards registered and ready, and ``workers`` workers: 2 start the job (RUNNING), fewer wait."""
    job, clock, _, _ = make_job(tmp_path)
    registry = MemberRegistry()
    served = Served(job, clock, registry, CoordinatorServicer(job, registry))
    for shard in range(3):
        reply, _ = served.register_ps(shard)
        assert reply is not None
        served.ps.append(reply.member_credential)
        served.call("ParameterServerReady", pb.PsReadyRequest(shard_id=shard), reply.member_credential)
    for slot in range(workers):
        reply, _ = served.register_worker(slot)
        assert reply is not None and reply.worker_id == slot
        served.workers.append(reply.member_credential)
    return served


def incarnation(credential: str) -> int:
    return Credential.parse(credential).incarnation


def assert_refused_and_unchanged(served: Served, context: FakeContext, role: str, member_id: int) -> None:
    """UNAVAILABLE with a message naming the holder and the key; the holder keeps its slot and its credential."""
    assert context.code == grpc.StatusCode.UNAVAILABLE, (context.code, context.details)
    assert "was heard from" in context.details and "transport.heartbeat_timeout_s (30 s)" in context.details
    credential = (served.ps if role == "ps" else served.workers)[member_id]
    assert served.job.incarnations[(role, member_id)] == incarnation(credential)
    assert served.registry.require(meta(credential), role, member_id)
    served.beat(role, member_id, credential)


# ------------------------------------------------------------------ in-process: the servicer and the job


def test_a_live_shards_address_without_its_credential_is_refused_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """RUNNING: before, this call rolled the running job back ("PS shard 1 restarted ... lost its state")."""
    served = serve(tmp_path, workers=2)
    job = served.job
    assert job.state == JobState.RUNNING
    holder = job.membership.ps(1)
    forged = Credential("ps", 1, 0, "00" * 64).encode()
    stale = served.registry.keys.mint("ps", 1, 7).encode()  # a genuine signature, not the current incarnation
    malformed = "ps:\u00b2:0:" + "00" * 64  # "²".isdigit(), but int() refuses it: once an uncaught ValueError
    for credential in ("", served.workers[0], served.ps[0], forged, stale, malformed):  # none proves it is shard 1
        reply, context = served.register_ps(1, credential)
        assert reply is None and "ps shard 1 at 127.0.0.1:5001" in context.details
        assert_refused_and_unchanged(served, context, "ps", 1)
        assert job.state == JobState.RUNNING and job.membership.ps(1) is holder
    assert holder.address == PS[1] and holder.ready
    # Once shard 1 is silent past the heartbeat timeout, a registration at its address is its restart, as before.
    served.clock.now += TIMEOUT_S + 1
    served.others_beat("ps", 1)
    reply, context = served.register_ps(1)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "PS shard 1 restarted" in context.details
    assert job.state == JobState.FAILED and job.failure_retryable


def test_a_shards_own_credential_takes_its_slot_at_once_and_supersedes_the_old_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    served = serve(tmp_path, workers=0)  # WAITING: a registration again replaces the slot's holder
    reply, context = served.register_ps(1)
    assert reply is None
    assert_refused_and_unchanged(served, context, "ps", 1)
    old = served.ps[1]
    reply, context = served.register_ps(1, old)  # proof: the current credential of shard 1
    assert context.code is None and reply is not None and incarnation(reply.member_credential) == 1
    assert served.job.incarnations[("ps", 1)] == 1
    _, context = served.call("Heartbeat", pb.HeartbeatRequest(role="ps", id=1), old)
    assert context.code == grpc.StatusCode.PERMISSION_DENIED  # the old incarnation is superseded
    served.ps[1] = reply.member_credential
    served.clock.now += TIMEOUT_S + 1
    served.others_beat("ps", 1)
    reply, context = served.register_ps(1)  # silent: a restart (no credential) takes the slot, as before
    assert context.code is None and reply is not None and incarnation(reply.member_credential) == 2


def test_a_live_workers_address_without_its_credential_is_refused_before_and_after_the_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before the start (``register_again``) and while RUNNING (``restarted_worker``): no slot changes hands."""
    served = serve(tmp_path, workers=1)
    job = served.job
    assert job.state == JobState.WAITING
    reply, context = served.register_worker(0)
    assert reply is None and "worker 0 at 127.0.0.1:6000 (host h)" in context.details
    assert_refused_and_unchanged(served, context, "worker", 0)
    reply, context = served.register_worker(0, served.workers[0])  # its own process: at once, its own slot
    assert reply is not None and reply.worker_id == 0 and incarnation(reply.member_credential) == 1
    served.workers[0] = reply.member_credential
    reply, _ = served.register_worker(1)
    served.workers.append(reply.member_credential)  # type: ignore[union-attr]
    assert job.state == JobState.RUNNING and job.membership.worker_count == 2
    holder = job.membership.worker(1)
    for hostname in ("h", "intruder"):
        reply, context = served.register_worker(1, served.workers[0], hostname)  # worker 0's credential: no proof
        assert reply is None
        assert_refused_and_unchanged(served, context, "worker", 1)
        assert job.state == JobState.RUNNING and job.membership.worker(1) is holder
    assert not holder.failed and not holder.replacement
    served.clock.now += TIMEOUT_S + 1
    served.others_beat("worker", 1)
    reply, context = served.register_worker(1)  # silent now: its restart, as before (no replacements: a rollback)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "worker 1 on host h restarted" in context.details


def test_a_refused_restart_is_not_beaten_by_the_liveness_check_when_its_predecessor_falls_silent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The refused member retries every 2 s at most: in the moment its predecessor falls silent, the liveness check
    must not fail the job first (before the start that would be a whole cluster restart, where the old code let
    the restart keep its slot). The hold lasts ``TAKEOVER_GRACE_S`` past the last refusal, no longer."""
    served = serve(tmp_path, workers=1)
    job = served.job
    served.clock.now += TIMEOUT_S - 1
    served.others_beat("worker", 0)
    _, context = served.register_worker(0)  # the restart's last refused try: worker 0 was heard from 29 s ago
    assert context.code == grpc.StatusCode.UNAVAILABLE and "heard from 29.0 s ago" in context.details
    served.clock.now += 2  # worker 0 is silent now; its restart's next try is due
    served.others_beat("worker", 0)
    job.check_liveness()
    assert job.state == JobState.WAITING, job.message
    reply, context = served.register_worker(0)
    assert context.code is None and reply is not None and reply.worker_id == 0  # its slot back, no second slot
    assert job.membership.worker_count == 1

    served.clock.now += TIMEOUT_S - 1
    served.others_beat("worker", 0)
    _, context = served.register_worker(0)  # refused again, and then nobody retries
    assert context.code == grpc.StatusCode.UNAVAILABLE
    served.clock.now += TAKEOVER_GRACE_S + 1
    served.others_beat("worker", 0)
    job.check_liveness()
    assert job.state == JobState.FAILED and "worker 0 at 127.0.0.1:6000 silent" in job.message


# ------------------------------------------------------------------ over real gRPC on 127.0.0.1


@pytest.fixture
def coordinator(tmp_path) -> Iterator[tuple[Served, pb_grpc.CoordinatorStub]]:  # type: ignore[no-untyped-def]
    job, clock, _, _ = make_job(tmp_path)
    registry = MemberRegistry()
    servicer = CoordinatorServicer(job, registry)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], ["Coordinator"])
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield Served(job, clock, registry, servicer), pb_grpc.CoordinatorStub(channel)
    channel.close()
    server.stop(0)
    job.close()


def grpc_code(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_over_grpc_a_live_members_address_is_unavailable_until_proof_or_silence(coordinator) -> None:  # type: ignore[no-untyped-def]
    served, stub = coordinator
    for shard in range(3):
        reply = stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=shard, address=PS[shard]), timeout=10)
        stub.ParameterServerReady(pb.PsReadyRequest(shard_id=shard), metadata=meta(reply.member_credential))
        served.ps.append(reply.member_credential)
    for address in WORKERS:
        request = pb.RegisterWorkerRequest(address=address, hostname="h")
        served.workers.append(stub.RegisterWorker(request, timeout=10).member_credential)
    job = served.job
    assert job.state == JobState.RUNNING

    # Shard 2's address, mid-job, no credential: UNAVAILABLE (the member's join retries it), the job runs on.
    code, details = grpc_code(
        lambda: stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=2, address=PS[2]), timeout=10)
    )
    assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("ps shard 2 at 127.0.0.1:5002 was heard from")
    # Worker 1's address from another "host" with worker 0's credential: UNAVAILABLE, worker 1 keeps its slot.
    intruder = pb.RegisterWorkerRequest(address=WORKERS[1], hostname="intruder")
    code, details = grpc_code(lambda: stub.RegisterWorker(intruder, metadata=meta(served.workers[0]), timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE and "worker 1 at 127.0.0.1:6001" in details
    assert job.state == JobState.RUNNING and job.incarnations == {
        ("ps", 0): 0,
        ("ps", 1): 0,
        ("ps", 2): 0,
        ("worker", 0): 0,
        ("worker", 1): 0,
    }
    for role, member_id, credential in (("ps", 2, served.ps[2]), ("worker", 1, served.workers[1])):
        beat = pb.HeartbeatRequest(role=role, id=member_id)
        assert not stub.Heartbeat(beat, metadata=meta(credential), timeout=10).stop  # their credentials still work
    shard = stub.RequestDataShard(pb.DataShardRequest(worker_id=1), metadata=meta(served.workers[1]), timeout=10)
    assert len(shard.indices) > 0

    # Worker 1 itself, with its current credential: its slot at once, no waiting (a mid-job re-registration
    # without replacements rolls the job back, as it always did).
    code, details = grpc_code(lambda: stub.RegisterWorker(intruder, metadata=meta(served.workers[1]), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "worker 1 on host intruder restarted" in details


def test_over_grpc_a_silent_shards_restart_takes_its_slot_without_a_credential(coordinator) -> None:  # type: ignore[no-untyped-def]
    served, stub = coordinator
    reply = stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=0, address=PS[0]), timeout=10)
    first = reply.member_credential
    code, _ = grpc_code(lambda: stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=0, address=PS[0])))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert not stub.Heartbeat(pb.HeartbeatRequest(role="ps", id=0), metadata=meta(first), timeout=10).stop
    served.clock.now += TIMEOUT_S + 1
    reply = stub.RegisterParameterServer(pb.RegisterPsRequest(shard_id=0, address=PS[0]), timeout=10)
    assert incarnation(reply.member_credential) == 1 and reply.job_key == served.registry.keys.public_key
    code, _ = grpc_code(lambda: stub.Heartbeat(pb.HeartbeatRequest(role="ps", id=0), metadata=meta(first)))
    assert code == grpc.StatusCode.PERMISSION_DENIED  # the old process is refused from here, as before


def test_a_heartbeat_timeout_that_leaves_a_restart_too_little_of_its_connect_timeout_is_warned_of(caplog) -> None:  # type: ignore[no-untyped-def]
    from pstrain.coordinator.main import warn_of_slow_takeovers

    with caplog.at_level(logging.WARNING, logger="pstrain.coordinator.main"):
        warn_of_slow_takeovers(10.0)  # the default: a restart takes its slot within 10 s of its 120
        assert not caplog.records
        warn_of_slow_takeovers(100.0)
    (record,) = caplog.records
    assert "heartbeat_timeout_s 100 s" in record.getMessage() and "--connect-timeout-s" in record.getMessage()
