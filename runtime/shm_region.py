"""Shared-memory regions for colocated workers and shards (issue 12): the file layout and both ends' mapping.

A region is a file in ``/dev/shm`` (mode 0600, a random name) made by the PS shard: a 4 KiB header
(magic, the nonce, the number of float32 elements) and then the data, page-aligned. The worker maps
it with ``mmap`` and views it with ``torch.frombuffer`` (no copy); a pushed piece is written at its
offset in the push region and the shard copies it out once, a pulled piece is written by the shard
into the pull region and the worker copies it into its destination once.

Why a nonce in the file: a worker that is not on the shard's host (or in another ``/dev/shm``
namespace) either cannot open the path or finds a different file there; reading back the nonce the
shard announced over gRPC proves it mapped *the* region. Every shm push and pull echoes the nonce,
so a call built for regions the shard has since replaced is refused instead of reading stale bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import mmap
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from urllib.parse import unquote

import torch

SHM_DIR = "/dev/shm"
PREFIX = "pstrain-"
MAGIC = b"PSTRSHM1"
HEADER_BYTES = 4096
NONCE_BYTES = 16
_HEADER = struct.Struct("<8s16sq")  # magic, nonce, numel
_NAMED: set[str] = set()  # regions this process made and has not unlinked yet (unlinked at exit)


class ShmError(Exception):
    """A region that cannot be made or mapped, or is not the one announced."""


@dataclass
class Region:
    """One mapped region; ``data`` views its float32 elements (valid until ``close``)."""

    path: str
    nonce: bytes
    data: torch.Tensor
    _map: mmap.mmap | None

    @property
    def numel(self) -> int:
        return self.data.numel()

    def close(self) -> None:
        """Drop this end's references; the pages are unmapped with the last view of them.

        Never ``mmap.close()`` here: ``torch.frombuffer`` keeps the mmap object alive but holds no buffer export,
        so closing the map would succeed under an in-flight copy and leave it reading unmapped memory.
        """
        self.data = torch.empty(0)
        self._map = None


def create(numel: int, nonce: bytes, directory: str = SHM_DIR) -> Region:
    """A new region of ``numel`` float32 elements under a random name, readable by this user only."""
    if numel < 0:
        raise ShmError(f"negative region size {numel}")
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise ShmError(f"cannot create {path}: {exc}") from exc
    try:
        size = HEADER_BYTES + 4 * numel
        os.ftruncate(fd, size)
        # Every page now, not on first write: a tmpfs that fills up (Docker's 64 MiB /dev/shm, many workers) then
        # refuses the region here, where the caller streams instead, rather than killing the writer with SIGBUS.
        os.posix_fallocate(fd, 0, size)
        mapped = mmap.mmap(fd, size)
    except OSError as exc:
        os.close(fd)
        unlink(path)
        raise ShmError(
            f"cannot size {path} to {HEADER_BYTES + 4 * numel} bytes: {exc} (a colocated worker needs two regions "
            f"of its shard's size per shard; enlarge {directory} (Docker: --shm-size) or set "
            f"transport.shared_memory: off)"
        ) from exc
    os.close(fd)
    mapped[: _HEADER.size] = _HEADER.pack(MAGIC, nonce, numel)
    _NAMED.add(path)
    return Region(path, nonce, _view(mapped, numel), mapped)


def attach(path: str, numel: int, nonce: bytes) -> Region:
    """Map a region another process made; ``ShmError`` unless it is there, of that size, with that nonce."""
    if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
        raise ShmError(f"{path!r} is not a pstrain region")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise ShmError(f"cannot open {path}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + 4 * numel:
            raise ShmError(f"{path} holds {size} bytes, expected {HEADER_BYTES + 4 * numel}")
        mapped = mmap.mmap(fd, size)
    except OSError as exc:
        raise ShmError(f"cannot map {path}: {exc}") from exc
    finally:
        os.close(fd)
    magic, found, count = _HEADER.unpack(mapped[: _HEADER.size])
    if magic != MAGIC or count != numel or not secrets.compare_digest(found, nonce):
        mapped.close()
        raise ShmError(f"{path} is not the region the shard announced (nonce differs)")
    return Region(path, nonce, _view(mapped, numel), mapped)


def unlink(path: str) -> None:
    _NAMED.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@atexit.register
def _unlink_named() -> None:
    for path in list(_NAMED):
        unlink(path)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine: loopback, or an address a socket can bind."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        if address.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); empty for others (unix sockets)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host, _, _ = unquote(rest).rpartition(":")
    return host.strip("[]")


def _view(mapped: mmap.mmap, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    return torch.frombuffer(mapped, dtype=torch.float32, count=numel, offset=HEADER_BYTES)
