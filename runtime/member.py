"""The skeleton of a member process (a PS shard or a worker): serve, join, ready, heartbeat, drain.

Both member kinds differ only in how they join (what they register and prepare) and what
they do once serving; everything around that is here, once. ``MemberProcess.run(body)``
calls ``body(member)`` between the coordinator becoming reachable and the drain, and maps
errors to exit codes (``EXIT_CODES``).

States (``MemberState``)::

    STARTING --server listening (NOT_SERVING), signals armed, coordinator reachable--> JOINING
    STARTING --security settings or --bind unusable (exit 2; a port taken: 1): nothing was started--> STOPPED
    JOINING  --the body registered and prepared; ready(): SERVING, port file, READY=1--> SERVING
    STARTING --coordinator unreachable within --connect-timeout-s (exit 1)--> DRAINING
    STARTING/JOINING --SIGTERM/SIGINT while waiting for the coordinator or the cluster (exit 0)--> DRAINING
    JOINING/SERVING --the body returned or raised--> DRAINING
    DRAINING --STOPPING=1, heartbeat off, the body's resources closed, server drained,
               coordinator channel closed--> STOPPED

The body learns when to finish from ``stop``: SIGTERM/SIGINT set it, and so does the
heartbeat when the coordinator aborts the job (``aborted`` is set first) or, for members
that live as long as the job (``stop_when_job_ends``), when it says the job is over.
"""

from __future__ import annotations

import argparse
import enum
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import TypeVar

import grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.identity import IdentityHolder
from pstrain.runtime.lifecycle import (
    Stopped,
    add_common_flags,
    advertised_address,
    sd_notify,
    stop_on_signals,
    wait_until_reachable,
    write_port_file,
)
from pstrain.runtime.memory_trend import MemoryGuard, host_memory_limit, rss_bytes
from pstrain.runtime.metrics import serve_metrics
from pstrain.runtime.security import SecurityError, TransportSecurity, is_loopback, security_from_args
from pstrain.runtime.transport import (
    CONTROL_TIMEOUT_S,
    BindError,
    PortInUse,
    ServingServer,
    host_of,
    open_channel,
    start_server,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_RESTART = 1
"""The job failed in a way a restart of the cluster can mend (a member died or restarted, the
coordinator was lost): systemd's ``Restart=on-failure`` restarts the member, which rejoins the
restarted coordinator, and the job resumes from its last committed checkpoint."""

EXIT_JOB_FAILED = 3
"""The job failed for a reason a restart would repeat (a non-finite loss under ``fault.on_nonfinite:
stop``, a failed probe): a launcher restarts nothing on 2 or 3, nor do the units
(``RestartPreventExitStatus=2 3``)."""

JOIN_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED)
"""Registration errors that mean "not yet": a restarting coordinator (CANCELLED: the call reached it as it
stopped), one whose failed job is ending, or (UNAVAILABLE) a slot whose previous process is still heard from:
a restart at the same address takes it once that process has been silent for transport.heartbeat_timeout_s."""

HEARTBEAT_JOIN_S = 5.0
"""How long the drain waits for the heartbeat thread once the coordinator channel is closed. Closing the channel
cancels a beat in flight, so the thread ends at once; the bound only keeps a stuck thread from holding the exit."""

EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (SecurityError, 2),  # settings that cannot work: retrying will not help
    (PortInUse, 1),  # another process holds the port, maybe one still stopping: start again later
    (BindError, 2),  # --bind cannot be served (or gRPC refused the TLS files): the same
    (grpc.RpcError, 1),
    (ConnectionError, 1),
    (Stopped, 0),  # SIGTERM while waiting to join: the orderly stop it asks for, not a failure
)
"""Expected failures and their exit codes; anything else propagates (traceback, exit 1)."""


CONNECT_TIMEOUT_S = 120.0
"""A member's default wait to reach, then to join, the coordinator (``--connect-timeout-s``). A member restarted at
its own address waits up to ``transport.heartbeat_timeout_s`` in its join for its dead predecessor's slot, so the
coordinator warns about a heartbeat timeout that leaves too little of this."""


def join_waits_s(args: argparse.Namespace) -> float:
    """The longest a member waits on the coordinator before it can send READY=1: reaching it (``wait_until_reachable``)
    and then joining (``MemberProcess.join``, retried while it cannot take members yet) each get
    ``--connect-timeout-s``. A systemd unit (Type=notify) must allow more than this for its start, or it kills a
    member that is still within its own deadlines (units: TimeoutStartSec)."""
    return 2 * float(args.connect_timeout_s)


def drain_waits_s(grace_s: float) -> float:
    """The longest ``MemberProcess``'s drain takes beyond its resources' own closing: the server's grace, then the
    heartbeat thread. Each member adds what its body and resources may wait (``worst_case_stop_s`` of each main)."""
    return grace_s + HEARTBEAT_JOIN_S


def _started(value: T | None, what: str) -> T:
    if value is None:
        raise RuntimeError(f"{what} has not started")
    return value


class MemberState(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_NEXT: dict[MemberState, frozenset[MemberState]] = {
    MemberState.STARTING: frozenset({MemberState.JOINING, MemberState.DRAINING, MemberState.STOPPED}),
    MemberState.JOINING: frozenset({MemberState.SERVING, MemberState.DRAINING}),
    MemberState.SERVING: frozenset({MemberState.DRAINING}),
    MemberState.DRAINING: frozenset({MemberState.STOPPED}),
    MemberState.STOPPED: frozenset(),
}


def add_member_flags(parser: argparse.ArgumentParser) -> None:
    """The common flags plus what every member needs to find and reach the coordinator."""
    parser.add_argument("--coordinator", required=True, help="coordinator address, host:port")
    parser.add_argument(
        "--advertise-host", help="host name peers use to reach this process (default: bind host or FQDN)"
    )
    parser.add_argument("--connect-timeout-s", type=float, default=CONNECT_TIMEOUT_S)
    add_common_flags(parser, default_bind="0.0.0.0:0")


@dataclass
class MemberServer:
    """What a member process has once it listens: server, addresses, security."""

    server: ServingServer
    address: str  # what peers dial
    metrics_address: str  # empty when metrics are off
    security: TransportSecurity


def start_member_server(
    args: argparse.Namespace, register: list[tuple[object, object]], service_names: list[str], aio: bool = False
) -> MemberServer:
    """Serve (health NOT_SERVING) and start metrics with the common flags; raises SecurityError.

    ``aio``: an asyncio server (``transport.start_server``), for services with ``async`` handlers."""
    security = security_from_args(args).with_identity(IdentityHolder())  # the credential comes with ``join``
    server = start_server(args.bind, register, service_names, security, aio=aio)
    host = getattr(args, "advertise_host", None)
    metrics = serve_metrics(host_of(args.bind), args.metrics_port, security, getattr(args, "metrics_host", None))
    metrics_address = metrics_address_of(args.bind, metrics, host)
    return MemberServer(server, advertised_address(args.bind, server.port, host), metrics_address, security)


def metrics_address_of(bind: str, metrics: str, host: str | None = None) -> str:
    """What peers dial for /metrics: loopback stays loopback, a wildcard becomes the advertised host."""
    if not metrics:
        return ""
    bound_host, port = metrics.rsplit(":", 1)
    if is_loopback(bound_host):
        return metrics
    return advertised_address(bind, int(port), host)


def freeze_startup_objects() -> None:
    """Issue 12: what a service process holds once started (torch, the model, gRPC) lives to its end. Frozen
    (``gc.freeze``), it is left out of the collector's full passes, which otherwise walk it every few steps:
    10-20% of a worker's or shard's CPU, 37% of the coordinator's. For a process's own entry point only: frozen
    objects are never collected, so an in-process member (the tests') must not freeze its host process."""
    gc.freeze()


class MemberProcess:
    """One member process's life; see the module docstring for the states.

    ``fatal_errors`` are the member's own expected failures (a bad device list, a model
    factory that does not match): logged and exit 1 like RPC and connection failures.
    ``aio`` serves ``register`` from an asyncio server (the parameter server's waiting pulls).
    """

    freeze_gc_when_ready = False
    """Set by a service's ``main()`` (its own process): ``ready()`` then calls ``freeze_startup_objects``."""

    def __init__(
        self,
        args: argparse.Namespace,
        role: str,
        register: list[tuple[object, object]],
        service_names: list[str],
        fatal_errors: tuple[type[Exception], ...] = (),
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
        aio: bool = False,
    ) -> None:
        self.args = args
        self.role = role  # "ps" | "worker", as the coordinator's Heartbeat names it
        self.stop = threading.Event()  # the body's cue to finish: a signal, or the coordinator
        self.aborted = threading.Event()  # the coordinator failed the job, or was lost
        self.abort_exit_code = EXIT_RESTART  # what the member exits with once ``aborted``
        self.state = MemberState.STARTING
        self.heartbeat: threading.Thread | None = None
        self._register = register
        self._service_names = service_names
        self._exit_codes = (*EXIT_CODES, *((error, 1) for error in fatal_errors))
        self._signals = signals
        self._aio = aio
        self._heartbeat_off = threading.Event()
        self.memory_guard = MemoryGuard(time.monotonic, host_memory_limit)  # S2.4: this process against its limit
        self._resources = ExitStack()
        self._server: MemberServer | None = None
        self._channel: grpc.Channel | None = None
        self._coordinator: pb_grpc.CoordinatorStub | None = None

    # ------------------------------------------------------------------ what the body uses

    @property
    def served(self) -> MemberServer:
        return _started(self._server, "the member's server")

    @property
    def channel(self) -> grpc.Channel:
        """The one long-lived channel to the coordinator."""
        return _started(self._channel, "the coordinator channel")

    @property
    def coordinator(self) -> pb_grpc.CoordinatorStub:
        return _started(self._coordinator, "the coordinator stub")

    def closing(self, close: Callable[[], object]) -> None:
        """Call ``close`` when draining, before the server stops; the last registered closes first."""
        self._resources.callback(close)

    def holding(self, held: AbstractContextManager[T]) -> T:
        """Enter ``held`` now and leave it when draining, in the same last-first order as ``closing``."""
        return self._resources.enter_context(held)

    def start_heartbeat(
        self, member_id: int, interval_s: float, *, stop_when_job_ends: bool, coordinator_timeout_s: float = 30.0
    ) -> None:
        """Heartbeat every ``interval_s`` in a thread until draining or until the coordinator says stop.

        A FAILED job sets ``aborted`` (exit ``EXIT_RESTART`` if the coordinator says a restart may
        mend it, else ``EXIT_JOB_FAILED``) and ``stop``. So does losing the coordinator: no answer
        for ``coordinator_timeout_s``, or an answer that it does not know this member (it restarted
        and holds a new job): the member exits 1 and its unit restarts it to rejoin. A job that
        ended otherwise sets ``stop`` only with ``stop_when_job_ends``: a PS lives as long as the
        job, while a worker finishes on its own (worker 0 still uploads the model buffers) and must
        not be cut short. Each beat carries this process's RSS (the coordinator's PS memory
        forecast, S2.4) and checks its trend against this process's own limit (``memory_guard``),
        which the coordinator cannot see.
        """
        if self.heartbeat is not None:
            raise RuntimeError("the heartbeat is already running")
        self.heartbeat = threading.Thread(
            target=self._heartbeat_loop,
            args=(
                pb.HeartbeatRequest(role=self.role, id=member_id),
                interval_s,
                stop_when_job_ends,
                coordinator_timeout_s,
            ),
            name="heartbeat",
            daemon=True,
        )
        self.heartbeat.start()

    def join(self, register: Callable[[], T]) -> T:
        """Call ``register`` (the member's registration RPC), retrying while the coordinator cannot
        take it yet: it is restarting (UNAVAILABLE), still winding down the job it failed
        (FAILED_PRECONDITION), or this member's slot is held by a process still heard from (UNAVAILABLE:
        this process's predecessor, until the heartbeat timeout). Bounded by ``--connect-timeout-s``, which
        must exceed the job's ``transport.heartbeat_timeout_s``; a stop ends it at once. The reply's
        ``member_credential`` is presented on every later call of this process's channels (issue 8)."""
        deadline = time.monotonic() + self.args.connect_timeout_s
        delay = 0.2
        while True:
            try:
                reply = register()
            except grpc.RpcError as exc:
                if exc.code() not in JOIN_RETRYABLE or time.monotonic() + delay > deadline:
                    raise
                log.info("coordinator cannot take this member yet (%s: %s); retrying", exc.code().name, exc.details())
            else:
                self._adopt_credential(reply)
                return reply
            if self.stop.wait(delay):
                raise Stopped("stopped while joining the job")
            delay = min(2.0, delay * 2)

    def _adopt_credential(self, reply: object) -> None:
        """Present the credential the registration reply carries (issue 8) on every later call."""
        credential = getattr(reply, "member_credential", "")
        if credential and self.served.security.identity is not None:
            self.served.security.identity.adopt(credential)

    def ready(self, announce: Callable[[], object] | None = None) -> None:
        """Health SERVING, the port file, ``announce`` (tell the coordinator), READY=1: in that order,
        so whoever reads the port file or hears READY=1 finds a serving member."""
        self._enter(MemberState.SERVING)
        self.served.server.set_serving(True)
        if self.args.port_file:
            write_port_file(self.args.port_file, self.served.server.port)
        if announce is not None:
            announce()
        if MemberProcess.freeze_gc_when_ready:
            freeze_startup_objects()
        sd_notify("READY=1")

    # ------------------------------------------------------------------ the skeleton

    def run(self, body: Callable[[MemberProcess], int]) -> int:
        """Serve, reach the coordinator, run ``body(self)``, drain; returns the exit code."""
        try:
            self._server = start_member_server(self.args, self._register, self._service_names, self._aio)
        except (SecurityError, BindError) as exc:
            self._enter(MemberState.STOPPED)
            return self._exit_code(exc)
        if self._signals:
            stop_on_signals(self.stop, self._signals)
        self._channel = open_channel(self.args.coordinator, self._server.security)
        try:
            wait_until_reachable(self._channel, self.args.coordinator, self.args.connect_timeout_s, self.stop)
            self._coordinator = pb_grpc.CoordinatorStub(self._channel)
            self._enter(MemberState.JOINING)
            return body(self)
        except Exception as exc:
            if not any(isinstance(exc, error) for error, _ in self._exit_codes):
                raise
            return self._exit_code(exc)
        finally:
            self._drain()

    def _drain(self) -> None:
        self._enter(MemberState.DRAINING)
        sd_notify("STOPPING=1")
        self._heartbeat_off.set()
        try:
            self._resources.close()
        finally:
            self.served.server.stop(self.args.grace_s)
            self.channel.close()  # cancels a heartbeat in flight
            if self.heartbeat is not None:
                self.heartbeat.join(HEARTBEAT_JOIN_S)
            self._enter(MemberState.STOPPED)

    def _exit_code(self, exc: Exception) -> int:
        if isinstance(exc, Stopped):
            log.info("%s", exc)
        elif isinstance(exc, grpc.RpcError):
            log.error("RPC failed: %s: %s", exc.code().name, exc.details())
        else:
            log.error("%s", exc)
        return next(code for error, code in self._exit_codes if isinstance(exc, error))

    def _heartbeat_loop(
        self, request: pb.HeartbeatRequest, interval_s: float, stop_when_job_ends: bool, coordinator_timeout_s: float
    ) -> None:
        last_answer = time.monotonic()
        while not self._heartbeat_off.wait(interval_s):
            request.rss_bytes = rss_bytes()
            self.memory_guard.observe(request.rss_bytes)
            if self._heartbeat_off.is_set():  # the drain left this thread behind and closed the channel: a call
                return  # on a closed channel can crash gRPC (a segfault in the exiting process, seen in a test)
            try:
                directive = self.coordinator.Heartbeat(request, timeout=min(CONTROL_TIMEOUT_S, coordinator_timeout_s))
            except grpc.RpcError as exc:
                if self._heartbeat_off.is_set():
                    return
                silent_s = time.monotonic() - last_answer
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                    self._abort(
                        EXIT_RESTART,
                        f"the coordinator no longer knows this member ({exc.details()}); "
                        "it restarted, or another process registered in this member's place: exiting to rejoin",
                    )
                    return
                if silent_s > coordinator_timeout_s:
                    self._abort(
                        EXIT_RESTART,
                        f"lost the coordinator at {self.args.coordinator}: no answer for "
                        f"{silent_s:.0f}s ({exc.details()}); exiting so this member is restarted",
                    )
                    return
                log.warning("heartbeat to coordinator failed (%.0fs without an answer): %s", silent_s, exc.details())
                continue
            last_answer = time.monotonic()
            if not directive.stop:
                continue
            if directive.state == pb.FAILED:
                code = EXIT_RESTART if directive.retryable else EXIT_JOB_FAILED
                self._abort(code, f"coordinator aborted the job: {directive.reason}")
            else:
                log.info("coordinator says stop: %s", directive.reason)
                if stop_when_job_ends:
                    self.stop.set()
            return

    def _abort(self, exit_code: int, reason: str) -> None:
        log.error("%s", reason)
        self.abort_exit_code = exit_code
        self.aborted.set()
        self.stop.set()

    def _enter(self, state: MemberState) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"a member cannot go from {self.state.name} to {state.name}")
        log.debug("member %s -> %s", self.state.name, state.name)
        self.state = state
