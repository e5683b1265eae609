"""A shard's shared-memory regions for colocated workers (issue 12); the servicer only adapts gRPC to this.

One pair of regions (push, pull; ``runtime.shm_region``) per worker, each the shard's size: a
worker's pushes of different pieces write disjoint offsets of its push region, its pulls of
different pieces disjoint offsets of its pull region. Bounded: a worker that opens again gets a
fresh pair and its old one is unlinked at once; every region is unlinked on ``close`` (the
server stopping) and when the worker closes its client. Only callers on this host get a pair
(the peer's address is checked here, the worker's credential by the servicer's gate).

Names do not outlive their use: the first push or pull that echoes the nonce proves the worker
has mapped both regions (it maps both before using either), so the shard unlinks both names
then; a current client has already unlinked them itself, right after mapping both. From there
the memory lives exactly as long as the two mappings, and a process killed with SIGKILL leaks
nothing in ``/dev/shm``; only a pair that was opened and never mapped waits for ``release``, a
re-open, ``close`` or the interpreter's exit (``shm_region``'s atexit hook).

Push: ``ParameterShard.push`` keeps nothing it is given once it returns (the first contribution
of a step is copied into the shard's accumulator, the next in order added to it, one that arrives
out of worker order cloned, unless it is the second in order: then it is copied into the accumulator
at once), and the worker cannot write the piece again before the push is
acknowledged, so a float32 push is read straight from the region (``view``): the worker's copy
into the region is the only one before the accumulator. The region is *lent* for the call
(``push(lent=True)``): where the push is the step's only contribution (a job of one worker) the
update reads it in place and there is no accumulator copy at all. A bfloat16 push (``transport.push_dtype``;
the region holds float32) is copied into a buffer of the pushed dtype (``take``). Pull: ``put``
copies the published piece into the pull region: one copy; the worker then copies it into its
destination. With the shard's published board (``runtime.shm_board``, one per shard, mapped read-only by
every colocated worker) a piece's pull (or a whole shard's, where the shard is one piece) names the board slot
that holds the version and the shard copies nothing: the worker copies it out of the board once.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass

import torch

from pstrain.ps_server.errors import InvalidArgument, PsError
from pstrain.runtime import shm_board, shm_region
from pstrain.runtime.shm_board import Board
from pstrain.runtime.shm_region import HEADER_BYTES, Region, ShmError

log = logging.getLogger(__name__)


class NotColocated(PsError):
    """The caller is not on this host, or shared memory is off here (FAILED_PRECONDITION: stream instead)."""


class StaleRegion(PsError):
    """The call names regions this shard no longer has for that worker (ABORTED: open again or stream)."""


@dataclass
class RegionPair:
    worker_id: int
    push: Region
    pull: Region
    named: bool = True  # the files still have names in /dev/shm

    def unlink(self) -> None:
        if self.named:
            self.named = False
            for region in (self.push, self.pull):
                shm_region.unlink(region.path)

    @property
    def nonce(self) -> bytes:
        return self.push.nonce

    def close(self) -> None:
        self.unlink()
        for region in (self.push, self.pull):
            region.close()


class SharedRegions:
    """The region pairs of one shard's workers (thread-safe; handlers run on the loop and in threads)."""

    def __init__(self, start: int, numel: int, enabled: bool = True, pieces: int = 0) -> None:
        """``pieces``: the shard's pieces, for its published board (none with 0, shared memory off, or where
        ``shm_board.SUPPORTED`` is false)."""
        self.start = start
        self.numel = numel
        self.enabled = enabled
        self._pairs: dict[int, RegionPair] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.board: Board | None = None
        if enabled and pieces and shm_board.SUPPORTED:
            try:
                self.board = shm_board.create(numel, pieces)
            except ShmError as exc:  # pulls are then copied into each worker's pull region, as before
                log.warning("no published board in shared memory: %s", exc)

    def open(self, worker_id: int, peer: str) -> RegionPair:
        """A fresh pair for ``worker_id`` (replacing and unlinking its previous one)."""
        host = shm_region.peer_host(peer)
        if not self.enabled:
            raise NotColocated("shared memory is off on this shard")
        if not host or not shm_region.is_local_host(host):
            raise NotColocated(f"peer {peer} is not on this host; stream instead")
        nonce = shm_region.new_nonce()
        push = shm_region.create(self.numel, nonce)
        try:
            pull = shm_region.create(self.numel, nonce)
        except shm_region.ShmError:
            shm_region.unlink(push.path)
            push.close()
            raise
        pair = RegionPair(worker_id, push, pull)
        with self._lock:
            if self._closed:
                pair.close()
                raise NotColocated("the shard is stopping")
            old = self._pairs.pop(worker_id, None)
            self._pairs[worker_id] = pair
        if old is not None:
            old.close()
        return pair

    def release(self, worker_id: int) -> None:
        with self._lock:
            pair = self._pairs.pop(worker_id, None)
        if pair is not None:
            pair.close()

    def drop(self, pair: RegionPair) -> None:
        """Release ``pair`` if it is still its worker's current one (an open whose caller gave up before it was
        made: a release by worker id could come first, or take a newer open's pair)."""
        with self._lock:
            if self._pairs.get(pair.worker_id) is not pair:
                return
            del self._pairs[pair.worker_id]
        pair.close()

    def close(self) -> None:
        """Unlink every region (the server stops); later opens are refused."""
        with self._lock:
            self._closed = True
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()
        if self.board is not None:
            self.board.close()

    @property
    def paths(self) -> list[str]:
        """The names of the regions not yet unlinked."""
        with self._lock:
            return [r.path for p in self._pairs.values() if p.named for r in (p.push, p.pull)]

    def pair(self, worker_id: int, nonce: bytes) -> RegionPair:
        """The worker's current pair, if ``nonce`` is its nonce; ``StaleRegion`` otherwise."""
        with self._lock:
            pair = self._pairs.get(worker_id)
        if pair is None or not secrets.compare_digest(pair.nonce, nonce):
            raise StaleRegion(f"worker {worker_id} has no shared-memory regions with that nonce on this shard")
        pair.unlink()  # the worker has mapped both: the names are no longer needed
        return pair

    def span(self, piece_start: int | None, numel: int) -> slice:
        """Where a piece (``None``: the whole shard) lies in a region; ``InvalidArgument`` if outside it."""
        offset = 0 if piece_start is None else piece_start - self.start
        if numel < 0 or offset < 0 or offset + numel > self.numel:
            raise InvalidArgument(
                f"piece [{piece_start}, +{numel}) lies outside shard [{self.start}, {self.start + self.numel})"
            )
        return slice(offset, offset + numel)

    def view(self, pair: RegionPair, where: slice) -> torch.Tensor:
        """A pushed float32 piece where it lies in the push region (the shard reads it before the ack)."""
        return self._data(pair, push=True)[where]

    def take(self, pair: RegionPair, where: slice, out: torch.Tensor) -> torch.Tensor:
        """Copy a pushed piece out of the push region into ``out`` (of the pushed dtype)."""
        out.copy_(self._data(pair, push=True)[where])
        return out

    def put(self, pair: RegionPair, where: slice, published: torch.Tensor) -> None:
        self._data(pair, push=False)[where].copy_(published)

    def _data(self, pair: RegionPair, push: bool) -> torch.Tensor:
        """``pair``'s push (or pull) region, if the pair is still its worker's; ``StaleRegion`` if the worker opened a
        new pair (or closed it, or the shard stopped) since the call found it: a pull waits for its version in
        between, and a replaced pair's tensors are emptied. Taken under the lock, before any close can start (a
        pair leaves ``_pairs`` first), the tensor keeps its pages mapped however the pair is closed meanwhile."""
        with self._lock:
            if self._pairs.get(pair.worker_id) is not pair:
                raise StaleRegion(
                    f"worker {pair.worker_id}'s shared-memory regions on this shard were replaced or closed during "
                    f"the call; open them again (or stream)"
                )
            return (pair.push if push else pair.pull).data


__all__ = ["HEADER_BYTES", "NotColocated", "RegionPair", "SharedRegions", "StaleRegion"]
