"""Transport security every service uses the same way: mutual TLS and a shared bearer token.

Both are optional and independent. With TLS every channel is mutually authenticated (the
server demands a client certificate signed by the cluster CA). With a token every RPC except
the health service must carry ``authorization: Bearer <token>``; the server compares it in
constant time and answers UNAUTHENTICATED otherwise (counted and logged by ``refusals``, never
the token).

Secure by default: a service that listens on anything but loopback with neither a token nor TLS
refuses to start (``check_exposure``, exit 2) unless the operator passes ``--insecure``, which is
logged as a warning. ``pstrain local`` binds 127.0.0.1 and needs neither.

Each member also presents its own credential (``identity``) on every call of its channels: the
bearer token says "one of us", the credential says "which one".
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pstrain.runtime.identity import IdentityHolder
from pstrain.runtime.refusals import note_refusal

log = logging.getLogger(__name__)

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
    paths: tuple[str, str, str] | None = None  # (ca, cert, key) files: the metrics endpoint's TLS needs paths
    identity: IdentityHolder | None = None  # this member's credential, attached to every call once registered

    @property
    def tls(self) -> bool:
        return self.ca_pem is not None

    def with_identity(self, identity: IdentityHolder) -> TransportSecurity:
        return dataclasses.replace(self, identity=identity)

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
        """Read the files; the token comes from ``token_file``, else the PSTRAIN_TOKEN variable (both stripped).

        The TLS files are checked here (``check_tls_files``), so that a wrong one is a ``SecurityError`` naming it
        (exit 2, no restart) rather than gRPC's "Failed to bind" at the first server, or a server that starts and
        refuses every peer."""
        paths = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        given = {flag for flag, path in paths.items() if path}
        if given and given != set(paths):
            missing = ", ".join(sorted(set(paths) - given))
            raise SecurityError(f"mutual TLS needs --tls-ca, --tls-cert and --tls-key together; missing {missing}")
        pems = {flag: _read(path, flag) for flag, path in paths.items() if path}
        files = (ca, cert, key) if ca and cert and key else None
        if files is not None:
            check_tls_files(*files)
        token = None
        if token_file:
            token = _read(token_file, "--token-file").decode().strip()
            if not token:
                raise SecurityError(f"--token-file: the token in {token_file} is empty")
        else:
            variable = (env if env is not None else os.environ).get(TOKEN_ENV)
            if variable is not None:  # set: it is the token, stripped as a file's is; an empty one is a mistake
                token = variable.strip()
                if not token:
                    raise SecurityError(
                        f"${TOKEN_ENV} is set but empty: set it to the token, or unset it to run without one"
                    )
        return cls(pems.get("--tls-ca"), pems.get("--tls-cert"), pems.get("--tls-key"), token, files)

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
        interceptors: list[Any] = [TokenAttach(self.token)] if self.token else []
        if self.identity is not None:
            interceptors.append(HeaderAttach(self.identity.headers))
        return interceptors


INSECURE = TransportSecurity()


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag}: cannot read {path}: {exc.strerror}") from exc


def check_tls_files(ca: str, cert: str, key: str) -> None:
    """``SecurityError`` naming the file unless ``cert`` holds a certificate, ``key`` its private key, ``ca`` a CA, and
    the CA signs ``cert`` for the two uses it is put to (a server's and a client's, each side of mutual TLS)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert)):
        try:
            probe.load_verify_locations(cafile=path)
        except ssl.SSLError as exc:
            raise SecurityError(f"{flag}: {path} holds no PEM certificate ({_ssl_reason(exc)})") from None
    server, client = _tls_context(ca, cert, key, ssl.PROTOCOL_TLS_SERVER), _tls_context(ca, cert, key)
    try:
        _handshake(server, client)
    except ssl.SSLCertVerificationError as exc:
        raise SecurityError(
            f"--tls-cert: {cert} does not verify against the CA in --tls-ca {ca} ({exc.verify_message}): "
            "pass the CA that signed it, or a certificate it signed"
        ) from None
    except ssl.SSLError as exc:
        raise SecurityError(f"--tls-cert {cert} with --tls-key {key}: mutual TLS fails ({_ssl_reason(exc)})") from None


def _tls_context(ca: str, cert: str, key: str, protocol: int = ssl.PROTOCOL_TLS_CLIENT) -> ssl.SSLContext:
    """A context as gRPC makes one from the files: this process's pair, demanding a peer the CA signed."""

    def no_password() -> str:
        raise SecurityError(f"--tls-key: {key} is encrypted; gRPC needs the key without a passphrase")

    context = ssl.SSLContext(protocol)
    context.check_hostname = False  # peers are dialled by address; the chain is what is checked here
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # whether the files fit together, not Python's policy on key sizes
    context.load_verify_locations(cafile=ca)
    try:
        context.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        raise SecurityError(
            f"--tls-key: {key} is not the private key of --tls-cert {cert} ({_ssl_reason(exc)}): pass the key made "
            "with that certificate"
        ) from None
    return context


def _handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> None:
    """A mutual TLS handshake in memory between two contexts: each verifies the other's certificate (this one's)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_context.wrap_bio(to_server, to_client, server_side=True)
    client = client_context.wrap_bio(to_client, to_server, server_side=False)
    pending = {server, client}
    for _ in range(16):  # a TLS 1.3 handshake takes 2 round trips; a few more leave room for any other
        for side in list(pending):
            try:
                side.do_handshake()
                pending.discard(side)
            except ssl.SSLWantReadError:
                pass
        if not pending:
            return
    raise ssl.SSLError("the handshake did not complete")


def _ssl_reason(exc: ssl.SSLError) -> str:
    return exc.reason or exc.strerror or str(exc)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--tls-ca", help="CA certificate (PEM) that signs every member's certificate")
    group.add_argument("--tls-cert", help="this process's certificate (PEM), used as server and client")
    group.add_argument("--tls-key", help="this process's private key (PEM)")
    group.add_argument("--token-file", help=f"file holding the shared bearer token (else ${TOKEN_ENV})")
    group.add_argument(
        "--metrics-host",
        help="address /metrics listens on (default: 127.0.0.1; with mutual TLS the --bind host, HTTPS with client "
        "certificates)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address with neither a token nor TLS (anyone who reaches the port "
        "may join, push and read the model)",
    )


def security_from_args(args: argparse.Namespace) -> TransportSecurity:
    """The settings, refused (SecurityError, exit 2) when they would expose the service (``check_exposure``)."""
    security = TransportSecurity.load(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)
    bind = getattr(args, "bind", None)
    if bind is not None:
        check_exposure(bind, security, getattr(args, "insecure", False))
    return security


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(bind: str, security: TransportSecurity, insecure: bool) -> None:
    """Refuse to listen beyond loopback with neither a token nor mTLS, unless ``insecure`` (then warn)."""
    host = bind.rsplit(":", 1)[0]
    if security.token or security.tls or is_loopback(host):
        return
    if insecure:
        log.warning(
            "--insecure: listening on %s with neither a token nor TLS; anyone who reaches it can join the job", bind
        )
        return
    raise SecurityError(
        f"refusing to listen on {bind} with neither a token nor TLS: pass --token-file FILE (or set ${TOKEN_ENV}), "
        "or --tls-ca/--tls-cert/--tls-key for mutual TLS, or bind 127.0.0.1; --insecure starts anyway"
    )


def _abort_handler(handler: grpc.RpcMethodHandler, message: str, method: str = "") -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that refuses the call."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        note_refusal(grpc.StatusCode.UNAUTHENTICATED, method, context.peer(), message)
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
        message = f"{reason} bearer token: send metadata 'authorization: Bearer <token>'"
        return _abort_handler(handler, message, handler_call_details.method)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class HeaderAttach(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the headers ``headers()`` returns at call time to every call of a channel."""

    def __init__(self, headers: Callable[[], list[tuple[str, str]]]) -> None:
        self._headers = headers

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        extra = self._headers()
        return _CallDetails(details, [*(details.metadata or ()), *extra]) if extra else details

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


class TokenAttach(HeaderAttach):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        header = [("authorization", f"Bearer {token}")]
        super().__init__(lambda: header)
