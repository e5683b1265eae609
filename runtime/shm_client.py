"""The PS client's side of the colocated shared-memory path (issue 12): when to use it, the mapped regions.

Negotiated once per shard connection, lazily, by the first push for a worker (pulls do not name
a worker): only for a shard whose address is this host, only if the shard grants a pair of
regions (it checks the worker's credential and that the peer is local), and only if both map and
hold the nonce the shard announced. Once both are mapped the client unlinks their names in
``/dev/shm`` itself (the mappings keep the memory), so that no later crash of either process can
leave them behind. Any failure there means "stream", never an error: the push that follows
streams and meets the same checks (a peer without the credential is refused by the push itself).
A shard that later refuses the regions (ABORTED: it replaced or dropped them) turns
them off for that shard, and the call is streamed instead.

Pushes for a worker other than the regions' own, and pulls before the first push, stream.

A piece's pull (a whole shard's, where the board shows one piece) asks the shard to name where the version lies on
its published board (``runtime.shm_board``, mapped read-only next to the regions) and copies it from there, checking
the board's stamp after the copy; a board that does not map, or a copy the stamp refuses, means the shard copies the
piece into the pull region.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime import shm_board, shm_region
from pstrain.runtime.host_pinning import HostPinning
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.shm_board import Board
from pstrain.runtime.shm_region import Region, ShmError

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0
# The shard reserves every page of both regions before it answers (``shm_region.create``): about 2 GiB/s on an idle
# host, less with every colocated worker opening at once. A fixed deadline made the workers of a big shard give up,
# stream for the whole job, and leave the shard holding the pair it went on to make; the open's deadline grows with
# the bytes to reserve at this (slow) rate.
OPEN_RESERVE_BYTES_PER_S = 128 * 2**20
_OFF = "off"


@dataclass
class MappedPair:
    worker_id: int
    nonce: bytes
    push: Region
    pull: Region
    board: Board | None = None  # the shard's published board (read-only), where it offers one and it maps
    push_pinned: bool = False  # page-locked for device copies (``runtime.host_pinning``)

    def close(self) -> None:
        self.push.close()
        self.pull.close()
        if self.board is not None:
            self.board.close()


@dataclass
class TransportCounts:
    """Payload bytes each way moved through shared memory and streamed over gRPC (tests, benchmarks)."""

    shared_bytes: int = 0
    streamed_bytes: int = 0
    board_pulls: int = 0  # piece pulls copied straight out of a shard's published board
    board_retries: int = 0  # of those, copies the board's stamp refused (pulled again through the pull region)
    push_pulls: int = 0  # pieces pushed and pulled back in one call (PushShared with pull_after)
    waited_push_pulls: int = 0  # of those, calls a client thread waited through (``ps_client.PIECE_WAITS``)
    placed_pushes: int = 0  # pieces a device had already copied into the push region (no copy here)


class SharedMemory:
    def __init__(
        self,
        addresses: Sequence[str],
        ranges: Sequence[ShardRange],
        opens: Sequence[Callable[..., pb.ShmRegions]],
        closes: Sequence[Callable[..., pb.Empty]],
        enabled: bool,
        pinning: HostPinning | None = None,
    ) -> None:
        self._addresses = list(addresses)
        self._pinning = pinning
        self._ranges = list(ranges)
        self._opens = list(opens)
        self._closes = list(closes)
        self._retired: list[MappedPair] = []
        self._enabled = enabled
        self._state: list[MappedPair | str | None] = [None] * len(addresses)  # None: not tried yet
        self._locks = [threading.Lock() for _ in addresses]
        self._count_lock = threading.Lock()
        self.counts = TransportCounts()

    def span(self, r: ShardRange) -> slice:
        """Where piece ``r`` lies in its shard's regions."""
        offset = r.start - self._ranges[r.shard_id].start
        return slice(offset, offset + r.numel)

    def for_push(self, r: ShardRange, worker_id: int) -> MappedPair | None:
        """The shard's regions if this push may use them (negotiating them on first use)."""
        state = self._state[r.shard_id]
        if state is None and self._enabled:
            with self._locks[r.shard_id]:
                if self._state[r.shard_id] is None:
                    self._state[r.shard_id] = self._negotiate(r.shard_id, worker_id)
                state = self._state[r.shard_id]
        return state if isinstance(state, MappedPair) and state.worker_id == worker_id else None

    def push_targets(self, pieces: Sequence[ShardRange], worker_id: int) -> list[torch.Tensor | None]:
        """Per piece, its span of a page-locked push region (negotiated on first use), or None."""
        targets: list[torch.Tensor | None] = []
        for r in pieces:
            regions = self.for_push(r, worker_id)
            targets.append(regions.push.data[self.span(r)] if regions is not None and regions.push_pinned else None)
        return targets

    def for_pull(self, shard_id: int) -> MappedPair | None:
        state = self._state[shard_id]
        return state if isinstance(state, MappedPair) else None

    def disable(self, shard_id: int) -> None:
        with self._locks[shard_id]:
            state, self._state[shard_id] = self._state[shard_id], _OFF
        log.warning("shard %d refused its shared-memory regions; streaming from now on", shard_id)
        # The mapping is dropped when the client closes: a call in flight may still be copying through it.
        if isinstance(state, MappedPair):
            self._retired.append(state)

    @property
    def active(self) -> list[int]:
        """The shards this client talks to through shared memory."""
        return [i for i, s in enumerate(self._state) if isinstance(s, MappedPair)]

    def count(
        self,
        shared: int = 0,
        streamed: int = 0,
        board_pulls: int = 0,
        board_retries: int = 0,
        push_pulls: int = 0,
        waited_push_pulls: int = 0,
        placed_pushes: int = 0,
    ) -> None:
        with self._count_lock:
            self.counts.shared_bytes += shared
            self.counts.streamed_bytes += streamed
            self.counts.board_pulls += board_pulls
            self.counts.board_retries += board_retries
            self.counts.push_pulls += push_pulls
            self.counts.waited_push_pulls += waited_push_pulls
            self.counts.placed_pushes += placed_pushes

    def close(self) -> None:
        """Ask each shard to unlink this client's regions (best effort: a stopping shard unlinks them itself)."""
        for shard_id, state in enumerate(self._state):
            if isinstance(state, MappedPair):
                self._release(shard_id, state.worker_id)

    def _release(self, shard_id: int, worker_id: int) -> None:
        try:
            self._closes[shard_id](pb.ShmRequest(shard_id=shard_id, worker_id=worker_id), timeout=5.0)
        except grpc.RpcError as exc:
            log.info("shard %d did not release its shared-memory regions: %s", shard_id, exc.code())

    def unmap(self, unpin: bool = True) -> None:
        """Drop every mapping. No push target is handed out once this starts; ``unpin`` releases the page-locked
        regions first (while their pages are still mapped). A cancelled client passes False: its trainer's
        thread may still be queueing a GPU copy into a target it got before, and the process is about to exit,
        which releases them."""
        pairs, self._retired = self._retired, []
        for shard_id in range(len(self._state)):
            with self._locks[shard_id]:
                state, self._state[shard_id] = self._state[shard_id], _OFF
            if isinstance(state, MappedPair):
                pairs.append(state)
        for pair in pairs:
            if unpin and pair.push_pinned and self._pinning is not None:
                self._pinning.unpin(pair.push.data)
                pair.push_pinned = False
            pair.close()

    def _negotiate(self, shard_id: int, worker_id: int) -> MappedPair | str:
        host = self._addresses[shard_id].rpartition(":")[0]
        if not shm_region.is_local_host(host):
            return _OFF
        numel = self._ranges[shard_id].numel
        try:
            reply = self._opens[shard_id](
                pb.ShmRequest(shard_id=shard_id, worker_id=worker_id), timeout=open_timeout_s(numel)
            )
        except grpc.RpcError as exc:  # an older shard (UNIMPLEMENTED), a refusal: stream
            log.info("shard %d offers no shared memory (%s): streaming", shard_id, exc.code())
            return _OFF
        try:
            if reply.numel != self._ranges[shard_id].numel or reply.header_bytes != shm_region.HEADER_BYTES:
                raise ShmError(
                    f"regions of {reply.numel} elements announced for a shard of {self._ranges[shard_id].numel}"
                )
            push = shm_region.attach(reply.push_path, reply.numel, reply.nonce)
            try:
                pull = shm_region.attach(reply.pull_path, reply.numel, reply.nonce)
            except ShmError:
                push.close()
                raise
            for region in (push, pull):
                _drop_name(region.path)
        except ShmError as exc:  # not this host's /dev/shm after all: the shard may drop the regions now
            log.info("shard %d: %s; streaming", shard_id, exc)
            self._release(shard_id, worker_id)
            return _OFF
        board = None
        if reply.board_path:
            try:
                board = shm_board.attach(reply.board_path, reply.numel, reply.board_pieces, reply.board_nonce)
            except ShmError as exc:  # another pid namespace, say: its pulls are copied into the pull region
                log.info(
                    "shard %d: cannot map its published board (%s); pulls are copied for this worker", shard_id, exc
                )
        pinned = self._pinning is not None and self._pinning.pin(push.data)
        log.info(
            "shard %d: pushes and pulls go through shared memory%s%s",
            shard_id,
            " (pulls from its board)" if board else "",
            "; its push region is page-locked for device copies" if pinned else "",
        )
        return MappedPair(worker_id, reply.nonce, push, pull, board, pinned)


def open_timeout_s(numel: int) -> float:
    """The deadline of a shard's ``OpenSharedMemory`` for a shard of ``numel`` elements: two float32 regions."""
    return OPEN_TIMEOUT_S + 2 * 4 * numel / OPEN_RESERVE_BYTES_PER_S


def _drop_name(path: str) -> None:
    """Unlink a region's name once this worker has mapped it (the mapping keeps the memory): the shard would only
    unlink it at the first push or pull it reads, so a shard SIGKILLed before that (or whose worker died or was
    refused first) left the file in /dev/shm until reboot. A name this user may not unlink is left to the shard."""
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.info("cannot unlink the mapped region %s (the shard unlinks it at its first use): %s", path, exc)
