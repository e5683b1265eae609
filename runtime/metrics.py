"""Prometheus endpoint of a process; each service defines its own metrics in its package.

The default registry already carries ``process_resident_memory_bytes`` and the other
process collectors, so process memory comes for free.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, start_http_server

log = logging.getLogger(__name__)

REJECTED = Counter(
    "pstrain_rejected_requests_total", "Requests refused with an error status, by gRPC status code", ["code"]
)


def serve_metrics(bind_host: str, port: int) -> int:
    """Start the /metrics HTTP endpoint (port 0 picks a free one); returns the bound port, -1 if off."""
    if port < 0:
        return -1
    host = bind_host.strip("[]") or "0.0.0.0"
    server, _ = start_http_server(port, addr=host)
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
