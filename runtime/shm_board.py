"""A PS shard's published board (issue 12): its two published buffers in shared memory that colocated workers map.

Before the board, a colocated pull cost the shard one copy per worker: the published piece into that worker's
pull region, in a thread hop, after which the worker copied it into its parameters. With W workers on the host
that is W copies of every piece per step on the shard, the biggest of its memory passes after the update itself.
The board holds the double buffer the shard publishes into anyway (``ParameterShard``: the published buffer
and its spare), so a pull only names where the version lies and each worker copies it out once.

Layout (one memfd, no name in ``/dev/shm``; workers open it as ``/proc/<shard pid>/fd/<fd>``, read-only):
a 4 KiB header (magic, nonce, elements, pieces), then two int64 *stamps* per piece, then the two halves of
``numel`` float32 elements each. A piece's half ``h`` is at the piece's offset in half ``h``; its stamp, slot
``2 * piece_index + h``, is the version that half holds, or ``WRITING`` while the shard writes it.

Why stamps (a seqlock): the synchronous protocol already keeps a half from being rewritten while a worker reads
it (version v+2 overwrites v's half only after every worker pushed step v+1, which it does only after it copied
v), but a worker dropped from the job, a stalled process or a bug must never load a torn mix of two versions
silently. The shard sets the stamp to ``WRITING`` before it writes a half and to the version after; a worker
copies and then reads the stamp again: the copy counts only if the stamp still names the version it was told,
and otherwise the worker pulls again the old way (the shard copies into its pull region). x86-64 keeps stores
in order and loads in order, which is what the stamps need; other platforms get no board (``SUPPORTED``).

A process killed with SIGKILL leaks nothing: the memfd has no name and lives as long as its mappings.

Who can touch it: opening ``/proc/<pid>/fd/<fd>`` needs the shard's uid (and ptrace access), and the path is
handed out only by the token-gated ``OpenSharedMemory``. Beyond that the memfd is *sealed* once the shard has
mapped it: no new writable mapping, no ``write(2)``, no resizing, so even a process that opens it read-write can
only read. The shard's own mapping, made before the seal, stays the only writable one. A kernel without
``F_SEAL_FUTURE_WRITE`` (before Linux 5.1) gets no board.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import re
import secrets
import struct
import warnings
from dataclasses import dataclass

import torch

from pstrain.runtime.shm_region import ShmError

MAGIC = b"PSTRBRD1"
PAGE = 4096  # the halves start on a page boundary, after the header page and the stamps
HEADER_BYTES = PAGE
WRITING = -1  # a stamp while the shard writes that half
_HEADER = struct.Struct("<8s16sqq")  # magic, nonce, numel, pieces
_PATH = re.compile(r"/proc/\d+/fd/\d+")
_MEMFD_NAME = "pstrain-board"
# No writable mapping or write(2) after the seal (the shard's own mapping predates it), no resizing, no unsealing.
F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1; Python's fcntl does not name it
_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# The stamp protocol relies on stores (and loads) staying in program order, which x86-64 guarantees.
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")


def stamps_bytes(pieces: int) -> int:
    """The stamps' area, padded to a page so that the halves start page-aligned."""
    return -(-16 * pieces // PAGE) * PAGE


def board_bytes(numel: int, pieces: int) -> int:
    """The memfd's size: header, stamps, and the two halves."""
    return HEADER_BYTES + stamps_bytes(pieces) + 2 * 4 * numel


@dataclass(eq=False)
class Board:
    """One mapped board. ``halves`` view the two buffers, ``stamps`` the versions they hold (per piece)."""

    path: str
    nonce: bytes
    numel: int
    pieces: int
    stamps: torch.Tensor  # int64, 2 per piece
    halves: tuple[torch.Tensor, torch.Tensor]
    _map: mmap.mmap | None
    _fd: int | None = None  # the shard's memfd (the board's only handle besides the mappings)

    def stamp(self, slot: int) -> int:
        return int(self.stamps[slot])

    def piece(self, index: int, offset: int, numel: int) -> PieceBoard:
        """Piece ``index`` of the shard, ``numel`` elements at ``offset`` in each half."""
        if not 0 <= index < self.pieces or offset < 0 or offset + numel > self.numel:
            raise ShmError(
                f"piece {index} [{offset}, +{numel}) is not on a board of {self.pieces} pieces, {self.numel}"
            )
        where = slice(offset, offset + numel)
        return PieceBoard(
            (self.halves[0][where], self.halves[1][where]), self.stamps[2 * index : 2 * index + 2], 2 * index
        )

    def copy_out(self, slot: int, version: int, where: slice, dest: torch.Tensor) -> bool:
        """The worker's end: copy ``where`` of the half in ``slot`` into ``dest``; True if the half still held
        ``version`` after the copy (otherwise ``dest`` holds garbage and the caller pulls again)."""
        if not 0 <= slot < 2 * self.pieces or self.stamp(slot) != version:
            return False
        dest.copy_(self.halves[slot % 2][where])
        return self.stamp(slot) == version

    def close(self) -> None:
        """Drop this end's references (and the shard's descriptor); the pages are unmapped with the last view.

        Never ``mmap.close()`` here: ``torch.frombuffer`` keeps the mmap object alive but does not hold a buffer
        export, so closing the map would succeed and leave the shard's published buffers (or a worker's in-flight
        copy) pointing at unmapped memory. Each view holds a reference to the mmap; it goes with the last one.
        """
        self.stamps = torch.empty(0, dtype=torch.int64)
        self.halves = (torch.empty(0), torch.empty(0))
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class PieceBoard:
    """One piece's two halves on a board and their two stamps: what ``ParameterShard`` publishes into."""

    halves: tuple[torch.Tensor, torch.Tensor]
    stamps: torch.Tensor  # int64, this piece's 2
    first_slot: int  # the board slot of half 0

    @property
    def numel(self) -> int:
        return self.halves[0].numel()

    def holds(self, buf: torch.Tensor) -> bool:
        return buf is self.halves[0] or buf is self.halves[1]

    def spare_half(self, published: torch.Tensor) -> int:
        """The half to publish the next version into: not the published one (the other, or the older of the two
        when a buffer off the board is published)."""
        if published is self.halves[0]:
            return 1
        if published is self.halves[1]:
            return 0
        first, second = self.stamps.tolist()
        return 0 if first <= second else 1

    def write(self, half: int, source: torch.Tensor, version: int) -> None:
        """Copy ``source`` into ``half`` and stamp it ``version`` (``WRITING`` meanwhile: see the module doc)."""
        self.stamps[half] = WRITING
        self.halves[half].copy_(source)
        self.stamps[half] = version

    def newest(self, min_version: int) -> tuple[int, int] | None:
        """(version, slot) of the newest half if it holds ``min_version`` or newer; None otherwise. Lock-free: the
        caller's copy is checked against the stamp afterwards."""
        first, second = self.stamps.tolist()
        half = 0 if first >= second else 1
        version = max(first, second)
        return (version, self.first_slot + half) if version >= min_version else None


def create(numel: int, pieces: int, nonce: bytes | None = None) -> Board:
    """A new board of ``numel`` elements per half and ``pieces`` pieces, stamps all ``WRITING`` (the shard's end)."""
    if numel < 0 or pieces < 1:
        raise ShmError(f"a board needs a size and at least one piece, got {numel} elements and {pieces} pieces")
    nonce = nonce or secrets.token_bytes(16)
    size = board_bytes(numel, pieces)
    try:
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        raise ShmError(f"cannot create a memfd for the board: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except OSError as exc:
        os.close(fd)
        raise ShmError(f"cannot size the board ({size} bytes): {exc}") from exc
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:  # before Linux 5.1: a board that anyone who opens it could write is no board
        mapped.close()
        os.close(fd)
        raise ShmError(f"cannot seal the board against writes by others (needs Linux 5.1 or newer): {exc}") from exc
    mapped[: _HEADER.size] = _HEADER.pack(MAGIC, nonce, numel, pieces)
    board = _view(f"/proc/{os.getpid()}/fd/{fd}", nonce, numel, pieces, mapped)
    board._fd = fd
    board.stamps.fill_(WRITING)
    return board


def attach(path: str, numel: int, pieces: int, nonce: bytes) -> Board:
    """Map another process's board read-only; ``ShmError`` unless it is one, of that size, with that nonce."""
    if not _PATH.fullmatch(path):
        raise ShmError(f"{path!r} is not a board (expected /proc/<pid>/fd/<fd>)")
    size = board_bytes(numel, pieces)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # never block on a FIFO put in its place
    except OSError as exc:
        raise ShmError(f"cannot open the board {path}: {exc}") from exc
    try:
        found_size = os.fstat(fd).st_size
        if not os.readlink(path).startswith(f"/memfd:{_MEMFD_NAME}"):
            raise ShmError(f"{path} is not a pstrain board memfd")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ShmError(f"the board {path} is not sealed against writes")
        if found_size != size:
            raise ShmError(f"the board {path} holds {found_size} bytes, expected {size}")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except OSError as exc:
        raise ShmError(f"cannot map the board {path}: {exc}") from exc
    finally:
        os.close(fd)
    magic, found, count, parts = _HEADER.unpack(mapped[: _HEADER.size])
    if magic != MAGIC or count != numel or parts != pieces or not secrets.compare_digest(found, nonce):
        mapped.close()
        raise ShmError(f"{path} is not the board the shard announced")
    return _view(path, nonce, numel, pieces, mapped)


def _view(path: str, nonce: bytes, numel: int, pieces: int, mapped: mmap.mmap) -> Board:
    with warnings.catch_warnings():  # a read-only mapping: torch warns that the tensor is not writable
        warnings.simplefilter("ignore", UserWarning)
        stamps = torch.frombuffer(mapped, dtype=torch.int64, count=2 * pieces, offset=HEADER_BYTES)
        first = HEADER_BYTES + stamps_bytes(pieces)
        halves = (
            torch.frombuffer(mapped, dtype=torch.float32, count=numel, offset=first) if numel else torch.empty(0),
            torch.frombuffer(mapped, dtype=torch.float32, count=numel, offset=first + 4 * numel)
            if numel
            else torch.empty(0),
        )
    return Board(path, nonce, numel, pieces, stamps, halves, mapped)


__all__ = ["SUPPORTED", "WRITING", "Board", "PieceBoard", "attach", "board_bytes", "create"]
