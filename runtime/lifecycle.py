"""Process lifecycle pieces the three services share: signals, readiness, port files.

The member processes (PS shard, worker) put them together in ``pstrain.runtime.member``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from typing import Any

import grpc

from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.logs import LOG_LEVELS, log_level
from pstrain.runtime.security import add_security_flags

STOP_POLL_S = 0.1
"""How often a start-up wait looks at the stop event: SIGTERM must end it well within a unit's stop timeout."""


class Stopped(Exception):
    """A signal (the stop event) ended a wait during start-up: the orderly stop SIGTERM asks for, so exit 0."""


def stop_on_signals(stop: threading.Event, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """SIGTERM/SIGINT set ``stop``; the main thread then drains and exits 0 (systemd semantics).

    The Python-level handler must not touch ``stop`` itself: it runs in the main thread,
    possibly while that thread holds the event's lock inside ``stop.wait()``, and would
    deadlock. CPython's C handler writes the signal number to a wakeup pipe instead
    (async-signal-safe), and a watcher thread sets the event.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in signals:
        signal.signal(signum, lambda signum, frame: None)

    def watch() -> None:
        while not stop.is_set():
            if any(byte in signals for byte in os.read(read_fd, 64)):
                stop.set()

    threading.Thread(target=watch, name="signals", daemon=True).start()


def result_unless_stopped(
    future: grpc.Future, stop: threading.Event | None, what: str, timeout_s: float | None = None
) -> Any:
    """``future.result()``, waited on in slices of ``STOP_POLL_S`` so that a set ``stop`` cancels the future and
    raises ``Stopped`` at once, instead of holding a SIGTERM until gRPC gives up (minutes, for a start-up wait).

    ``timeout_s`` None: as long as the future takes (an RPC's own deadline ends it); else
    ``grpc.FutureTimeoutError`` after that long, the future cancelled. An RPC that fails raises its ``RpcError``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        slice_s = STOP_POLL_S if deadline is None else max(0.0, min(STOP_POLL_S, deadline - time.monotonic()))
        try:
            return future.result(timeout=slice_s)
        except grpc.FutureTimeoutError:
            if stop is not None and stop.is_set():
                future.cancel()
                raise Stopped(f"stopped while {what}") from None
            if deadline is not None and time.monotonic() >= deadline:
                future.cancel()
                raise


def wait_until_reachable(
    channel: grpc.Channel, address: str, timeout_s: float, stop: threading.Event | None = None
) -> None:
    """Block until the channel connects (gRPC's own readiness future, not a sleep loop); ``Stopped`` once
    ``stop`` is set (SIGTERM while the coordinator is still away)."""
    try:
        result_unless_stopped(grpc.channel_ready_future(channel), stop, f"waiting for {address}", timeout_s)
    except grpc.FutureTimeoutError:
        raise ConnectionError(f"could not reach {address} within {timeout_s:.0f}s") from None


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Publish the bound port atomically, so a launcher never reads half a number."""
    atomic_write(path, lambda fh: fh.write(f"{port}\n".encode()))


def sd_notify(state: str) -> bool:
    """Tell systemd about our state (``READY=1``, ``STOPPING=1``) on $NOTIFY_SOCKET (Type=notify).

    A few lines of socket code instead of a dependency; a no-op outside systemd.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def advertised_address(bind: str, port: int, host: str | None = None) -> str:
    """The address peers should dial: ``host`` if given, else the bind host, else this machine's FQDN.

    A wildcard bind (0.0.0.0, [::]) says nothing about how peers reach us, hence the FQDN.
    """
    if not host:
        bound = bind.rsplit(":", 1)[0]
        host = socket.getfqdn() if bound in ("", "0.0.0.0", "[::]", "::") else bound
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def add_common_flags(parser: argparse.ArgumentParser, default_bind: str) -> None:
    """Flags every service takes, so systemd units and the launcher pass them the same way."""
    parser.add_argument("--bind", default=default_bind, help="address to listen on (port 0 picks a free port)")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once serving")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: any free, -1: off)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="graceful-shutdown grace period in seconds")
    parser.add_argument(
        "--log-level", type=log_level, default="INFO", metavar="LEVEL", help=f"{', '.join(LOG_LEVELS)} (any case)"
    )
    add_security_flags(parser)
