"""Tensors on the wire: raw little-endian bytes in chunks, copied once out and once in.

The tensor-carrying RPCs of the data plane (Push requests, Pull replies) do not go through
protobuf objects: ``encode_push_chunks`` and ``EncodedReplies`` write each message's bytes
directly (the small chunk header through protobuf, then the payload appended straight from the
tensor's memory), and ``decode_push_request`` / ``decode_pull_reply`` walk the received bytes
and hand out the payload as a ``memoryview`` that ``TensorAssembler`` copies into its
destination. The bytes are exactly the ``pstrain.proto`` encoding, so grpcurl and generated
stubs still talk to both ends. Servers and clients register these functions as the methods'
serializers (``ps_server.service.add_parameter_server``, ``runtime.ps_client``).

Copies of every payload byte in user space, counted with gdb on every libc memcpy/memmove of
4 KiB or more during one push and one pull of a 4 MiB shard over loopback (client and server in
one process, protobuf 7.36 upb, grpcio 1.85; ``bench/pushpull.py --copies`` recounts them):

    push, 5:  1 ``encode_push_chunks`` (tensor -> message bytes); 1 gRPC's slice of the message;
              2 in gRPC's Python receive path (a ``bytes`` per slice, then ``b"".join``);
              1 ``TensorAssembler.add`` (payload view -> staging buffer)
    pull, 4:  the same 1 + 2 of gRPC's and 1 ``TensorAssembler.add`` into the caller's buffer,
              plus 1 per version: ``EncodedReplies`` (published tensor -> message bytes), made
              by the version's first pull and shared by every pull of it

(gdb counts 6.0 for a push: one more, inside gRPC, not attributed; ``bench/results/pushpull.md``.)
Ours are one out of the tensor and one into the destination; the three in between are gRPC's
and no serializer can avoid them (gRPC Python copies a message into a slice to send it, and
hands a deserializer one joined ``bytes``). Before this codec each direction made 14.

Those three bound a gRPC stream near 0.4x raw TCP (push+pull of 100 MB on loopback, measured
with bare ``bytes`` messages and no protobuf at all), so by default a remote worker's payloads
do not travel in these messages: they go on bulk sockets (``ps_server.bulk``,
``runtime.bulk_client``), raw bytes beside the gRPC call that carries the same header, with no
user-space copy. These messages carry them over TLS channels, to shards that refuse bulk
sockets, and for grpcurl and generated stubs.

Streams of bare TensorChunks (FetchInitialParameters, UploadBuffers) still use protobuf
messages (``encode_chunks``): setup-time traffic, not per step; ``TensorAssembler`` reads their
``data`` once. A push then adds (or, for a step's first
contribution, copies) the staged gradient into the shard's accumulator; that is the update, not
the wire.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pstrain.protos import pstrain_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in the fleet
    raise ImportError("pstrain's wire format is little-endian; this host is big-endian")

DEFAULT_CHUNK_BYTES = 512 * 1024

TORCH_TO_WIRE: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.int16: pb.INT16,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.bool: pb.BOOL,
}
WIRE_TO_TORCH: dict[int, torch.dtype] = {wire: dtype for dtype, wire in TORCH_TO_WIRE.items()}


class CodecError(ValueError):
    """A chunk stream that does not describe the tensor it claims to."""


def wire_dtype(dtype: torch.dtype) -> pb.DType:
    try:
        return TORCH_TO_WIRE[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot travel on the wire") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return WIRE_TO_TORCH[wire]
    except KeyError:
        raise CodecError(f"unknown wire dtype {wire}") from None


def dtype_name(wire: int) -> str:
    return pb.DType.Name(wire) if wire in pb.DType.values() else str(wire)


def _byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy).

    A negative view (``torch._neg_view``, what some autograd formulas return) keeps its sign in a bit, not in its
    memory, so its bytes are not its values: ``_Slicing`` resolves one first; a destination that is one is refused."""
    if tensor.is_neg() or tensor.is_conj():
        raise CodecError("a negative or conjugate view's memory is not its values: pass tensor.resolve_neg()")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


@dataclass(frozen=True)
class _Slicing:
    """How a tensor is cut into chunks: its wire dtype, bytes, and byte ranges of whole elements."""

    wire: int
    item: int
    shape: list[int]
    raw: memoryview
    step: int

    @classmethod
    def of(cls, tensor: torch.Tensor, chunk_bytes: int) -> _Slicing:
        if tensor.device.type != "cpu":
            raise CodecError(f"tensors travel from CPU memory, got one on {tensor.device}")
        if chunk_bytes <= 0:
            raise CodecError(f"chunk_bytes must be positive, got {chunk_bytes}")
        wire = wire_dtype(tensor.dtype)
        tensor = tensor.resolve_neg().contiguous()  # a negative view's values, in memory (a copy only then)
        item = tensor.element_size()
        step = max(1, chunk_bytes // item) * item
        return cls(wire, item, list(tensor.shape), _byte_view(tensor).data, step)

    def starts(self) -> range:
        """Byte offsets of the chunks; an empty tensor still has one (its dtype and shape travel)."""
        return range(0, max(len(self.raw), 1), self.step)

    def chunk(self, start: int, name: str = "") -> tuple[pb.TensorChunk, memoryview]:
        """The chunk at byte ``start`` without its data, and a view of that data."""
        header = pb.TensorChunk(name=name, dtype=self.wire, offset=start // self.item)  # type: ignore[arg-type]
        if start == 0:
            header.shape.extend(self.shape)
        return header, self.raw[start : start + self.step]


def encode_chunks(
    tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES, name: str = ""
) -> Iterator[pb.TensorChunk]:
    """Cut a CPU tensor into chunks of at most ``chunk_bytes`` (rounded to whole elements).

    An empty tensor still yields one chunk, so the receiver learns its dtype and shape.
    """
    slicing = _Slicing.of(tensor, chunk_bytes)
    for start in slicing.starts():
        chunk, data = slicing.chunk(start, name)
        chunk.data = data.tobytes()
        yield chunk


@dataclass
class TensorAssembler:
    """Receives the chunks of one tensor, in order, into memory allocated up front.

    Chunks must arrive in offset order without gaps or overlap, which gRPC streams give for
    free and which lets ``complete`` prove full coverage by counting. A chunk is a protobuf
    ``TensorChunk`` or a ``ChunkView``; either way its payload is read once and copied once.
    """

    dtype: torch.dtype
    numel: int
    out: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise CodecError(f"negative tensor size {self.numel}")
        if self.out is None:
            self.out = torch.empty(self.numel, dtype=self.dtype)
        elif self.out.device.type != "cpu":  # else numpy's TypeError, which names no codec rule
            raise CodecError(f"tensors are received into CPU memory, got a destination on {self.out.device}")
        elif self.out.dtype != self.dtype or self.out.numel() != self.numel or not self.out.is_contiguous():
            raise CodecError("destination tensor does not match the announced dtype and size")
        self._bytes = _byte_view(self.out)
        self._item = torch.empty(0, dtype=self.dtype).element_size()
        self.filled = 0  # elements

    def add(self, chunk: pb.TensorChunk | ChunkView) -> None:
        if torch_dtype(chunk.dtype) != self.dtype:
            raise CodecError(f"chunk dtype {dtype_name(chunk.dtype)} does not match {self.dtype}")
        if chunk.offset != self.filled:
            raise CodecError(f"chunk at element {chunk.offset}, expected {self.filled} (out of order or overlapping)")
        data = chunk.data  # once: each read of a protobuf bytes field makes a new copy
        size = len(data)
        if size % self._item:
            raise CodecError(f"chunk of {size} bytes is not a whole number of {self.dtype} elements")
        count = size // self._item
        if self.filled + count > self.numel:
            raise CodecError(f"chunks exceed the announced {self.numel} elements")
        start = self.filled * self._item
        self._bytes[start : start + size] = np.frombuffer(data, dtype=np.uint8)
        self.filled += count

    @property
    def complete(self) -> bool:
        return self.filled == self.numel

    def result(self) -> torch.Tensor:
        if not self.complete:
            raise CodecError(f"stream ended after {self.filled} of {self.numel} elements")
        assert self.out is not None
        return self.out


def decode_named_tensors(chunks: Iterator[pb.TensorChunk]) -> dict[str, torch.Tensor]:
    """Assemble a stream of several named tensors sent one after another."""
    tensors: dict[str, torch.Tensor] = {}
    current: tuple[str, TensorAssembler, list[int]] | None = None
    for chunk in chunks:
        if current is None or chunk.name != current[0]:
            if current is not None:
                tensors[current[0]] = current[1].result().view(current[2])
            if chunk.name in tensors:
                raise CodecError(f"tensor {chunk.name!r} sent twice")
            shape = list(chunk.shape)
            numel = int(np.prod(shape)) if shape else 1
            current = (chunk.name, TensorAssembler(torch_dtype(chunk.dtype), numel), shape)
        current[1].add(chunk)
    if current is not None:
        tensors[current[0]] = current[1].result().view(current[2])
    return tensors


def encode_named_tensors(
    tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    for name, tensor in tensors.items():
        yield from encode_chunks(tensor.detach().cpu(), chunk_bytes, name=name)


# ---------------------------------------------------------------------- data-plane messages as bytes
#
# Protobuf wire format: a field is a varint tag (number << 3 | wire type) and a value; wire type 0
# is a varint, 2 is a length-delimited run of bytes (strings, bytes, nested messages, packed
# repeated scalars), 1 and 5 are fixed 8 and 4 bytes. A parser takes fields in any order, the
# last occurrence of a scalar or oneof member winning.

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_CHUNK_FIELD = 2  # PushRequest.chunk and PullReply.chunk
_DATA_TAG = bytes([5 << 3 | _LEN])  # TensorChunk.data


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int, message: str = "message") -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise CodecError(f"malformed {message}: a varint runs past its end")


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: bytes, pos: int, end: int, message: str, most: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value or start, end) for each field of ``buf[pos:end]``, a ``message``.

    At most ``most`` fields: these messages are parsed in Python, on a PS shard's event loop and before the caller's
    credential is checked, so what one message may cost is bounded by what its schema holds, not by its size (a
    message of a million tiny unknown fields is refused at the field past ``most``, not walked to its end). An
    unknown field is skipped whole, never looked into."""
    count = 0
    while pos < end:
        count += 1
        if count > most:
            raise CodecError(f"malformed {message}: more than {most} fields (its schema has fewer)")
        tag, pos = _read_varint(buf, pos, end, message)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos, end, message)
            yield number, wire, value, pos
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos, end, message)
            if pos + size > end:
                raise CodecError(f"malformed {message}: a field runs past its end")
            yield number, wire, pos, pos + size
            pos += size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
            if pos > end:
                raise CodecError(f"malformed {message}: a field runs past its end")
        else:
            raise CodecError(f"malformed {message}: wire type {wire}")


MAX_DIMS = 32
"""The most dimensions a chunk's shape may have (torch allows 64; no parameter of a model has more than a few)."""
_VARINT_BYTES = 10  # the longest varint: a negative int64
# The fields a message may hold: its schema's, each once, and a few unknown ones (a newer peer's, skipped). A
# TensorChunk has 5, its shape one more for each dimension sent unpacked (proto3 parsers accept both encodings).
_UNKNOWN_FIELDS = 4
_CHUNK_FIELDS = 5 + MAX_DIMS + _UNKNOWN_FIELDS
_PUSH_FIELDS = 2 + _UNKNOWN_FIELDS  # PushRequest: header, chunk (a oneof: one in practice; the last one wins)
_PULL_FIELDS = 3 + _UNKNOWN_FIELDS  # PullReply: version, chunk, board_slot


@dataclass(frozen=True)
class ChunkView:
    """A ``TensorChunk`` as received: its fields, and its payload as a view of the message (no copy)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview


def _packed_shape(buf: bytes, a: int, b: int, shape: list[int]) -> None:
    """Append a packed run of dimensions to ``shape``, refused before it is read if it cannot hold few enough."""
    if b - a > (MAX_DIMS - len(shape)) * _VARINT_BYTES:
        raise CodecError(f"malformed TensorChunk: a shape of more than {MAX_DIMS} dimensions")
    while a < b:
        value, a = _read_varint(buf, a, b, "TensorChunk")
        shape.append(_signed64(value))
    if len(shape) > MAX_DIMS:
        raise CodecError(f"malformed TensorChunk: a shape of more than {MAX_DIMS} dimensions")


def _chunk_view(buf: bytes, view: memoryview, pos: int, end: int) -> ChunkView:
    name, dtype, offset = "", 0, 0
    shape: list[int] = []
    data = view[0:0]
    for number, wire, a, b in _fields(buf, pos, end, "TensorChunk", _CHUNK_FIELDS):
        if number == 1 and wire == _LEN:
            name = buf[a:b].decode("utf-8", errors="replace")
        elif number == 2 and wire == _VARINT:
            dtype = _signed64(a)
        elif number == 3 and wire == _LEN:  # packed
            _packed_shape(buf, a, b, shape)
        elif number == 3 and wire == _VARINT:
            shape.append(_signed64(a))
            if len(shape) > MAX_DIMS:
                raise CodecError(f"malformed TensorChunk: a shape of more than {MAX_DIMS} dimensions")
        elif number == 4 and wire == _VARINT:
            offset = _signed64(a)
        elif number == 5 and wire == _LEN:
            data = view[a:b]
    return ChunkView(name, dtype, tuple(shape), offset, data)


@dataclass(frozen=True)
class PushPart:
    """One message of a Push stream: a ``PushHeader`` or a chunk (``None`` both: an empty message)."""

    header: pb.PushHeader | None = None
    chunk: ChunkView | None = None


def decode_push_request(raw: bytes) -> PushPart:
    """Parse a ``PushRequest`` without copying its payload; raises ``CodecError`` if malformed.

    Its cost is bounded by what the schema holds (``_fields``, ``MAX_DIMS``), whatever the message's size: it runs
    as the Push method's deserializer, before the caller's credential is checked."""
    view = memoryview(raw)
    part = PushPart()
    for number, wire, a, b in _fields(raw, 0, len(raw), "PushRequest", _PUSH_FIELDS):
        if number == 1 and wire == _LEN:
            try:
                part = PushPart(header=pb.PushHeader.FromString(raw[a:b]))
            except Exception as exc:  # protobuf's DecodeError
                raise CodecError(f"malformed PushHeader: {exc}") from exc
        elif number == _CHUNK_FIELD and wire == _LEN:
            part = PushPart(chunk=_chunk_view(raw, view, a, b))
    return part


@dataclass(frozen=True)
class PullPart:
    """One ``PullReply``: the version it belongs to and its chunk."""

    version: int
    chunk: ChunkView


def decode_pull_reply(raw: bytes) -> PullPart:
    """Parse a ``PullReply`` without copying its payload; raises ``CodecError`` if malformed."""
    view = memoryview(raw)
    version, chunk = 0, None
    for number, wire, a, b in _fields(raw, 0, len(raw), "PullReply", _PULL_FIELDS):
        if number == 1 and wire == _VARINT:
            version = _signed64(a)
        elif number == _CHUNK_FIELD and wire == _LEN:
            chunk = _chunk_view(raw, view, a, b)
    if chunk is None:
        raise CodecError("a PullReply without a chunk")
    return PullPart(version, chunk)


def _chunk_message(prefix: bytes, chunk: pb.TensorChunk, data: memoryview) -> bytes:
    """``prefix`` + field 2 holding ``chunk`` with ``data``: the payload's one copy is this join."""
    header = chunk.SerializeToString()
    data_head = _DATA_TAG + _encode_varint(len(data))
    size = len(header) + len(data_head) + len(data)
    field = bytes([_CHUNK_FIELD << 3 | _LEN]) + _encode_varint(size)
    return b"".join((prefix, field, header, data_head, data))


def encode_push_header(header: pb.PushHeader) -> bytes:
    return pb.PushRequest(header=header).SerializeToString()


def encode_push_chunks(tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The ``PushRequest`` chunk messages of ``tensor``, each built straight from its memory."""
    slicing = _Slicing.of(tensor, chunk_bytes)
    for start in slicing.starts():
        yield _chunk_message(b"", *slicing.chunk(start))


class EncodedReplies:
    """The ``PullReply`` messages of one published version, each built on first use and kept.

    Every pull of a version (all W workers) is served from these bytes: one copy out of the
    tensor per version, not per pull. The servicer encodes them all (``encode_all``) while it
    holds the shard's read lease on the published buffer, which the shard reuses for a later
    version once nobody holds it.
    """

    def __init__(self, version: int, tensor: torch.Tensor, chunk_bytes: int) -> None:
        self.version = version
        self.numel = tensor.numel()
        self._slicing = _Slicing.of(tensor, chunk_bytes)
        self._prefix = pb.PullReply(version=version).SerializeToString()
        self._starts = self._slicing.starts()
        self._messages: list[bytes | None] = [None] * len(self._starts)

    def __len__(self) -> int:
        return len(self._messages)

    def encode_all(self) -> EncodedReplies:
        """Build every message now, so the tensor is no longer needed."""
        for index in range(len(self._messages)):
            self[index]
        self._slicing = None  # type: ignore[assignment]  # drop the tensor
        return self

    def __getitem__(self, index: int) -> bytes:
        message = self._messages[index]
        if message is None:
            message = _chunk_message(self._prefix, *self._slicing.chunk(self._starts[index]))
            self._messages[index] = message
        return message
