"""Bulk sockets, the client's side (issue 12; the shard's side, and why they exist: ``ps_server.bulk``).

A ``PsClient`` keeps, per shard, idle sockets bound to the worker it pushes for: a push or pull
takes one for itself, names its ticket in the gRPC header and moves the payload as raw bytes
(``sendall`` from the tensor, ``recv_into`` the destination: no user-space copy). A socket goes
back to the pool only if the call went through whole; otherwise it is closed (the shard closes
its end too). A shard that refuses (TLS channel, bulk off, an older shard) is streamed to over gRPC from then
on. One whose bulk port cannot be reached (a firewall that drops it, a shard that is down) is
streamed to for ``RETRY_AFTER_S`` and then tried again: only one call per shard pays the
connect timeout for each try (the others stream meanwhile), and each failed try logs one
warning naming the shard and its port. A port that takes the connection but closes the handshake
(a shard restarted on its fixed port: the cached nonce is stale), or refuses the connection (a shard
restarted on an ephemeral port: the cached port is stale), is asked ``OpenBulk`` again once first.
A client holds at most ``MAX_SOCKETS_PER_WORKER`` sockets per shard (the shard's own cap); a call
beyond streams.

The socket connects to the host of the shard's gRPC address (the one the shard registered,
``--advertise-host``) at the port ``OpenBulk`` names (``--bulk-port``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.bulk_socket import (
    MAX_SOCKETS_PER_WORKER,
    NONCE_BYTES,
    TICKET_BYTES,
    byte_view,
    readable,
    receive_exactly,
    send_all,
    tune,
)
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, host_of

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 60.0  # a shard whose bulk port could not be reached is streamed to this long, then tried again
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# What a shard answers OpenBulk when it never offers bulk sockets: TLS or bulk off (FAILED_PRECONDITION), a shard that
# predates them (UNIMPLEMENTED). Any other refusal (an overloaded shard, an error) is tried again after the back-off.
_REFUSED_FOR_GOOD = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class HandshakeRejected(ConnectionError):
    """The bulk port took the connection, then closed it instead of answering the nonce: the shard restarted (a
    new nonce), or this worker holds as many sockets as the shard allows."""


@dataclass
class ClientSocket:
    sock: socket.socket
    ticket: bytes
    worker_id: int
    shard_id: int = -1

    def send(self, tensor: torch.Tensor, timeout_s: float) -> bool:
        """Write the tensor's bytes; False if the socket failed (the call's status says why) or the tensor cannot be
        sent from its memory (not on the CPU: the shard aborts the call and the stream refuses the tensor)."""
        return self._move(send_all, lambda: byte_view(tensor.contiguous()), timeout_s)

    def receive(self, into: torch.Tensor, timeout_s: float) -> bool:
        """Fill ``into``; False as for ``send``."""
        return self._move(receive_exactly, lambda: byte_view(into), timeout_s)

    def _move(
        self, how: Callable[[socket.socket, memoryview, float], None], view: Callable[[], memoryview], timeout_s: float
    ) -> bool:
        """On failure the socket is shut at once: the call is already under way, and the shard would otherwise wait
        its whole push or pull timeout for the payload (or to send it), holding a thread, a slot and the socket."""
        try:
            how(self.sock, view(), timeout_s)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            return False
        return True

    def abort_on_failure(self, call: grpc.Future) -> None:
        """If the call fails, shut the socket so a send or receive blocked on it returns at once."""

        def done(finished: grpc.Future) -> None:
            if finished.cancelled() or finished.exception() is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

        call.add_done_callback(done)


@dataclass
class BulkClient:
    """The pool of a client's bulk sockets, per shard; ``enabled`` False: always stream.

    Per shard: ``_off`` holds when to try bulk sockets again (``inf``: never, the shard refused them);
    ``_reached`` the shards whose port has taken a connection since the last failure (connects to them
    run in parallel; to any other, one call at a time tries while the rest stream). ``clock``: injectable
    for tests of the back-off."""

    addresses: list[str]
    open_bulk: list[Callable[..., pb.BulkGrant]]
    enabled: bool = True
    clock: Callable[[], float] = time.monotonic
    _off: dict[int, float] = field(default_factory=dict)  # shard -> when to try again
    _reached: set[int] = field(default_factory=set)
    _trying: set[int] = field(default_factory=set)  # shards with a first connect in flight
    _grants: dict[tuple[int, int], pb.BulkGrant] = field(default_factory=dict)
    _idle: dict[int, list[ClientSocket]] = field(default_factory=dict)
    _worker: dict[int, int] = field(default_factory=dict)  # shard -> the worker this client's sockets belong to
    _held: dict[int, int] = field(default_factory=dict)  # shard -> sockets open to it (idle, in use, being opened)
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def off(self) -> set[int]:
        """The shards streamed to now (refused, or unreachable and not yet due for another try)."""
        with self._lock:
            now = self.clock()
            return {shard for shard, until in self._off.items() if until > now}

    def checkout(self, shard_id: int, worker_id: int | None) -> ClientSocket | None:
        """A socket of ``worker_id`` (a pull: of the worker this client pushes for) to ``shard_id``, or None:
        stream this call."""
        with self._lock:
            if not self.enabled or self._closed or self._off.get(shard_id, -math.inf) > self.clock():
                return None
            if worker_id is None:
                worker_id = self._worker.get(shard_id)
                if worker_id is None:  # nobody pushed through this client yet (the coordinator's export)
                    return None
            found = self._idle_locked(shard_id, worker_id)
            if found is not None:
                return found
            if self._held.get(shard_id, 0) >= MAX_SOCKETS_PER_WORKER:  # the shard would refuse one more: stream
                return None
            probing = shard_id not in self._reached
            if probing:
                if shard_id in self._trying:  # another call is finding out whether the port answers: stream
                    return None
                self._trying.add(shard_id)
            grant = self._grants.get((shard_id, worker_id))
            self._held[shard_id] = self._held.get(shard_id, 0) + 1  # reserved while it opens
        opened = None
        try:
            opened = self._open(shard_id, worker_id, grant)
            return opened
        finally:
            with self._lock:
                if probing:
                    self._trying.discard(shard_id)
                if opened is None:
                    self._held[shard_id] -= 1

    def _idle_locked(self, shard_id: int, worker_id: int) -> ClientSocket | None:
        """An idle socket of ``worker_id`` that the shard has not closed; those it has are closed here too.

        An idle socket has nothing to read unless the shard closed its end (it restarted, retired or reaped it):
        used, it would cost a call that fails and a payload sent twice, once into it and once streamed."""
        idle = self._idle.setdefault(shard_id, [])
        for s in [s for s in idle if s.worker_id == worker_id]:
            idle.remove(s)
            if not readable(s.sock):
                return s
            self._held[shard_id] -= 1
            s.sock.close()  # its peer has closed: no wait
        return None

    def checkin(self, shard_id: int, s: ClientSocket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(shard_id, []).append(s)
                return
        s.sock.close()

    def discard(self, s: ClientSocket) -> None:
        """Close a socket after a call that failed (the shard closes its end too)."""
        with self._lock:
            if self._held.get(s.shard_id, 0) > 0:
                self._held[s.shard_id] -= 1
        s.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for s in sockets:
            s.sock.close()

    def _open(self, shard_id: int, worker_id: int, grant: pb.BulkGrant | None) -> ClientSocket | None:
        """Connect with the cached grant, or a fresh one. A handshake the port rejects with a cached grant (a shard
        restarted on its fixed port: a new nonce), or a port that refuses the connection (a shard restarted on an
        ephemeral port, ``--bulk-port 0``: a new port), asks ``OpenBulk`` again once before the port counts as
        unreachable; a port that does not answer (a firewall that drops it) is not asked twice.
        """
        for cached in (grant is not None, False):
            if grant is None:
                grant = self._grant(shard_id, worker_id)
                if grant is None:
                    return None
            try:
                s = self._connect(shard_id, worker_id, grant)
            except (HandshakeRejected, ConnectionRefusedError) as exc:  # a new nonce, or a new (ephemeral) port
                if cached:
                    with self._lock:
                        self._grants.pop((shard_id, worker_id), None)
                    grant = None
                    continue
                self._unreachable(shard_id, grant.port, exc)
                return None
            except OSError as exc:
                self._unreachable(shard_id, grant.port, exc)
                return None
            break
        with self._lock:
            if shard_id not in self._reached:
                self._reached.add(shard_id)
                if shard_id in self._off:
                    del self._off[shard_id]
                    log.info("shard %d at %s: bulk sockets work again", shard_id, self.addresses[shard_id])
        return s

    def _grant(self, shard_id: int, worker_id: int) -> pb.BulkGrant | None:
        """A fresh grant, cached; None if the shard refused (TLS, bulk off, an older shard: stream from now on) or
        could not answer now."""
        try:
            grant = self.open_bulk[shard_id](
                pb.BulkRequest(shard_id=shard_id, worker_id=worker_id), timeout=CONTROL_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            if exc.code() in _REFUSED_FOR_GOOD:
                self._refused(shard_id, f"OpenBulk: {exc.code().name}")
            elif exc.code() not in _TRANSIENT:
                self._back_off(shard_id, f"OpenBulk: {exc.code().name}: {exc.details()}")
            return None
        with self._lock:
            self._grants[(shard_id, worker_id)] = grant
            self._worker.setdefault(shard_id, worker_id)
        return grant

    def _refused(self, shard_id: int, why: str) -> None:
        with self._lock:
            if self._off.get(shard_id) == math.inf:
                return
            self._off[shard_id] = math.inf
        log.info("shard %d at %s: no bulk sockets (%s); streaming over gRPC", shard_id, self.addresses[shard_id], why)

    def _back_off(self, shard_id: int, why: str) -> None:
        """Stream to the shard for ``RETRY_AFTER_S``, then ask it for a grant again."""
        with self._lock:
            now = self.clock()
            if self._off.get(shard_id, -math.inf) > now:
                return
            self._off[shard_id] = now + RETRY_AFTER_S
        log.warning(
            "shard %d at %s refused a bulk socket (%s); streaming over gRPC, asking again in %.0f s",
            shard_id,
            self.addresses[shard_id],
            why,
            RETRY_AFTER_S,
        )

    def _unreachable(self, shard_id: int, port: int, exc: OSError) -> None:
        """Stream to the shard for ``RETRY_AFTER_S``; its grants are asked again then (the shard may have restarted
        with a new nonce or port). One warning per failed try, at most one try per shard per ``RETRY_AFTER_S``."""
        with self._lock:
            now = self.clock()
            if self._off.get(shard_id, -math.inf) > now:  # another call failed first and has said so
                return
            self._off[shard_id] = now + RETRY_AFTER_S
            self._reached.discard(shard_id)
            for key in [key for key in self._grants if key[0] == shard_id]:
                del self._grants[key]
        hint = (
            "the shard closed the handshake of a fresh grant: this worker may hold all the sockets it allows"
            if isinstance(exc, HandshakeRejected)
            else "open that port to the workers, the PS flag --bulk-port, or set transport.bulk_sockets: off"
        )
        log.warning(
            "shard %d: cannot open a bulk socket to %s port %d (%s); streaming its tensors over gRPC and trying the "
            "bulk port again in %.0f s (%s)",
            shard_id,
            host_of(self.addresses[shard_id]),
            port,
            exc,
            RETRY_AFTER_S,
            hint,
        )

    def _connect(self, shard_id: int, worker_id: int, grant: pb.BulkGrant) -> ClientSocket:
        host = host_of(self.addresses[shard_id]).strip("[]")
        sock = socket.create_connection((host, grant.port), timeout=CONNECT_TIMEOUT_S)
        try:
            tune(sock)
            if len(grant.nonce) != NONCE_BYTES:
                raise ConnectionError(f"a nonce of {len(grant.nonce)} bytes")
            send_all(sock, memoryview(grant.nonce), CONNECT_TIMEOUT_S)
            ticket = bytearray(TICKET_BYTES)
            receive_exactly(sock, memoryview(ticket), CONNECT_TIMEOUT_S)
        except ConnectionError as exc:  # closed or reset by the shard (a timeout is an unanswered port)
            sock.close()
            raise HandshakeRejected(f"the bulk port closed the handshake ({exc})") from exc
        except OSError:
            sock.close()
            raise
        return ClientSocket(sock, bytes(ticket), worker_id, shard_id)
