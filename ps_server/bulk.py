"""Bulk sockets (issue 12): the remote data plane's payload bytes, outside gRPC.

gRPC Python copies every message three times in user space besides the serializers' own (into a
slice to send it; a ``bytes`` per received slice, then their join), on top of the kernel's two.
Measured on loopback, push+pull of 100 MB through bare gRPC messages (no protobuf at all) stays
near 0.4x raw TCP whatever the chunk size, so the remote path reaches the 0.6x target only by
moving the payload elsewhere. A bulk socket carries payload bytes and nothing else: the sender
writes straight from the tensor's memory (``sendall``), the receiver reads straight into its
destination (``recv_into``), so the only copies are the kernel's, as for raw TCP.

Every header, check, error and acknowledgement stays on gRPC (``PushBulk`` and ``PullBulk``, unary calls whose
header names a ``bulk_ticket``; the Push and Pull streams take one too, for older workers), so the stream's
semantics hold unchanged.

Handshake: a worker gets a nonce from ``OpenBulk`` (an authenticated RPC, only for its own
credential, never over TLS, since these bytes are plaintext), connects to the shard's bulk port
and sends the nonce; the shard answers with a fresh ticket naming that socket, bound to that
worker (and its credential's incarnation). A call takes its socket for itself and gives it back only
if it moved exactly its payload and succeeded; otherwise (a refusal before or after the payload, a
duplicate, a timeout, a cancel) the socket is closed, so a socket never holds stray bytes, and the
client, which keeps its end only after a call that succeeded, opens another. A bulk pull names the
elements it will read (``bulk_numel``): another size is refused before a byte is sent.

Where: the port listens on the host the shard's gRPC server binds (``--bind``; a wildcard: every
interface), on ``--bulk-port`` (0, the default: an ephemeral port; a fixed one for a firewall).
``OpenBulk`` names only the port: a client connects to the host it reached the shard's gRPC at,
the address the shard registered (``--advertise-host``), never to an address the shard guesses.
``--no-bulk`` or ``transport.bulk_sockets: off`` refuse every grant, so every client streams.

A call names its ticket in the clear; the socket it names is checked out only after the caller's
credential is checked (a push: ``ShardGate.check_push``; a pull: a member's credential, then the ticket's
owner, ``owner``), and a ticket named with another worker's id is refused without touching the
socket: a peer that has seen a ticket but lacks its worker's credential can neither use nor close
that worker's socket, and a caller without a credential is refused alike whether the ticket exists.

Bounds (``BulkSockets``): ``MAX_HANDSHAKES`` connections waiting ``HANDSHAKE_TIMEOUT_S`` for their
nonce, ``MAX_SOCKETS_PER_WORKER`` sockets per worker incarnation; the data plane moves payloads on
``BULK_IO_THREADS`` threads of its own, each move bounded by the job's push or pull timeout.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pstrain.ps_server.errors import InvalidArgument, NotReady, PsError, WaitTimeout
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

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 2.0  # a connection that has not sent its nonce by then is closed
MAX_HANDSHAKES = 32  # connections waiting for their nonce at once; one more is closed at once (a thread each)
ACCEPT_BACKOFF_S = 0.1  # after a failed accept (out of file descriptors: the connection stays queued)
COMPLAIN_EVERY_S = 60.0  # at most one warning about failing accepts this often
JOIN_ACCEPT_S = 5.0  # close() waits this long for the accept thread to see its listener shut

Owner = tuple[int, int]  # (worker id, incarnation of its credential; 0 without credentials)


class StaleBulk(PsError):
    """The call names a bulk socket this shard does not have (closed, busy or never opened), or asks a grant for a
    worker process its successor replaced: ABORTED."""


class BulkRefused(PsError):
    """Bulk sockets are off here, or the call came over TLS (FAILED_PRECONDITION: stream instead)."""


class BulkStopping(NotReady, BulkRefused):
    """The shard is stopping: its bulk port is closed while gRPC still drains (UNAVAILABLE, through ``NotReady``).

    Not FAILED_PRECONDITION: a client takes that as "this shard never offers bulk sockets" and streams to it for
    good, even after the shard is restarted on the same address; UNAVAILABLE is a passing reason, asked again."""


@dataclass
class BulkSocket:
    """One connected socket, the worker (incarnation) it belongs to and its ticket; ``moved``: this call's payload
    went through whole (the socket is reused only if, besides, the call succeeded)."""

    sock: socket.socket
    worker_id: int
    ticket: bytes
    incarnation: int = 0
    moved: bool = False

    @property
    def owner(self) -> Owner:
        return (self.worker_id, self.incarnation)

    def receive(self, into: torch.Tensor, timeout_s: float) -> None:
        """Read exactly ``into``'s bytes; a peer that sent more than its header's size is refused before the shard
        sees the payload: the surplus would otherwise lie on the socket and open its next payload, shifting it."""
        self._move(receive_exactly, byte_view(into), timeout_s)  # the staging buffer: contiguous
        if _surplus(self.sock):
            self.moved = False  # the socket is closed with the call: its surplus goes with it
            raise InvalidArgument(
                f"the bulk socket carried more than the header's {into.numel()} elements "
                f"({into.numel() * into.element_size()} bytes); send exactly the header's numel"
            )

    def send(self, tensor: torch.Tensor, timeout_s: float) -> None:
        self._move(send_all, byte_view(tensor), timeout_s)

    def _move(
        self, how: Callable[[socket.socket, memoryview, float], None], view: memoryview, timeout_s: float
    ) -> None:
        try:
            how(self.sock, view, timeout_s)
        except TimeoutError as exc:
            raise WaitTimeout(f"the bulk socket moved too slowly ({len(view)} bytes in {timeout_s:.1f}s)") from exc
        except OSError as exc:
            raise StaleBulk(f"the bulk socket failed: {exc}") from exc
        self.moved = True


@dataclass
class BulkSockets:
    """A shard's bulk port: nonces granted per worker incarnation, and the idle sockets by ticket.

    The listener starts with ``listen`` (``pstrain-ps`` calls it at start, so a fixed port that is
    taken fails the start) or else with the first grant, on ``host`` ("": every interface) and
    ``port`` (0: ephemeral). The port is useless without a nonce, and a nonce is only handed out
    over the authenticated gRPC channel.

    Bounds, since anyone who reaches the port can connect: at most ``MAX_HANDSHAKES`` connections wait
    for their nonce (``HANDSHAKE_TIMEOUT_S`` each; more are closed at once), and one worker incarnation
    holds at most ``MAX_SOCKETS_PER_WORKER`` sockets, idle and in use (a handshake beyond is refused,
    after closing its idle sockets whose peer has gone). Sockets are keyed by the credential's
    incarnation, so a replaced worker's old process neither uses up nor closes its successor's; without
    credentials (no job key) every process of a worker counts as incarnation 0. A failing ``accept``
    (out of file descriptors) is logged and retried; only ``close`` stops the port.
    """

    enabled: bool = True
    host: str = ""
    port: int = 0
    _nonces: dict[bytes, Owner] = field(default_factory=dict)  # nonce -> worker incarnation
    _of_owner: dict[Owner, bytes] = field(default_factory=dict)
    _held: dict[Owner, int] = field(default_factory=dict)  # sockets open per owner, idle or busy
    _idle: dict[bytes, BulkSocket] = field(default_factory=dict)
    _busy: dict[bytes, BulkSocket] = field(default_factory=dict)
    _listener: socket.socket | None = None
    _acceptor: threading.Thread | None = None
    _handshakes: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(MAX_HANDSHAKES))
    _stop: threading.Event = field(default_factory=threading.Event)
    _complained_at: float = -math.inf
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def grant(self, worker_id: int, incarnation: int = 0) -> tuple[int, bytes]:
        """(port, nonce) for that worker incarnation's sockets; the nonce stays the same for it.

        A newer incarnation retires the worker's older ones: their nonces go and their idle sockets are closed
        (busy ones when their call ends). The old process was replaced (its credential is no longer accepted),
        and it would never handshake again to have its dead sockets reaped: each replacement would leave up to
        ``MAX_SOCKETS_PER_WORKER`` descriptors open for the shard's lifetime."""
        owner = (worker_id, incarnation)
        with self._lock:
            if not self.enabled:
                raise BulkRefused("bulk sockets are off on this shard; stream instead")
            if self._closed:
                raise BulkStopping("this shard is stopping and its bulk port is closed; stream, and ask again later")
            newer = [o for o in self._of_owner if o[0] == worker_id and o[1] > incarnation]
            if newer:
                raise StaleBulk(
                    f"worker {worker_id} incarnation {incarnation} was replaced by incarnation {max(newer)[1]}"
                )
            port = self._listen_locked()
            retired = self._retire_locked([o for o in self._of_owner if o[0] == worker_id and o[1] < incarnation])
            nonce = self._of_owner.get(owner)
            if nonce is None:
                nonce = self._of_owner[owner] = secrets.token_bytes(NONCE_BYTES)
                self._nonces[nonce] = owner
        for sock in retired:
            _shut(sock)
        return port, nonce

    def _retire_locked(self, owners: list[Owner]) -> list[socket.socket]:
        """Forget ``owners``' nonces and take out their idle sockets (to be shut outside the lock)."""
        for owner in owners:
            self._nonces.pop(self._of_owner.pop(owner), None)
        gone = [t for t, bulk in self._idle.items() if bulk.owner in owners]
        for ticket in gone:
            self._uncount_locked(self._idle[ticket].owner)
        return [self._idle.pop(ticket).sock for ticket in gone]

    def listen(self) -> int:
        """Bind the port now (``OSError`` if it cannot: a fixed port in use); the port. Idempotent."""
        with self._lock:
            if self._closed:
                raise BulkRefused("this shard's bulk port is closed")
            return self._listen_locked()

    def _listen_locked(self) -> int:
        if self._listener is None:
            self._listener = _listen(self.host, self.port)
            self._acceptor = threading.Thread(
                target=self._accept, args=(self._listener,), name="bulk-accept", daemon=True
            )
            self._acceptor.start()
        return int(self._listener.getsockname()[1])

    def owner(self, ticket: bytes) -> int:
        """The worker an idle socket belongs to, so a call can check that worker's credential before ``take``."""
        with self._lock:
            bulk = self._idle.get(ticket)
            if bulk is None:
                raise StaleBulk("this shard has no idle bulk socket with that ticket; open another or stream")
            return bulk.worker_id

    def take(self, ticket: bytes, worker_id: int) -> BulkSocket:
        """The idle socket ``ticket`` names, for this call alone. It must be ``worker_id``'s (whose credential the
        caller has shown); if it is not, the call is refused and the socket stays idle, untouched."""
        with self._lock:
            bulk = self._idle.get(ticket)
            if bulk is None:
                raise StaleBulk("this shard has no idle bulk socket with that ticket; open another or stream")
            if bulk.worker_id != worker_id:
                raise InvalidArgument(f"the bulk socket belongs to worker {bulk.worker_id}, not {worker_id}")
            del self._idle[ticket]
            self._busy[ticket] = bulk
        bulk.moved = False
        return bulk

    def release(self, bulk: BulkSocket, keep: bool) -> None:
        """Back to idle if the call succeeded having moved exactly its payload (``keep``), else closed: the client
        keeps its end only after a call that succeeded, so both ends agree."""
        with self._lock:
            self._busy.pop(bulk.ticket, None)
            # Not a retired incarnation's, nor one with anything to read: before the reply, its client sends nothing
            # more, so what is there is a surplus or the peer's close, and the next call would read it as payload.
            if keep and not self._closed and bulk.owner in self._of_owner and not readable(bulk.sock):
                self._idle[bulk.ticket] = bulk
                return
            self._uncount_locked(bulk.owner)
        _shut(bulk.sock)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def held(self, worker_id: int, incarnation: int = 0) -> int:
        """Sockets open for that worker incarnation, idle and in use."""
        with self._lock:
            return self._held.get((worker_id, incarnation), 0)

    def turn_off(self) -> None:
        """Off for good (TLS, ``transport.bulk_sockets: off``): the port closes and every grant is refused as
        ``BulkRefused``, so clients stream to this shard from then on."""
        with self._lock:
            self.enabled = False
        self.close()

    def close(self) -> None:
        """Close the port and every socket; later grants are refused as ``BulkStopping`` (the server stops: a
        client asks again later, since the shard may come back on the same address).

        The listener is shut down before it is closed: on Linux a thread blocked in ``accept`` is not woken by
        ``close`` alone and would go on accepting on a port that could not be bound again."""
        with self._lock:
            self._closed = True
            sockets = [b.sock for b in (*self._idle.values(), *self._busy.values())]
            self._idle.clear()
            self._held.clear()
            listener, self._listener = self._listener, None
            acceptor, self._acceptor = self._acceptor, None
        self._stop.set()
        for sock in sockets:
            _shut(sock)
        if listener is not None:
            _shut(listener)
        if acceptor is not None and acceptor is not threading.current_thread():
            acceptor.join(JOIN_ACCEPT_S)

    def _uncount_locked(self, owner: Owner) -> None:
        left = self._held.get(owner, 0) - 1
        if left > 0:
            self._held[owner] = left
        else:
            self._held.pop(owner, None)

    def _reap_locked(self, owner: Owner) -> list[socket.socket]:
        """Take out ``owner``'s idle sockets that are readable: an idle socket has nothing to read unless its peer
        closed it (a process that went away never says so) or it holds stray bytes; either way it is done."""
        mine = {bulk.sock.fileno(): ticket for ticket, bulk in self._idle.items() if bulk.owner == owner}
        if not mine:
            return []
        poller = select.poll()
        for fd in mine:
            poller.register(fd, select.POLLIN)
        dead = []
        for fd, _ in poller.poll(0):
            bulk = self._idle.pop(mine[fd])
            self._uncount_locked(owner)
            dead.append(bulk.sock)
        return dead

    def _accept(self, listener: socket.socket) -> None:
        """Hand each connection to a handshake thread, at most ``MAX_HANDSHAKES`` at once; ends when closed."""
        while not self._stop.is_set():
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return
                self._complain(exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._stop.wait(ACCEPT_BACKOFF_S)  # the connection stays queued: retrying at once would spin
                continue
            if not self._handshakes.acquire(blocking=False):
                _shut(sock)  # too many connections wait for their nonce: this one is not served
                continue
            try:
                threading.Thread(target=self._handshake, args=(sock,), name="bulk-handshake", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had now
                self._handshakes.release()
                _shut(sock)
                self._complain(exc)
                self._stop.wait(ACCEPT_BACKOFF_S)

    def _complain(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._complained_at < COMPLAIN_EVERY_S:
                return
            self._complained_at = now
        log.warning("bulk port %s: cannot accept a connection (%s); still accepting", self.port or "(ephemeral)", exc)

    def _handshake(self, sock: socket.socket) -> None:
        """Read the nonce, answer with a fresh ticket; anything else (or a worker at its cap) closes the socket."""
        try:
            nonce = bytearray(NONCE_BYTES)
            receive_exactly(sock, memoryview(nonce), HANDSHAKE_TIMEOUT_S)
            with self._lock:
                owner = self._nonces.get(bytes(nonce))
                if owner is None or self._closed:
                    raise ConnectionError("unknown nonce")
                dead = self._reap_locked(owner) if self._held.get(owner, 0) >= MAX_SOCKETS_PER_WORKER else []
                full = self._held.get(owner, 0) >= MAX_SOCKETS_PER_WORKER
                if not full:
                    ticket = secrets.token_bytes(TICKET_BYTES)
                    self._idle[ticket] = BulkSocket(sock, owner[0], ticket, owner[1])
                    self._held[owner] = self._held.get(owner, 0) + 1
            for gone in dead:
                _shut(gone)
            if full:
                raise ConnectionError(f"worker {owner[0]} already holds {MAX_SOCKETS_PER_WORKER} bulk sockets")
            tune(sock)
            send_all(sock, memoryview(ticket), HANDSHAKE_TIMEOUT_S)
        except OSError:
            with self._lock:
                for known, bulk in list(self._idle.items()):
                    if bulk.sock is sock:
                        del self._idle[known]
                        self._uncount_locked(bulk.owner)
            _shut(sock)
        finally:
            self._handshakes.release()


def _listen(host: str, port: int) -> socket.socket:
    """Listen where the shard's gRPC server binds: "" or a wildcard (``0.0.0.0``, ``[::]``) is every interface."""
    host = host.strip("[]")
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    if host == "::":
        host = ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _surplus(sock: socket.socket) -> bool:
    """Bytes past the payload are waiting (a peer's close right after a whole payload is no surplus)."""
    if not readable(sock):
        return False
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))  # readable: returns at once
    except OSError:  # reset: the payload came whole, the socket is closed with the call anyway
        return False


def _shut(sock: socket.socket) -> None:
    """Shut down first: a thread blocked reading or writing the socket (a cancelled call's) returns at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
