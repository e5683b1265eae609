"""gRPC plumbing every service uses the same way: message limits, servers, channels.

Servers come with the standard health service and server reflection, so grpcurl works
without .proto files and load balancers/systemd can ask whether a service is ready.

A server is a thread-pool server, or with ``aio=True`` an asyncio server whose event loop runs
in a thread of its own: ``async def`` handlers run on the loop and hold no thread while they
wait (a parameter server's pulls park there by the hundred), plain handlers run in the thread
pool as before. Callers see the same ``ServingServer`` either way.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.refusals import note_refusal
from pstrain.runtime.security import INSECURE, TransportSecurity

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
RECONNECT_BACKOFF_MS = (250, 1000)
"""A lost peer is tried again after 0.25 s, then about once a second (gRPC adds its jitter): a down
service sees about one connection attempt per second per client, and a client is back within a
second of its peer."""
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC's default reconnect backoff grows to 2 min: a member would call a coordinator that is back
    # (``systemctl restart`` after an outage) only seconds later, past its reattach window.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
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


class AsyncioServer:
    """A ``grpc.aio.Server`` and the event loop it runs on, in a daemon thread of its own.

    ``stop`` also lets the server go: gRPC's asyncio layer keeps a poller thread alive while
    any of its servers exists, and one still alive when the interpreter exits can abort the
    process ("terminate called without an active exception").
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None

    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the loop and wait for its result in the calling thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def stop(self, grace_s: float) -> None:
        if self.loop.is_closed():
            return
        try:
            if self.server is not None:
                self.run(self.server.stop(grace_s))
            self.run(self.loop.shutdown_default_executor())  # handlers' asyncio.to_thread calls
        finally:
            self.server = None
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
            gc.collect()  # the server's and its calls' cycles: the last one out stops gRPC's poller


@dataclass
class ServingServer:
    """A started gRPC server, the port it bound, and its health service."""

    server: grpc.Server | AsyncioServer
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
        if isinstance(self.server, AsyncioServer):
            self.server.stop(grace_s)
        else:
            self.server.stop(grace_s).wait()


def start_server(
    address: str,
    register: Iterable[tuple[object, object]],
    service_names: Iterable[str],
    security: TransportSecurity = INSECURE,
    max_workers: int = 32,
    aio: bool = False,
) -> ServingServer:
    """Bind ``address`` (port 0 picks a free one), add servicers, health and reflection, start.

    ``register`` holds ``(add_XServicer_to_server, servicer)`` pairs. Health starts as
    NOT_SERVING: each service flips it once it is really ready. With ``security`` the port
    demands mutual TLS and/or the bearer token (health stays open). ``aio`` makes an asyncio
    server (see the module docstring); ``max_workers`` sizes the pool for plain handlers.
    """
    names = tuple(full_service_name(n) for n in service_names)
    health_servicer = health.HealthServicer()
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server")

    def build(server: Any) -> int:
        for add, servicer in register:
            add(servicer, server)  # type: ignore[operator]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        credentials = security.server_credentials()
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {address}")
        return int(port)

    if aio:
        runner = AsyncioServer()

        async def start_aio() -> int:
            server = grpc.aio.server(
                migration_thread_pool=pool,
                options=SERVER_OPTIONS,
                interceptors=[AsyncInterceptor(i) for i in security.server_interceptors()],
            )
            runner.server = server
            port = build(server)
            await server.start()
            return port

        try:
            port = runner.run(start_aio())
        except BaseException:
            runner.stop(0)
            raise
        serving = ServingServer(runner, port, health_servicer, names)
    else:
        server = grpc.server(pool, options=SERVER_OPTIONS, interceptors=security.server_interceptors())
        port = build(server)
        server.start()
        serving = ServingServer(server, port, health_servicer, names)
    serving.set_serving(False)
    return serving


class AsyncInterceptor(grpc.aio.ServerInterceptor):
    """Runs a thread-pool server's interceptor (``security.TokenCheck``) on an asyncio server.

    A handler the inner interceptor substitutes (a refusal) is a plain function; on an asyncio
    server a plain response-streaming function is called on the event loop itself, where its
    blocking ``context.abort`` would deadlock, so it is turned into a generator, which the
    server runs in its thread pool.
    """

    def __init__(self, inner: grpc.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        chosen = self._inner.intercept_service(lambda _details: handler, handler_call_details)
        if chosen is handler or chosen is None or not chosen.response_streaming:
            return chosen
        if chosen.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _in_pool(chosen.stream_stream), chosen.request_deserializer, chosen.response_serializer
            )
        return grpc.unary_stream_rpc_method_handler(
            _in_pool(chosen.unary_stream), chosen.request_deserializer, chosen.response_serializer
        )


def _in_pool(behaviour: Callable[..., Any]) -> Callable[..., Iterator[Any]]:
    if inspect.isgeneratorfunction(behaviour) or inspect.isasyncgenfunction(behaviour):
        return behaviour

    def deferred(request: Any, context: Any) -> Iterator[Any]:
        yield from behaviour(request, context) or ()

    return deferred


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
    server-streaming handlers alike, plain or ``async`` (an asyncio server's).
    """

    def lookup(exc: Exception) -> grpc.StatusCode | None:
        for cls in type(exc).__mro__:
            if cls in mapping:
                return mapping[cls]
        return None

    def refuse(context: grpc.ServicerContext, code: grpc.StatusCode, rpc: str, exc: Exception) -> None:
        note_refusal(code, rpc, context.peer(), str(exc))
        context.abort(code, str(exc))

    async def refuse_async(context: grpc.aio.ServicerContext, code: grpc.StatusCode, rpc: str, exc: Exception) -> None:
        note_refusal(code, rpc, context.peer(), str(exc))
        await context.abort(code, str(exc))

    def decorate(method):  # type: ignore[no-untyped-def]
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def async_stream_wrapper(self, request, context):  # type: ignore[no-untyped-def]
                try:
                    async for item in method(self, request, context):
                        yield item
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    await refuse_async(context, code, method.__name__, exc)

            return async_stream_wrapper

        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def async_unary_wrapper(self, request, context):  # type: ignore[no-untyped-def]
                try:
                    return await method(self, request, context)
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    await refuse_async(context, code, method.__name__, exc)

            return async_unary_wrapper

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
