"""The bytes of a bulk socket (issue 12), shared by both ends: the handshake's sizes and exact-length moves.

Why bulk sockets exist and how a shard serves them: ``ps_server.bulk``; the client's pool:
``runtime.bulk_client``. Payloads are a tensor's raw little-endian bytes (``protos.codec``'s
byte order), written from and read into the tensors' own memory.
"""

from __future__ import annotations

import select
import socket
import time

import torch

NONCE_BYTES = 16
TICKET_BYTES = 16
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024  # a 100 MB payload in fewer, larger system calls
# Sockets one worker (one incarnation) holds to one shard, idle and in use: a shard refuses the handshake of one more,
# and a client streams a call rather than open one more, so the two ends agree without a refusal.
MAX_SOCKETS_PER_WORKER = 64
MIN_TIMEOUT_S = 0.001  # a deadline already past still gets one non-blocking try (never a negative timeout)


def tune(sock: socket.socket) -> None:
    """No Nagle (the payload is one write; the reply waits for its end) and larger kernel buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable view of its memory (no copy)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("bulk payloads move between contiguous CPU tensors")
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def receive_exactly(sock: socket.socket, view: memoryview, timeout_s: float) -> None:
    """Fill ``view`` from ``sock``; ``OSError`` (``TimeoutError``, ``ConnectionError``) if it cannot."""
    deadline = time.monotonic() + timeout_s
    got, size = 0, len(view)
    while got < size:
        sock.settimeout(max(MIN_TIMEOUT_S, deadline - time.monotonic()))
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"bulk socket closed after {got} of {size} bytes")
        got += n


def send_all(sock: socket.socket, view: memoryview, timeout_s: float) -> None:
    """Write all of ``view`` within ``timeout_s`` in all (``sendall``'s timeout bounds the whole call); a
    deadline already past is a timeout (``TimeoutError``), never a ``ValueError``."""
    sock.settimeout(max(MIN_TIMEOUT_S, timeout_s))
    sock.sendall(view)


def readable(sock: socket.socket) -> bool:
    """The peer sent something (bytes, or its close) that no call has asked for yet; never blocks. Between calls
    neither end sends anything, so on a pooled socket this means a surplus or a close: not a socket to reuse."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except ValueError:  # closed already: nothing to reuse
        return True
    return bool(poller.poll(0))
