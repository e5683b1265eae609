"""Bounded resources: how many waiting pulls a shard keeps, and sizes checked before allocation.

``PullAdmission`` (a PS shard's Pull handler) holds a pull only while fewer than ``per_shard`` pulls
wait on the shard and fewer than ``per_peer`` on behalf of the same peer (a member's credential,
else its connection), and each for at most ``max_wait_s`` whatever deadline the client set. Past a
limit the pull is refused at once with ``Overloaded`` (RESOURCE_EXHAUSTED) and a message: a flood
from one peer is its own problem and cannot crowd out the others' pulls or stall their pushes.

``checked_tensor_stream`` looks at each announced tensor (name, dtype, shape) of a stream of
``TensorChunk``s before the decoder allocates it: an unknown name, a shape other than the expected
one, or more bytes than the expected tensors hold are refused before a byte is reserved.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import CodecError, dtype_name, torch_dtype


class Overloaded(Exception):
    """A limit on held requests is reached (RESOURCE_EXHAUSTED); the message names it."""


SHARD_KEY = "transport.max_waiting_pulls"
PEER_KEY = "transport.max_waiting_pulls_per_peer"


@dataclass(frozen=True)
class PullLimits:
    """Per shard: ``per_shard`` waiting pulls in all, ``per_peer`` from one peer, each at most ``max_wait_s``.

    Set by the job file (``SHARD_KEY``, ``PEER_KEY``, ``transport.pull_timeout_s``); a refusal names the key, so
    the operator of a job whose workers are refused knows which setting to raise."""

    per_shard: int = 4096
    per_peer: int = 256
    max_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if self.per_shard < 1 or self.per_peer < 1 or not self.max_wait_s > 0:
            raise ValueError(f"pull limits must be positive, got {self}")


class PullAdmission:
    def __init__(self, limits: PullLimits = PullLimits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._total = 0
        self._by_peer: dict[str, int] = {}

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._total

    @contextmanager
    def admit(self, peer: str, requested_wait_s: float | None) -> Iterator[float]:
        """Hold a place for one pull of ``peer``; yields how long it may wait (the server-side deadline)."""
        with self._lock:
            if self._total >= self.limits.per_shard:
                raise Overloaded(
                    f"{self._total} pulls already wait on this shard (limit {self.limits.per_shard}, {SHARD_KEY}); "
                    "retry later"
                )
            held = self._by_peer.get(peer, 0)
            if held >= self.limits.per_peer:
                raise Overloaded(
                    f"{peer} already has {held} pulls waiting on this shard "
                    f"(limit {self.limits.per_peer} per peer, {PEER_KEY})"
                )
            self._total += 1
            self._by_peer[peer] = held + 1
        try:
            wait = self.limits.max_wait_s if requested_wait_s is None else min(requested_wait_s, self.limits.max_wait_s)
            yield max(0.0, wait)
        finally:
            with self._lock:
                self._total -= 1
                left = self._by_peer[peer] - 1
                if left:
                    self._by_peer[peer] = left
                else:
                    del self._by_peer[peer]


def checked_tensor_stream(
    chunks: Iterator[pb.TensorChunk], expected: Mapping[str, tuple[int, tuple[int, ...]]]
) -> Iterator[pb.TensorChunk]:
    """Pass ``chunks`` on, each tensor's announcement checked against ``expected`` (name -> dtype, shape).

    Raises ``CodecError`` (INVALID_ARGUMENT) for an unknown name, another dtype or shape, and
    ``Overloaded`` (RESOURCE_EXHAUSTED) once the stream carries more bytes than the expected tensors.
    """
    budget = sum(_nbytes(dtype, shape) for dtype, shape in expected.values())
    received = 0
    current = None
    for chunk in chunks:
        if chunk.name != current:
            if chunk.name not in expected:
                known = ", ".join(sorted(expected)) or "none"
                raise CodecError(f"no tensor named {chunk.name!r} is expected here (expected: {known})")
            dtype, shape = expected[chunk.name]
            if chunk.dtype != dtype or tuple(chunk.shape) != shape:
                raise CodecError(
                    f"tensor {chunk.name!r} announced as {dtype_name(chunk.dtype)} {tuple(chunk.shape)}; "
                    f"expected {dtype_name(dtype)} {shape}"
                )
            current = chunk.name
        received += len(chunk.data)
        if received > budget:
            raise Overloaded(f"the stream carries more than the {budget} bytes its expected tensors hold")
        yield chunk


def _nbytes(dtype: int, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty(0, dtype=torch_dtype(dtype)).element_size()
