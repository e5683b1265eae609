"""Process lifecycle pieces the three services share: signals, readiness, port files."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import grpc


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``; the main thread then drains and exits 0 (systemd semantics)."""

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def wait_until_reachable(channel: grpc.Channel, address: str, timeout_s: float) -> None:
    """Block until the channel connects (gRPC's own readiness future, not a sleep loop)."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ConnectionError(f"could not reach {address} within {timeout_s:.0f}s") from None


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Publish the bound port atomically, so a launcher never reads half a number."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(f"{port}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)


def advertised_address(bind: str, port: int, host: str | None = None) -> str:
    """The address peers should dial: ``host`` if given, else the bind host, else this machine's FQDN.

    A wildcard bind (0.0.0.0, [::]) says nothing about how peers reach us, hence the FQDN.
    """
    if not host:
        bound = bind.rsplit(":", 1)[0]
        host = socket.getfqdn() if bound in ("", "0.0.0.0", "[::]", "::") else bound
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
