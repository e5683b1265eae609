"""A flood client that costs the attacker almost nothing per call: gRPC requests pre-encoded as HTTP/2 frames.

Why it exists (issue 8): on one small host the attacker shares the cores with the job it attacks.
gRPC's Python client spends 0.3-0.7 ms of CPU per call, as much as the server spends refusing it,
so a flood from it measures the attacker's CPU as much as the server's. An attacker on another
host costs the victim host nothing; this client comes close to that on the same host: a call is
a HEADERS frame (HPACK literals, no compression state) and a DATA frame written straight to one
TCP connection, and the answers are counted from the frames that end their streams. It does the
HTTP/2 the server requires (preface, SETTINGS and their ACK, PING ACK, connection flow control)
and nothing more; it cannot decode the answers' grpc-status (the server's HPACK state), so the
benchmark learns the codes from a sample of calls made through gRPC's own client alongside.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x3, 0x4
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
MAX_FRAME = 16_384  # SETTINGS_MAX_FRAME_SIZE's default: what every HTTP/2 peer accepts
TICK_S = 0.005  # calls go out in a batch per tick and answers are read once per tick: few wake-ups at any rate


@dataclass(frozen=True)
class RawCall:
    """One gRPC call as the wire carries it: ``/package.Service/Method``, serialized request messages, metadata."""

    path: str
    messages: tuple[bytes, ...]
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass
class FloodStats:
    sent: int = 0
    answered: int = 0
    reset: int = 0  # streams the server ended with RST_STREAM rather than trailers
    skipped: int = 0  # calls not made: the in-flight limit or the connection's flow-control window
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # this thread's CPU: the flood's whole cost to the host, besides the kernel's
    closed: bool = False  # a connection ended (GOAWAY, reset or closed): the flood stops there


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK integer (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _string(text: str) -> bytes:
    raw = text.encode()
    return _integer(len(raw), 7) + raw


def header_block(authority: str, call: RawCall) -> bytes:
    """The request's header block: static-table entries and literals without indexing, so each block decodes
    alone and the same bytes serve every stream (no dynamic table on either side)."""
    block = bytearray(b"\x83\x86")  # :method POST, :scheme http (static table 3 and 6)
    block += _integer(4, 4) + _string(call.path)  # :path, name from the static table
    block += _integer(1, 4) + _string(authority)  # :authority
    block += _integer(31, 4) + _string("application/grpc")  # content-type
    for name, value in (("te", "trailers"), *call.metadata):
        block += b"\x00" + _string(name) + _string(value)
    return bytes(block)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


@dataclass(frozen=True)
class _Encoded:
    """A call's frames with the stream id left out: ``frames(stream)`` fills it in."""

    headers: bytes
    data: tuple[bytes, ...]
    data_bytes: int

    @classmethod
    def of(cls, authority: str, call: RawCall) -> _Encoded:
        body = b"".join(b"\x00" + struct.pack(">I", len(m)) + m for m in call.messages)
        if len(body) > DEFAULT_WINDOW:
            raise ValueError(f"a call of {len(body)} bytes: at most {DEFAULT_WINDOW} (a stream's first window)")
        headers = header_block(authority, call)
        if len(headers) > MAX_FRAME:
            raise ValueError(f"headers of {len(headers)} bytes: at most {MAX_FRAME} (one frame)")
        pieces = tuple(body[i : i + MAX_FRAME] for i in range(0, max(len(body), 1), MAX_FRAME)) or (b"",)
        return cls(headers, pieces, len(body))

    def frames(self, stream: int) -> bytes:
        out = [_frame(HEADERS, END_HEADERS, stream, self.headers)]
        for i, piece in enumerate(self.data):
            out.append(_frame(DATA, END_STREAM if i == len(self.data) - 1 else 0, stream, piece))
        return b"".join(out)


class _Connection:
    """One HTTP/2 connection: the streams it has open, its flow-control windows, the calls it has encoded."""

    def __init__(self, address: str, stats: FloodStats) -> None:
        host, port = address.rsplit(":", 1)
        self.authority = address
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stats = stats
        self.open: set[int] = set()
        self.max_streams = MAX_WINDOW  # until the server's SETTINGS say otherwise (gRPC sets no limit by default)
        self._next_stream = 1
        self._send_window = DEFAULT_WINDOW  # the server's connection window for what we send
        self._received = 0  # DATA bytes since our last WINDOW_UPDATE
        self._buffer = b""
        self._encoded: dict[RawCall, _Encoded] = {}
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        self.sock.sendall(  # before the flood starts: an error here is the caller's
            PREFACE
            + _frame(SETTINGS, 0, 0, settings)
            + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW))
        )

    def frames(self, call: RawCall) -> bytes | None:
        """The call's frames on a new stream, or None if the server's window cannot take its data now."""
        encoded = self._encoded.get(call)
        if encoded is None:
            if len(self._encoded) > 64:  # calls that name a step change with it
                self._encoded.clear()
            encoded = self._encoded[call] = _Encoded.of(self.authority, call)
        if encoded.data_bytes > self._send_window or len(self.open) >= self.max_streams:
            return None
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        self._send_window -= encoded.data_bytes
        self.open.add(stream)
        return encoded.frames(stream)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:  # reset, or the server stopped reading for 10 s: the flood ends, its figures stand
            self.stats.closed = True

    def receive(self) -> None:
        try:
            chunk = self.sock.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            self.stats.closed = True
            return
        buffer = self._buffer + chunk
        replies = []
        at = 0
        while len(buffer) - at >= 9:
            length = int.from_bytes(buffer[at : at + 3], "big")
            if len(buffer) - at - 9 < length:
                break
            kind, flags, stream = struct.unpack_from(">BBI", buffer, at + 3)
            payload = buffer[at + 9 : at + 9 + length]
            at += 9 + length
            stream &= 0x7FFFFFFF
            if (kind in (HEADERS, DATA) and flags & END_STREAM or kind == RST_STREAM) and stream in self.open:
                self.open.discard(stream)
                self.stats.answered += 1
                self.stats.reset += kind == RST_STREAM
            if kind == DATA:
                self._received += length
            elif kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, i)
                    if key == SETTINGS_MAX_CONCURRENT_STREAMS:
                        self.max_streams = value
                replies.append(_frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK:
                replies.append(_frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE and stream == 0:
                self._send_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
            elif kind == GOAWAY:
                self.stats.closed = True
        self._buffer = buffer[at:]
        if self._received > MAX_WINDOW // 2:  # give the server back what its answers took of our window
            replies.append(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
            self._received = 0
        if replies:
            self.send(b"".join(replies))


class H2Flood:
    """Starts gRPC calls at a fixed rate over one HTTP/2 connection per target and counts the streams the
    server ends; at most ``max_in_flight`` unanswered at once (a call not started on time is skipped, not made up).
    The calls due go out together every ``TICK_S``, as a flood from another host arrives: in bursts."""

    def __init__(self, addresses: list[str], max_in_flight: int = 256) -> None:
        self.stats = FloodStats()
        self._max_in_flight = max_in_flight
        self._connections: list[_Connection] = []
        try:
            for address in addresses:
                self._connections.append(_Connection(address, self.stats))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for connection in self._connections:
            connection.sock.close()

    def run(self, rate: float, stop: threading.Event, next_call: Callable[[], tuple[int, RawCall]]) -> FloodStats:
        """``next_call`` names the target (an index into the addresses) and the call, ``rate`` times a second."""
        started, cpu_before = time.monotonic(), time.thread_time()
        stats = self.stats
        socks = {c.sock: c for c in self._connections}
        tick = 0
        while not stop.is_set() and not stats.closed:
            due = int((time.monotonic() - started) * rate) - stats.sent - stats.skipped
            if due > 0:
                self._start(due, next_call)
            readable, _, _ = select.select(list(socks), [], [], 0)
            while readable and not stats.closed:  # all answered so far (a closed socket stays readable: stop)
                for sock in readable:
                    socks[sock].receive()
                readable, _, _ = select.select(list(socks), [], [], 0)
            tick += 1
            stop.wait(max(0.0, tick * TICK_S - (time.monotonic() - started)))
        stats.elapsed_s = time.monotonic() - started
        stats.cpu_s = time.thread_time() - cpu_before
        return stats

    def _start(self, count: int, next_call: Callable[[], tuple[int, RawCall]]) -> None:
        out: dict[_Connection, list[bytes]] = {}
        in_flight = sum(len(c.open) for c in self._connections)
        for _ in range(count):
            target, call = next_call()
            connection = self._connections[target]
            frames = connection.frames(call) if in_flight < self._max_in_flight else None
            if frames is None:
                self.stats.skipped += 1
                continue
            in_flight += 1
            out.setdefault(connection, []).append(frames)
            self.stats.sent += 1
        for connection, frames_list in out.items():
            connection.send(b"".join(frames_list))
