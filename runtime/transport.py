"""gRPC plumbing every service uses the same way: message limits, servers, channels.

Servers come with the standard health service and server reflection, so grpcurl works
without .proto files and load balancers/systemd can ask whether a service is ready.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.metrics import REJECTED
from pstrain.runtime.security import INSECURE, TransportSecurity

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]

# Deadlines for the short control RPCs; data RPCs take theirs from the job spec.
CONTROL_TIMEOUT_S = 30.0


def full_service_name(short: str) -> str:
    return pb.DESCRIPTOR.services_by_name[short].full_name


@dataclass
class ServingServer:
    """A started gRPC server, the port it bound, and its health service."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (*self.service_names, ""):
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish within ``grace_s``, then stop."""
        self.set_serving(False)
        self.server.stop(grace_s).wait()


def start_server(
    address: str,
    register: Iterable[tuple[object, object]],
    service_names: Iterable[str],
    security: TransportSecurity = INSECURE,
    max_workers: int = 32,
) -> ServingServer:
    """Bind ``address`` (port 0 picks a free one), add servicers, health and reflection, start.

    ``register`` holds ``(add_XServicer_to_server, servicer)`` pairs. Health starts as
    NOT_SERVING: each service flips it once it is really ready. With ``security`` the port
    demands mutual TLS and/or the bearer token (health stays open).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        interceptors=security.server_interceptors(),
    )
    for add, servicer in register:
        add(servicer, server)  # type: ignore[operator]
    names = tuple(full_service_name(n) for n in service_names)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    credentials = security.server_credentials()
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    serving = ServingServer(server, port, health_servicer, names)
    serving.set_serving(False)
    return serving


def open_channel(address: str, security: TransportSecurity = INSECURE) -> grpc.Channel:
    """One long-lived channel per peer; callers keep it for the life of the process."""
    credentials = security.channel_credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    interceptors = security.client_interceptors()
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def abort_on_errors(mapping: dict[type[Exception], grpc.StatusCode]):  # type: ignore[no-untyped-def]
    """Decorator factory: run a servicer method, turning a package's errors into status codes.

    Each package passes its own hierarchy, so the error -> status mapping lives in one place
    per service and handlers stay free of try/except boilerplate. Works for unary and
    server-streaming handlers alike.
    """

    def lookup(exc: Exception) -> grpc.StatusCode | None:
        for cls in type(exc).__mro__:
            if cls in mapping:
                return mapping[cls]
        return None

    def refuse(context: grpc.ServicerContext, code: grpc.StatusCode, rpc: str, exc: Exception) -> None:
        REJECTED.labels(code.name).inc()
        log.warning("%s from %s refused: %s: %s", rpc, context.peer(), code.name, exc)
        context.abort(code, str(exc))

    def decorate(method):  # type: ignore[no-untyped-def]
        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def stream_wrapper(self, request, context):  # type: ignore[no-untyped-def]
                try:
                    yield from method(self, request, context)
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    refuse(context, code, method.__name__, exc)

            return stream_wrapper

        @functools.wraps(method)
        def unary_wrapper(self, request, context):  # type: ignore[no-untyped-def]
            try:
                return method(self, request, context)
            except Exception as exc:
                code = lookup(exc)
                if code is None:
                    raise
                refuse(context, code, method.__name__, exc)

        return unary_wrapper

    return decorate
