"""Tensors on the wire: raw little-endian bytes in chunks.

Nothing loops over elements in Python and nothing is pickled, but the bytes are copied many
times. Counted per chunk and direction with gdb on every libc memcpy of 4 KiB or more, one
push and one pull of a 4 MiB shard over loopback (protobuf 7.36 upb, grpcio 1.85), each
direction copies every payload byte 14 times in user space, besides the kernel's socket copies:

    sender, 8:   ``tobytes`` of the tensor's memory (``encode_chunks``); into the TensorChunk's
                 arena; 3 to nest the chunk in a PushRequest / PullReply (upb's MergeFrom
                 serialises the chunk to bytes and parses it back); 2 to serialise the request
                 (encode, then a Python ``bytes``); 1 into gRPC's slice
    receiver, 6: 2 in gRPC's Python layer (a ``bytes`` per slice, then ``b"".join``); 1 to parse
                 the message; 2 in ``TensorAssembler.add``, which reads ``chunk.data`` twice and
                 each read builds a new ``bytes``; 1 into the preallocated destination

Streams of bare TensorChunks (FetchInitialParameters, UploadBuffers) skip the nesting: 11 by
the same count. A push then adds (or, for a step's first contribution, copies) the staged
gradient into the shard's accumulator; that is the update, not the wire.
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
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def encode_chunks(
    tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES, name: str = ""
) -> Iterator[pb.TensorChunk]:
    """Cut a CPU tensor into chunks of at most ``chunk_bytes`` (rounded to whole elements).

    An empty tensor still yields one chunk, so the receiver learns its dtype and shape.
    """
    if tensor.device.type != "cpu":
        raise CodecError(f"encode_chunks needs a CPU tensor, got one on {tensor.device}")
    if chunk_bytes <= 0:
        raise CodecError(f"chunk_bytes must be positive, got {chunk_bytes}")
    wire = wire_dtype(tensor.dtype)
    tensor = tensor.contiguous()
    item = tensor.element_size()
    step = max(1, chunk_bytes // item) * item
    raw = _byte_view(tensor).data
    shape = list(tensor.shape)
    if len(raw) == 0:
        yield pb.TensorChunk(name=name, dtype=wire, shape=shape, offset=0, data=b"")
        return
    for start in range(0, len(raw), step):
        chunk = pb.TensorChunk(name=name, dtype=wire, offset=start // item, data=raw[start : start + step].tobytes())
        if start == 0:
            chunk.shape.extend(shape)
        yield chunk


@dataclass
class TensorAssembler:
    """Receives the chunks of one tensor, in order, into memory allocated up front.

    Chunks must arrive in offset order without gaps or overlap, which gRPC streams give for
    free and which lets ``complete`` prove full coverage by counting.
    """

    dtype: torch.dtype
    numel: int
    out: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise CodecError(f"negative tensor size {self.numel}")
        if self.out is None:
            self.out = torch.empty(self.numel, dtype=self.dtype)
        elif self.out.dtype != self.dtype or self.out.numel() != self.numel or not self.out.is_contiguous():
            raise CodecError("destination tensor does not match the announced dtype and size")
        self._bytes = _byte_view(self.out)
        self._item = torch.empty(0, dtype=self.dtype).element_size()
        self.filled = 0  # elements

    def add(self, chunk: pb.TensorChunk) -> None:
        if torch_dtype(chunk.dtype) != self.dtype:
            raise CodecError(f"chunk dtype {dtype_name(chunk.dtype)} does not match {self.dtype}")
        if chunk.offset != self.filled:
            raise CodecError(f"chunk at element {chunk.offset}, expected {self.filled} (out of order or overlapping)")
        size = len(chunk.data)
        if size % self._item:
            raise CodecError(f"chunk of {size} bytes is not a whole number of {self.dtype} elements")
        count = size // self._item
        if self.filled + count > self.numel:
            raise CodecError(f"chunks exceed the announced {self.numel} elements")
        start = self.filled * self._item
        self._bytes[start : start + size] = np.frombuffer(chunk.data, dtype=np.uint8)
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
