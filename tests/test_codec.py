import pytest
import torch

from pstrain.protos import codec
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import (
    TORCH_TO_WIRE,
    CodecError,
    EncodedReplies,
    PushPart,
    TensorAssembler,
    decode_named_tensors,
    decode_pull_reply,
    decode_push_request,
    encode_chunks,
    encode_named_tensors,
    encode_push_chunks,
    encode_push_header,
)


def decode_tensor(chunks) -> torch.Tensor:
    """One unnamed tensor through the decoder the services use."""
    (tensor,) = decode_named_tensors(chunks).values()
    return tensor


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(TORCH_TO_WIRE))
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 0, 4), (1001,), ()])
@pytest.mark.parametrize("chunk_bytes", [1, 13, 64, 1 << 20])
def test_round_trip_every_dtype_and_size(dtype, shape, chunk_bytes):
    tensor = sample(dtype, shape)
    chunks = list(encode_chunks(tensor, chunk_bytes))
    assert chunks, "even an empty tensor sends one chunk"
    assert all(len(c.data) <= max(chunk_bytes, tensor.element_size()) for c in chunks)
    back = decode_tensor(iter(chunks))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_chunks_are_raw_little_endian_bytes():
    tensor = torch.tensor([1.0, -2.0], dtype=torch.float32)
    (chunk,) = encode_chunks(tensor)
    assert chunk.data == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"
    assert chunk.dtype == pb.FLOAT32 and list(chunk.shape) == [2] and chunk.offset == 0


def test_non_contiguous_and_offsets():
    tensor = torch.arange(24, dtype=torch.float64).view(4, 6).t()
    chunks = list(encode_chunks(tensor, 40))
    assert [c.offset for c in chunks] == [0, 5, 10, 15, 20]
    assert torch.equal(decode_tensor(iter(chunks)), tensor)


def test_assembler_writes_into_the_given_buffer():
    out = torch.zeros(10)
    source = torch.arange(10, dtype=torch.float32)
    assembler = TensorAssembler(torch.float32, 10, out=out)
    for chunk in encode_chunks(source, 12):
        assembler.add(chunk)
    assert assembler.result() is out and torch.equal(out, source)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: setattr(c[1], "offset", 7), "out of order"),
        (lambda c: setattr(c[1], "dtype", pb.FLOAT64), "does not match"),
        (lambda c: setattr(c[1], "data", c[1].data[:-1]), "whole number"),
        (lambda c: setattr(c[1], "data", c[1].data + b"\0" * 8), "exceed"),
        (lambda c: setattr(c[1], "dtype", 99), "unknown wire dtype"),
    ],
)
def test_malformed_streams_are_rejected(mutate, message):
    chunks = list(encode_chunks(torch.arange(8, dtype=torch.float32), 16))
    mutate(chunks)
    with pytest.raises(CodecError, match=message):
        decode_tensor(iter(chunks))


def test_incomplete_stream_is_rejected():
    chunks = list(encode_chunks(torch.arange(8, dtype=torch.float32), 16))[:-1]
    with pytest.raises(CodecError, match="ended after 4 of 8"):
        decode_tensor(iter(chunks))


def test_unsupported_dtype_and_device():
    with pytest.raises(CodecError, match="cannot travel"):
        list(encode_chunks(torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(CodecError, match="chunk_bytes"):
        list(encode_chunks(torch.zeros(2), 0))


def test_named_tensors_round_trip():
    tensors = {"a.running_mean": torch.randn(3), "a.num_batches_tracked": torch.tensor(5), "b": torch.zeros(0)}
    back = decode_named_tensors(encode_named_tensors(tensors, 4))
    assert list(back) == list(tensors)
    for name, value in tensors.items():
        assert torch.equal(back[name], value) and back[name].dtype == value.dtype


def test_named_tensor_sent_twice_is_rejected():
    chunks = [*encode_named_tensors({"x": torch.ones(2)}), *encode_named_tensors({"y": torch.ones(1)})]
    chunks += list(encode_named_tensors({"x": torch.ones(2)}))
    with pytest.raises(CodecError, match="sent twice"):
        decode_named_tensors(iter(chunks))


# ---------------------------------------------------------------------- data-plane messages as bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
@pytest.mark.parametrize("shape, chunk_bytes", [((0,), 8), ((7,), 8), ((3, 5), 1 << 20), ((1001,), 64)])
def test_push_messages_are_the_protobuf_encoding(dtype, shape, chunk_bytes):
    tensor = sample(dtype, shape)
    raw = list(encode_push_chunks(tensor, chunk_bytes))
    expected = list(encode_chunks(tensor, chunk_bytes))
    assert [pb.PushRequest.FromString(m) for m in raw] == [pb.PushRequest(chunk=c) for c in expected]
    parts = [decode_push_request(m) for m in raw]
    assert all(p.header is None for p in parts)
    assembler = TensorAssembler(dtype, tensor.numel())
    for part in parts:
        assert isinstance(part.chunk.data, memoryview)  # a view of the message: no copy
        assembler.add(part.chunk)
    assert torch.equal(assembler.result().view(shape), tensor)
    assert parts[0].chunk.shape == shape and parts[0].chunk.dtype == TORCH_TO_WIRE[dtype]


def test_push_header_and_messages_protobuf_wrote_decode_alike():
    header = pb.PushHeader(shard_id=1, worker_id=2, step=-3, device_count=4, dtype=pb.FLOAT32, numel=5, skip=True)
    assert decode_push_request(encode_push_header(header)).header == header
    assert decode_push_request(pb.PushRequest(header=header).SerializeToString()).header == header
    chunk = pb.TensorChunk(name="w", dtype=pb.INT16, shape=[2, -1], offset=-7, data=b"abcd")
    written = pb.PushRequest(chunk=chunk).SerializeToString()
    unknown_fields = b"\x48\x01" + b"\x55\x00\x00\x00\x00"  # field 9 varint, field 10 fixed32: skipped
    view = decode_push_request(written + unknown_fields).chunk
    assert (view.name, view.dtype, view.shape, view.offset, bytes(view.data)) == ("w", pb.INT16, (2, -1), -7, b"abcd")
    assert decode_push_request(b"") == PushPart()
    last_wins = decode_push_request(encode_push_header(header) + written)
    assert last_wins.header is None and bytes(last_wins.chunk.data) == b"abcd"


def test_pull_replies_are_encoded_once_per_version():
    tensor = torch.arange(10, dtype=torch.float32)
    replies = EncodedReplies(7, tensor, 16)
    assert len(replies) == 3 and replies[1] is replies[1]  # built once, then kept
    parsed = [pb.PullReply.FromString(replies[i]) for i in range(len(replies))]
    assert [p.version for p in parsed] == [7, 7, 7]
    assert [p.chunk for p in parsed] == list(encode_chunks(tensor, 16))
    out = torch.empty(10)
    assembler = TensorAssembler(torch.float32, 10, out=out)
    for i in range(len(replies)):
        part = decode_pull_reply(replies[i])
        assert part.version == 7
        assembler.add(part.chunk)
    assert torch.equal(assembler.result(), tensor)
    assert decode_pull_reply(EncodedReplies(0, torch.zeros(0), 16)[0]).chunk.data.nbytes == 0


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x12\x05\x10\x01", "runs past its end"),  # the chunk claims 5 bytes, 2 follow
        (b"\x12\x02\x20\xff", "varint"),  # the offset's varint never ends
        (b"\x13", "wire type 3"),  # groups are not part of proto3
        (b"\x0a\x02\x08\xff", "PushHeader"),  # a header whose varint is cut off
    ],
)
def test_malformed_push_messages_are_codec_errors(raw, message):
    with pytest.raises(CodecError, match=message):
        decode_push_request(raw)


def test_a_pull_reply_without_a_chunk_is_a_codec_error():
    with pytest.raises(CodecError, match="without a chunk"):
        decode_pull_reply(pb.PullReply(version=3).SerializeToString())


def _push_of_chunk(chunk_body: bytes) -> bytes:
    return b"\x12" + _varint(len(chunk_body)) + chunk_body


def _varint(value: int) -> bytes:
    return pb.TensorChunk(offset=value).SerializeToString()[1:]  # field 4's tag, then the varint


def _counting_varints(monkeypatch) -> list[int]:
    """Every varint the decoder reads: its cost, whatever the clock says."""
    reads = [0]
    real = codec._read_varint

    def counted(*args):  # type: ignore[no-untyped-def]
        reads[0] += 1
        return real(*args)

    monkeypatch.setattr(codec, "_read_varint", counted)
    return reads


def test_a_huge_packed_shape_is_refused_before_a_dimension_is_read(monkeypatch):
    """The decoder runs on a PS shard's event loop before the caller's credential is checked: a shape of 8 Mi
    dimensions (8 MiB of zero bytes) costs a few varint reads, not 8 Mi of them (the loop froze for minutes)."""
    reads = _counting_varints(monkeypatch)
    n = 8 << 20
    raw = _push_of_chunk(b"\x1a" + _varint(n) + b"\x00" * n)
    with pytest.raises(CodecError, match="more than 32 dimensions"):
        decode_push_request(raw)
    assert reads[0] < 10


def test_many_tiny_fields_are_refused_at_the_first_past_the_schema(monkeypatch):
    reads = _counting_varints(monkeypatch)
    with pytest.raises(CodecError, match="malformed PushRequest: more than"):
        decode_push_request(b"\x78\x00" * (1 << 20))  # field 15, varint 0, a million times
    with pytest.raises(CodecError, match="malformed TensorChunk: more than"):
        decode_push_request(_push_of_chunk(b"\x78\x00" * (1 << 16)))
    with pytest.raises(CodecError, match="malformed PullReply: more than"):
        decode_pull_reply(b"\x08\x01" * (1 << 16))
    assert reads[0] < 300


def test_a_shape_of_at_most_32_dimensions_decodes_packed_or_not():
    shape = [1] * codec.MAX_DIMS
    packed = pb.PushRequest(chunk=pb.TensorChunk(shape=shape, data=b"ab")).SerializeToString()
    assert decode_push_request(packed).chunk.shape == tuple(shape)
    unpacked = b"".join(b"\x18\x01" for _ in shape) + b"\x2a\x02ab"  # field 3 as single varints, then data
    part = decode_push_request(_push_of_chunk(unpacked))
    assert part.chunk.shape == tuple(shape) and bytes(part.chunk.data) == b"ab"
    with pytest.raises(CodecError, match="more than 32 dimensions"):
        decode_push_request(_push_of_chunk(unpacked + b"\x18\x01"))
    with pytest.raises(CodecError, match="more than 32 dimensions"):
        decode_push_request(pb.PushRequest(chunk=pb.TensorChunk(shape=[*shape, 1])).SerializeToString())


def test_a_negative_view_travels_as_its_values_and_is_refused_as_a_destination():
    tensor = torch.arange(5, dtype=torch.float32)._neg_view()
    assert torch.equal(decode_tensor(encode_chunks(tensor, 8)), -torch.arange(5, dtype=torch.float32))
    assembler = TensorAssembler(torch.float32, 5)
    for raw in encode_push_chunks(tensor, 8):
        assembler.add(decode_push_request(raw).chunk)
    assert torch.equal(assembler.result(), -torch.arange(5, dtype=torch.float32))
    with pytest.raises(CodecError, match="resolve_neg"):
        TensorAssembler(torch.float32, 5, out=torch.zeros(5)._neg_view())
