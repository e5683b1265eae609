"""Prometheus endpoint of a process; each service defines its own metrics in its package.

The default registry already carries ``process_resident_memory_bytes`` and the other
process collectors, so process memory comes for free.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import Counter, start_http_server

if TYPE_CHECKING:  # security imports this module (refusals count here)
    from pstrain.runtime.security import TransportSecurity

log = logging.getLogger(__name__)

REJECTED = Counter(
    "pstrain_rejected_requests_total", "Requests refused with an error status, by gRPC status code", ["code"]
)


def serve_metrics(bind_host: str, port: int, security: TransportSecurity | None = None, host: str | None = None) -> str:
    """Start the /metrics endpoint (port 0 picks a free one); returns ``host:port`` bound, "" if off.

    Who may read it (issue 8): with mutual TLS it listens on the services' bind host over HTTPS and
    demands a client certificate of the cluster CA, like the gRPC ports; otherwise it is plain HTTP
    on loopback (``127.0.0.1``) unless the operator names another ``host`` (``--metrics-host``).
    """
    if port < 0:
        return ""
    tls = security is not None and security.paths is not None
    chosen = (host or (bind_host.strip("[]") or "0.0.0.0")) if tls else (host or "127.0.0.1")
    if tls:
        assert security is not None and security.paths is not None
        ca, cert, key = security.paths
        server, _ = start_http_server(
            port, addr=chosen, certfile=cert, keyfile=key, client_cafile=ca, client_auth_required=True
        )
    else:
        server, _ = start_http_server(port, addr=chosen)
    bound = int(server.server_port)
    log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", chosen, bound)
    return f"{chosen}:{bound}"
