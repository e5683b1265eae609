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
import errno
import functools
import gc
import inspect
import logging
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
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


class BindError(OSError):
    """A server could not listen on its address: not this host's, or (with TLS) gRPC refused the certificate and
    key (``security.check_tls_files`` catches what it can before). Settings that cannot work: exit 2."""


class PortInUse(BindError):
    """Another process holds the port: often one that is still stopping (a restart), so worth starting again
    later (exit 1, which systemd restarts), unlike the other ``BindError`` s."""


def _host_is_ours(address: str) -> bool:
    """Whether this host can listen on ``address``'s host at all (any port): then gRPC's failure to bind it was the
    port, taken, or taken a moment ago by a process that has gone since (gRPC's own error does not say which)."""
    host = address.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host if host not in ("", "*") else "", 0))
    except OSError:
        return False
    return True


def full_service_name(short: str) -> str:
    return pb.DESCRIPTOR.services_by_name[short].full_name


def is_poller_wakeup_race(exc: BaseException | None) -> bool:
    """``exc`` is gRPC asyncio's ``PollerCompletionQueue._handle_events`` reading a socket already closed (EBADF)
    or already drained by another wake-up (EAGAIN; grpc/grpc#25364)."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.EBADF, errno.EAGAIN):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name.endswith("_handle_events"):
            return True
        tb = tb.tb_next
    return False


class AsyncioServer:
    """A ``grpc.aio.Server`` and the event loop it runs on, in a daemon thread of its own.

    ``stop`` also lets the server go: gRPC's asyncio layer keeps a poller thread alive while
    any of its servers exists, and one still alive when the interpreter exits can abort the
    process ("terminate called without an active exception").
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopping = False
        self.loop.set_exception_handler(self._report)
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None

    def _report(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's errors, less one that is gRPC's own race: while a server stops right after it started, the
        poller's wake-up callback may run once its socket is closed (EBADF, logged with a traceback by asyncio's
        default handler, though nothing failed)."""
        if self.stopping and is_poller_wakeup_race(context.get("exception")):
            log.debug("gRPC's poller woke up after its socket closed, as the server stopped; nothing lost")
            return
        loop.default_exception_handler(context)

    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the loop and wait for its result in the calling thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def stop(self, grace_s: float) -> None:
        if self.loop.is_closed():
            return
        self.stopping = True
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

    ``register`` holds ``(add_XServicer_to_server, servicer)`` pairs; each is handed the server through
    ``TolerantRegistrar``, so a malformed request reaches an ``abort_on_errors`` handler as ``Malformed``.
    Health starts as NOT_SERVING: each service flips it once it is really ready. With ``security`` the port
    demands mutual TLS and/or the bearer token (health stays open). ``aio`` makes an asyncio
    server (see the module docstring); ``max_workers`` sizes the pool for plain handlers.
    """
    names = tuple(full_service_name(n) for n in service_names)
    health_servicer = health.HealthServicer()
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server")

    def build(server: Any) -> int:
        for add, servicer in register:
            add(servicer, TolerantRegistrar(server))  # type: ignore[operator]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        credentials = security.server_credentials()
        cause: RuntimeError | None = None
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:  # gRPC's "Failed to bind to address"
            port, cause = 0, exc
        if port == 0:
            tls = " (or gRPC refused the TLS certificate and key: its log line above says which)" if credentials else ""
            if _host_is_ours(address):  # the TLS files were checked before (``check_tls_files``): the port it is
                raise PortInUse(f"cannot listen on {address}: another process holds the port{tls}") from cause
            raise BindError(f"cannot listen on {address}: the host has no such address; pass another --bind") from cause
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


# ---------------------------------------------------------------------- malformed requests
#
# gRPC calls a method's request deserializer before its handler; one that raises (protobuf's DecodeError on bytes that
# are not the message) makes gRPC answer UNKNOWN (asyncio server) or INTERNAL (thread-pool server) with a traceback
# in the log, past the refusal count and its rate limit. So every handler that ``abort_on_errors`` wraps is registered
# with a deserializer that never raises (``tolerant``): it hands over ``Malformed``, which the wrapper refuses as
# INVALID_ARGUMENT through ``note_refusal``, like any other refusal. A malformed message is refused before the caller's
# credential is checked: the credential's member id is a field of the message.


@dataclass(frozen=True)
class Malformed:
    """A request message that did not parse, as a tolerant deserializer hands it to the handler."""

    reason: str


class MalformedRequest(Exception):
    """A request, or a message of a request stream, that did not parse: INVALID_ARGUMENT wherever it is raised."""


def tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """``deserialize`` that returns ``Malformed`` instead of raising; the reason names the message type."""
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    name = message_type.name if message_type is not None else f"{method} request"

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:
            reason = str(exc) if str(exc).startswith("malformed ") else f"malformed {name}: {exc}"
            return Malformed(f"{reason} (send the message pstrain.proto defines for {method})")

    return parse


_HANDLER_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def tolerant_handler(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """``handler`` with a ``tolerant`` request deserializer, if its behaviour refuses ``Malformed``
    (``abort_on_errors``); any other handler is left as it is (it would be handed a ``Malformed`` it cannot read)."""
    if handler is None or handler.request_deserializer is None:
        return handler
    attribute, make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    behaviour = getattr(handler, attribute)
    if not getattr(behaviour, "refuses_malformed", False):
        return handler
    short = method.rsplit("/", 1)[-1]
    return make(
        behaviour,
        request_deserializer=tolerant(handler.request_deserializer, short),
        response_serializer=handler.response_serializer,
    )


class _TolerantGeneric(grpc.GenericRpcHandler):
    """A generic handler whose handlers get ``tolerant`` deserializers (made once per method it serves; a name it
    does not serve is not remembered, so callers cannot grow the cache with made-up method names)."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._made: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        made = self._made.get(method)
        if made is None:
            made = tolerant_handler(self._inner.service(handler_call_details), method)
            if made is None:
                return None
            self._made[method] = made
        return made


class TolerantRegistrar:
    """The server as ``start_server`` hands it to each ``add_...`` function (generated or ours): the handlers they
    register get ``tolerant`` request deserializers (``tolerant_handler``); everything else goes to the server."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_TolerantGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        made = {name: tolerant_handler(h, f"/{service}/{name}") for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, made)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def _parsed(request: Any) -> Any:
    """A handler's request, refused if it did not parse; a request stream, refused at its first message that did not."""
    if isinstance(request, Malformed):
        raise MalformedRequest(request.reason)
    if isinstance(request, Iterator):
        return _parsed_stream(request)
    if isinstance(request, AsyncIterator):
        return _parsed_async_stream(request)
    return request


def _parsed_stream(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Malformed):
            raise MalformedRequest(request.reason)
        yield request


async def _parsed_async_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            raise MalformedRequest(request.reason)
        yield request


def abort_on_errors(mapping: dict[type[Exception], grpc.StatusCode]):  # type: ignore[no-untyped-def]
    """Decorator factory: run a servicer method, turning a package's errors into status codes.

    Each package passes its own hierarchy, so the error -> status mapping lives in one place
    per service and handlers stay free of try/except boilerplate. Works for unary and
    server-streaming handlers alike, plain or ``async`` (an asyncio server's). A request that did
    not parse (``Malformed``, from the ``tolerant`` deserializer ``start_server`` registers) is
    INVALID_ARGUMENT before the method runs; one message of a request stream, when the method reads it.
    """
    mapping = {MalformedRequest: grpc.StatusCode.INVALID_ARGUMENT, **mapping}

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
                    async for item in method(self, _parsed(request), context):
                        yield item
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    await refuse_async(context, code, method.__name__, exc)

            async_stream_wrapper.refuses_malformed = True  # type: ignore[attr-defined]
            return async_stream_wrapper

        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def async_unary_wrapper(self, request, context):  # type: ignore[no-untyped-def]
                try:
                    return await method(self, _parsed(request), context)
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    await refuse_async(context, code, method.__name__, exc)

            async_unary_wrapper.refuses_malformed = True  # type: ignore[attr-defined]
            return async_unary_wrapper

        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def stream_wrapper(self, request, context):  # type: ignore[no-untyped-def]
                try:
                    yield from method(self, _parsed(request), context)
                except Exception as exc:
                    code = lookup(exc)
                    if code is None:
                        raise
                    refuse(context, code, method.__name__, exc)

            stream_wrapper.refuses_malformed = True  # type: ignore[attr-defined]
            return stream_wrapper

        @functools.wraps(method)
        def unary_wrapper(self, request, context):  # type: ignore[no-untyped-def]
            try:
                return method(self, _parsed(request), context)
            except Exception as exc:
                code = lookup(exc)
                if code is None:
                    raise
                refuse(context, code, method.__name__, exc)

        unary_wrapper.refuses_malformed = True  # type: ignore[attr-defined]
        return unary_wrapper

    return decorate
