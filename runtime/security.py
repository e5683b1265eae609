"""Transport security every service uses the same way: mutual TLS and a shared bearer token.

Both are optional and independent. With TLS every channel is mutually authenticated (the
server demands a client certificate signed by the cluster CA). With a token every RPC except
the health service must carry ``authorization: Bearer <token>``; the server compares it in
constant time and answers UNAUTHENTICATED otherwise. The token is never logged.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "PSTRAIN_TOKEN"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class SecurityError(ValueError):
    """Security settings that cannot work: a missing file, half a key pair, an empty token."""


@dataclass(frozen=True)
class TransportSecurity:
    ca_pem: bytes | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    token: str | None = None

    @property
    def tls(self) -> bool:
        return self.ca_pem is not None

    def __repr__(self) -> str:  # never print key material or the token
        return f"TransportSecurity(tls={self.tls}, token={'set' if self.token else 'unset'})"

    @classmethod
    def load(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token_file: str | None = None,
        env: dict[str, str] | None = None,
    ) -> TransportSecurity:
        """Read the files; the token comes from ``token_file``, else the PSTRAIN_TOKEN variable."""
        paths = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        given = {flag for flag, path in paths.items() if path}
        if given and given != set(paths):
            missing = ", ".join(sorted(set(paths) - given))
            raise SecurityError(f"mutual TLS needs --tls-ca, --tls-cert and --tls-key together; missing {missing}")
        pems = {flag: _read(path, flag) for flag, path in paths.items() if path}
        token = None
        if token_file:
            token = _read(token_file, "--token-file").decode().strip()
        else:
            token = (env if env is not None else os.environ).get(TOKEN_ENV) or None
        if token is not None and not token:
            raise SecurityError(f"the token in {token_file} is empty")
        return cls(pems.get("--tls-ca"), pems.get("--tls-cert"), pems.get("--tls-key"), token)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        assert self.key_pem is not None and self.cert_pem is not None
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenCheck(self.token)] if self.token else []

    def client_interceptors(self) -> list[Any]:
        return [TokenAttach(self.token)] if self.token else []


INSECURE = TransportSecurity()


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag}: cannot read {path}: {exc.strerror}") from exc


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--tls-ca", help="CA certificate (PEM) that signs every member's certificate")
    group.add_argument("--tls-cert", help="this process's certificate (PEM), used as server and client")
    group.add_argument("--tls-key", help="this process's private key (PEM)")
    group.add_argument("--token-file", help=f"file holding the shared bearer token (else ${TOKEN_ENV})")


def security_from_args(args: argparse.Namespace) -> TransportSecurity:
    return TransportSecurity.load(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that refuses the call."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every RPC but health checks unless it carries the shared bearer token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return handler
        reason = "missing" if not presented else "invalid"
        return _abort_handler(handler, f"{reason} bearer token: send metadata 'authorization: Bearer <token>'")


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class TokenAttach(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)
