"""The member-process skeleton in-process: a real gRPC coordinator stub on port 0, no child processes."""

import argparse
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.member import MemberProcess, MemberState, add_member_flags, drain_waits_s
from pstrain.runtime.security import SecurityError
from pstrain.runtime.transport import open_channel, start_server

WAIT_S = 30.0
NO_STOP = pb.Directive(stop=False, state=pb.RUNNING)
FINISHED = pb.Directive(stop=True, state=pb.FINISHED, reason="finished")
FAILED = pb.Directive(stop=True, state=pb.FAILED, reason="worker 1 went silent")


class ScriptedCoordinator(pb_grpc.CoordinatorServicer):
    """Answers the first ``calm`` heartbeats with "go on", then with ``directive``; records who beat."""

    def __init__(self, directive: pb.Directive, calm: int = 0) -> None:
        self.directive, self.calm = directive, calm
        self.heartbeats: list[tuple[str, int]] = []

    def Heartbeat(self, request, context):
        self.heartbeats.append((request.role, request.id))
        return NO_STOP if len(self.heartbeats) <= self.calm else self.directive


@pytest.fixture
def coordinator():
    servers = []

    def start(directive: pb.Directive, calm: int = 0) -> tuple[ScriptedCoordinator, str]:
        servicer = ScriptedCoordinator(directive, calm)
        server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], ["Coordinator"])
        servers.append(server)
        return servicer, f"127.0.0.1:{server.port}"

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture
def notify(monkeypatch):
    """A systemd notify socket in $NOTIFY_SOCKET; ``messages()`` reads what has arrived so far."""
    directory = tempfile.mkdtemp(prefix="sd-", dir="/tmp")  # AF_UNIX paths must stay short
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(Path(directory) / "notify"))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(Path(directory) / "notify"))
    monkeypatch.delenv("PSTRAIN_TOKEN", raising=False)
    received: list[str] = []

    def messages() -> list[str]:
        while True:
            try:
                received.append(sock.recv(4096).decode())
            except BlockingIOError:
                return list(received)

    yield messages
    sock.close()
    shutil.rmtree(directory)


def member_args(coordinator: str, tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_member_flags(parser)
    flags = ["--coordinator", coordinator, "--bind", "127.0.0.1:0", "--metrics-port", "-1"]
    flags += ["--port-file", str(tmp_path / "port"), "--grace-s", "1", "--connect-timeout-s", "10"]
    return parser.parse_args([*flags, *extra])


def make_member(args: argparse.Namespace, role: str = "ps", **kwargs) -> MemberProcess:
    return MemberProcess(args, role, [], [], signals=(), **kwargs)


def health(address: str) -> int:
    with open_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def assert_drained(member: MemberProcess, address: str) -> None:
    assert member.state is MemberState.STOPPED
    assert member.heartbeat is None or not member.heartbeat.is_alive()
    with pytest.raises(grpc.RpcError) as err:
        health(address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, "the server stopped"
    with pytest.raises(ValueError):
        member.channel.unary_unary("/x")(b"", timeout=1)  # closed channels refuse new calls


def test_a_stop_directive_ends_a_member_that_lives_as_long_as_the_job(tmp_path, coordinator, notify):
    servicer, address = coordinator(FINISHED, calm=2)
    member = make_member(member_args(address, tmp_path))
    seen: dict[str, object] = {}

    def announce() -> None:  # what the PS tells the coordinator: health and port file first, READY=1 after
        seen["announced"] = (health(member.served.address), (tmp_path / "port").read_text(), notify())

    def body(m: MemberProcess) -> int:
        assert m.state is MemberState.JOINING and health(m.served.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        m.ready(announce)
        assert m.state is MemberState.SERVING and notify() == ["READY=1"]
        with pytest.raises(RuntimeError, match="SERVING to SERVING"):
            m.ready()
        m.start_heartbeat(3, 0.01, stop_when_job_ends=True)
        seen["woken"] = m.stop.wait(WAIT_S)
        return 0

    assert member.run(body) == 0
    assert seen["woken"] and not member.aborted.is_set()
    assert seen["announced"] == (health_pb2.HealthCheckResponse.SERVING, f"{member.served.server.port}\n", [])
    assert servicer.heartbeats == [("ps", 3)] * 3, "two calm beats, then the stop ends the heartbeat"
    assert notify() == ["READY=1", "STOPPING=1"]
    assert_drained(member, member.served.address)


def test_a_failed_job_sets_aborted_and_wakes_the_body(tmp_path, coordinator, notify):
    servicer, address = coordinator(FAILED, calm=1)
    member = make_member(member_args(address, tmp_path), role="worker")

    def body(m: MemberProcess) -> int:
        m.start_heartbeat(7, 0.01, stop_when_job_ends=False)  # a worker heartbeats while it joins
        assert m.stop.wait(WAIT_S), "the abort wakes the body"
        return 1 if m.aborted.is_set() else 0

    assert member.run(body) == 1
    assert member.aborted.is_set() and servicer.heartbeats == [("worker", 7)] * 2
    assert notify() == ["STOPPING=1"], "never ready: no READY=1, but the drain still says STOPPING=1"
    assert_drained(member, member.served.address)


def test_a_finished_job_does_not_cut_a_worker_short(tmp_path, coordinator, notify):
    servicer, address = coordinator(FINISHED)
    member = make_member(member_args(address, tmp_path), role="worker")

    def body(m: MemberProcess) -> int:
        m.start_heartbeat(0, 0.01, stop_when_job_ends=False)
        assert m.heartbeat is not None
        m.heartbeat.join(WAIT_S)
        assert not m.heartbeat.is_alive(), "the stop directive ends the heartbeat"
        assert not m.stop.is_set() and not m.aborted.is_set(), "worker 0 still has buffers to upload"
        return 0

    assert member.run(body) == 0
    assert servicer.heartbeats == [("worker", 0)]


def test_the_stop_event_drains_the_member(tmp_path, coordinator, notify):
    servicer, address = coordinator(NO_STOP)
    member = make_member(member_args(address, tmp_path))
    serving, closed = threading.Event(), []

    def body(m: MemberProcess) -> int:
        m.closing(lambda: closed.append(("first", m.state, health(m.served.address))))
        m.closing(lambda: closed.append(("second", m.state, health(m.served.address))))
        m.ready()
        m.start_heartbeat(1, 0.01, stop_when_job_ends=True)
        serving.set()
        m.stop.wait()
        return 0

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(member.run, body)
        assert serving.wait(WAIT_S)
        assert member.state is MemberState.SERVING
        member.stop.set()  # what SIGTERM's watcher does
        assert result.result(WAIT_S) == 0
    # the body's resources close last-registered first, while the server still answers
    draining = (MemberState.DRAINING, health_pb2.HealthCheckResponse.SERVING)
    assert closed == [("second", *draining), ("first", *draining)]
    assert notify() == ["READY=1", "STOPPING=1"]
    assert_drained(member, member.served.address)


def test_a_stuck_heartbeat_thread_holds_the_drain_no_longer_than_its_bound(tmp_path, coordinator, notify):
    """The units' TimeoutStopSec is computed from ``drain_waits_s``: a heartbeat thread stuck outside its RPC (which
    closing the channel would cancel) used to hold the exit 30 s, past the unit's timeout, so systemd SIGKILLed it."""
    _, address = coordinator(NO_STOP)
    member = make_member(member_args(address, tmp_path))
    beating, release = threading.Event(), threading.Event()

    def stuck(rss: int) -> None:
        beating.set()
        release.wait(WAIT_S)

    member.memory_guard.observe = stuck  # type: ignore[method-assign]

    def body(m: MemberProcess) -> int:
        m.ready()
        m.start_heartbeat(1, 0.01, stop_when_job_ends=True)
        assert beating.wait(WAIT_S)
        return 0

    try:
        started = time.monotonic()
        assert member.run(body) == 0
        drained_s = time.monotonic() - started
    finally:
        release.set()
    assert drained_s < drain_waits_s(member.args.grace_s) + 3.0, drained_s
    assert member.state is MemberState.STOPPED


def test_shutdown_runs_when_the_body_raises(tmp_path, coordinator, notify):
    _, address = coordinator(NO_STOP)
    member = make_member(member_args(address, tmp_path))
    closed = []

    def body(m: MemberProcess) -> int:
        m.closing(lambda: closed.append(True))
        m.ready()
        m.start_heartbeat(1, 0.01, stop_when_job_ends=True)
        raise RuntimeError("a bug in the body")

    with pytest.raises(RuntimeError, match="a bug in the body"):
        member.run(body)
    assert closed == [True]
    assert notify() == ["READY=1", "STOPPING=1"]
    assert_drained(member, member.served.address)


class OwnError(ValueError):
    pass


def unimplemented_rpc(m: MemberProcess) -> int:
    m.coordinator.GetJobStatus(pb.JobStatusRequest(), timeout=5)  # the stub coordinator does not implement it
    return 0


@pytest.mark.parametrize(
    ("fail", "code"),
    [
        (unimplemented_rpc, 1),
        (ConnectionError("peer went away"), 1),
        (OwnError("this host's model differs"), 1),
        (SecurityError("--tls-key: cannot read key.pem"), 2),
    ],
)
def test_expected_failures_map_to_exit_codes(tmp_path, coordinator, notify, fail, code):
    _, address = coordinator(NO_STOP)
    member = make_member(member_args(address, tmp_path), fatal_errors=(OwnError,))

    def body(m: MemberProcess) -> int:
        if callable(fail):
            return fail(m)
        raise fail

    assert member.run(body) == code
    assert notify() == ["STOPPING=1"]
    assert_drained(member, member.served.address)


def test_an_unreachable_coordinator_exits_1_without_running_the_body(tmp_path, notify):
    gone = start_server("127.0.0.1:0", [], [])
    gone.stop(0)
    member = make_member(member_args(f"127.0.0.1:{gone.port}", tmp_path, "--connect-timeout-s", "0.5"))
    assert member.run(lambda m: pytest.fail("the body must not run")) == 1
    assert notify() == ["STOPPING=1"]
    assert_drained(member, member.served.address)


def test_sigterm_while_the_coordinator_is_unreachable_exits_0_at_once(tmp_path, notify):
    """README: exit 0 on SIGTERM. Not after --connect-timeout-s with exit 1, which a unit would restart."""
    gone = start_server("127.0.0.1:0", [], [])
    gone.stop(0)
    member = make_member(member_args(f"127.0.0.1:{gone.port}", tmp_path, "--connect-timeout-s", "20"))
    signalled = threading.Timer(0.3, member.stop.set)  # what SIGTERM's watcher does, while the wait is on
    signalled.start()
    started = time.monotonic()
    try:
        assert member.run(lambda m: pytest.fail("the body must not run")) == 0
    finally:
        signalled.cancel()
    assert time.monotonic() - started < 5.0, "the stop ended the wait, not the connect timeout"
    assert notify() == ["STOPPING=1"]
    assert_drained(member, member.served.address)


class Refused(grpc.RpcError):
    """A registration the coordinator cannot take yet (it restarts): ``join`` retries it."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "restarting"


def test_sigterm_while_joining_exits_0(tmp_path, coordinator, notify):
    _, address = coordinator(NO_STOP)
    member = make_member(member_args(address, tmp_path))
    tries = []

    def register() -> object:
        tries.append(time.monotonic())
        member.stop.set()  # SIGTERM arrives while the coordinator keeps refusing
        raise Refused()

    assert member.run(lambda m: m.join(register)) == 0
    assert len(tries) == 1, "no retry after the stop"
    assert notify() == ["STOPPING=1"]
    assert_drained(member, member.served.address)


def test_unusable_security_settings_exit_2_before_anything_starts(tmp_path, notify):
    member = make_member(member_args("127.0.0.1:1", tmp_path, "--tls-ca", str(tmp_path / "ca.pem")))
    assert member.run(lambda m: pytest.fail("the body must not run")) == 2
    assert member.state is MemberState.STOPPED and notify() == []
    with pytest.raises(RuntimeError, match="has not started"):
        _ = member.served


@pytest.mark.parametrize("retryable, code", [(True, 1), (False, 3)])
def test_a_failed_job_exits_1_when_a_restart_may_mend_it_else_3(tmp_path, coordinator, notify, retryable, code):
    failed = pb.Directive(stop=True, state=pb.FAILED, reason="ps 1 restarted", retryable=retryable)
    _, address = coordinator(failed)
    member = make_member(member_args(address, tmp_path))

    def body(m: MemberProcess) -> int:
        m.start_heartbeat(0, 0.01, stop_when_job_ends=True)
        assert m.stop.wait(WAIT_S)
        return m.abort_exit_code if m.aborted.is_set() else 0

    assert member.run(body) == code


class ForgetfulCoordinator(pb_grpc.CoordinatorServicer):
    """A coordinator that restarted: it answers NOT_FOUND for members of the job it lost."""

    def Heartbeat(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"{request.role} {request.id} is not registered")


def test_a_member_the_restarted_coordinator_does_not_know_exits_1_to_rejoin(tmp_path, notify):
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, ForgetfulCoordinator())], [])
    try:
        member = make_member(member_args(f"127.0.0.1:{server.port}", tmp_path))

        def body(m: MemberProcess) -> int:
            m.start_heartbeat(0, 0.01, stop_when_job_ends=True, coordinator_timeout_s=600)
            assert m.stop.wait(WAIT_S), "NOT_FOUND ends the member at once, long before the timeout"
            return m.abort_exit_code if m.aborted.is_set() else 0

        assert member.run(body) == 1
    finally:
        server.stop(0)


def test_a_member_that_loses_the_coordinator_exits_1_after_the_timeout(tmp_path, notify):
    servicer = ScriptedCoordinator(NO_STOP)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], [])
    member = make_member(member_args(f"127.0.0.1:{server.port}", tmp_path))

    def body(m: MemberProcess) -> int:
        m.start_heartbeat(0, 0.05, stop_when_job_ends=True, coordinator_timeout_s=1.0)
        deadline = time.monotonic() + WAIT_S
        while not servicer.heartbeats and time.monotonic() < deadline:
            m.stop.wait(0.01)
        server.stop(0)  # the coordinator dies: every heartbeat from now on fails
        lost = time.monotonic()
        assert m.stop.wait(WAIT_S)
        assert time.monotonic() - lost >= 1.0, "not before the timeout"
        return m.abort_exit_code if m.aborted.is_set() else 0

    try:
        assert member.run(body) == 1
        assert servicer.heartbeats
    finally:
        server.stop(0)


def test_a_member_calls_a_returning_coordinator_within_seconds_of_its_return(tmp_path, notify):
    """After 10 s of refused connections gRPC's default backoff would next try about 6 s later; a
    restarted coordinator gives its members only the heartbeat timeout to reattach."""
    first = ScriptedCoordinator(NO_STOP)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, first)], [])
    address = f"127.0.0.1:{server.port}"
    member = make_member(member_args(address, tmp_path))
    servers = [server]

    def body(m: MemberProcess) -> int:
        m.start_heartbeat(0, 0.1, stop_when_job_ends=True, coordinator_timeout_s=60)
        deadline = time.monotonic() + WAIT_S
        while not first.heartbeats and time.monotonic() < deadline:
            m.stop.wait(0.01)
        server.stop(0)
        assert not m.stop.wait(10.0), "the member rides out the outage"
        back = ScriptedCoordinator(FINISHED)
        servers.append(start_server(address, [(pb_grpc.add_CoordinatorServicer_to_server, back)], []))
        assert m.stop.wait(3.0), "heard the returned coordinator's FINISHED within seconds"
        assert back.heartbeats
        return 0

    try:
        assert member.run(body) == 0
    finally:
        for each in servers:
            each.stop(0)
