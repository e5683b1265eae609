"""How the event loop's pulls learn that a shard (or a piece) reached a version, and the buffers pushes land in.

Pulls wait as suspended coroutines, not parked threads, so a shard serves any number of waiting
workers (issue 12: no thread cap). Two ways to wait, by what the pull needs:

* ``VersionFollower``: a pull streamed over gRPC needs the version encoded; one thread per shard
  (or piece) follows the published versions and every pull of a version is served from one
  encoding of it.
* ``VersionMarks``: a shared-memory or bulk pull needs no encoding, so no thread either: it waits
  for an event that the calls which may move the shard on set, and reads the version lock-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Protocol

import torch

from pstrain.protos.codec import EncodedReplies
from pstrain.ps_server.errors import NotReady, PsError, WaitTimeout
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.within import Within

FOLLOW_POLL_S = 1.0  # how often a version follower looks whether its server has stopped


class StagingPool:
    """Reuses the buffers pushes are received into (as many per size as pushes are staged at once): a 100 MB
    allocation per push costs page faults. Keyed by size: a shard receives whole-shard pushes and pieces' pushes."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def acquire(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of the pushed dtype: a bfloat16 push (issue 12) is widened once, into the shard's accumulator."""
        with self._lock:
            free = self._free.get((numel, dtype))
            return free.pop() if free else torch.empty(numel, dtype=dtype)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)


class VersionFollower:
    """The newest published version of a shard (or of one of its pieces), as the event loop's pulls see it.

    One thread waits on the shard (``ParameterShard.read``, which holds the shard's lock only
    briefly) for each next version and hands it to the loop; pulls await it there. So the loop
    never blocks on the shard's lock (an update holds it), and waiting pulls hold no thread.
    A closed shard fails every pull with ``NotReady`` from then on.

    The thread follows on demand (issue 12): once a version is out and no pull waits or has asked
    since, it idles until the next pull instead of reading (for a whole shard: joining its pieces)
    and encoding every later version for nobody. A pull that finds it idle waits for a version read
    after it asked, so it gets the shard's newest, as it would from a busy follower. In steady
    training every step's pulls keep it busy; what idles is, say, the whole-shard follower the
    workers' first pull made, which would otherwise copy the shard twice per step for the whole run.
    """

    def __init__(
        self,
        shard: ParameterShard | PiecedShard,
        chunk_bytes: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._shard = shard
        self._chunk_bytes = chunk_bytes
        self._loop = loop
        self._latest: EncodedReplies | None = None
        self._closed: str | None = None
        self._changed = asyncio.Event()
        self._waiting = 0
        self._waiting_changed = threading.Condition()
        self._demand = threading.Event()  # a pull asked since the follower last read a version
        self._idle = False  # the follower waits for demand: ``_latest`` may be older than the shard
        self._posts = 0  # versions handed to the loop (loop side)
        name = f"shard-{shard.shard_id}-{shard.start}-versions"
        threading.Thread(target=self._follow, name=name, daemon=True).start()

    @property
    def waiting(self) -> int:
        with self._waiting_changed:
            return self._waiting

    def wait_until_waiting(self, count: int, timeout_s: float) -> bool:
        with self._waiting_changed:
            return self._waiting_changed.wait_for(lambda: self._waiting >= count, timeout_s)

    async def get(self, min_version: int, timeout_s: float) -> EncodedReplies:
        """The encoded replies of ``min_version`` or newer, once the shard has published it."""
        deadline = self._loop.time() + timeout_s
        self._demand.set()
        fresh_after = self._posts if self._idle else -1  # idle: only a version read from now on is the newest
        self._count_waiting(+1)
        try:
            while True:
                if self._closed is not None:
                    raise NotReady(self._closed)
                latest = self._latest
                if latest is not None and latest.version >= min_version and self._posts > fresh_after:
                    return latest
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    at = "no version yet" if latest is None else f"version {latest.version}"
                    raise WaitTimeout(
                        f"shard {self._shard.shard_id} is at {at}; version {min_version} did not appear within "
                        f"{timeout_s:.1f}s (are all {self._shard.workers} workers pushing?)"
                    )
                await _next_change(self._changed, remaining)
        finally:
            self._count_waiting(-1)

    def _count_waiting(self, delta: int) -> None:
        with self._waiting_changed:
            self._waiting += delta
            self._waiting_changed.notify_all()

    def _follow(self) -> None:
        """The one thread per shard that waits for versions (ends with the loop or the shard)."""
        want = 0
        while not self._loop.is_closed():
            if want and not self._demand.is_set() and not self.waiting:
                self._idle = True
                if not self._demand.wait(FOLLOW_POLL_S):
                    continue  # looks again whether the server has stopped
            if self._idle:
                # Out of idling however that ended: the wait above, or a pull that came as it timed out (seen at the
                # top). That pull waits for a version read after it asked (``get``): reading the next one instead
                # would keep it waiting for a step its own worker has yet to push.
                self._idle, want = False, 0  # the newest version, whichever it is
            self._demand.clear()
            try:
                with self._shard.read(want, FOLLOW_POLL_S) as (version, published):
                    # Encoded while the read lease keeps the shard from reusing this buffer.
                    encoded = EncodedReplies(version, published, self._chunk_bytes).encode_all()
            except WaitTimeout:
                continue
            except PsError as exc:  # the shard closed: NotReady
                self._post(None, str(exc))
                return
            if not self._post(encoded, None):
                return
            want = version + 1

    def _post(self, encoded: EncodedReplies | None, closed: str | None) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._publish, encoded, closed)
        except RuntimeError:  # the loop closed: the server has stopped
            return False
        return True

    def _publish(self, encoded: EncodedReplies | None, closed: str | None) -> None:
        if closed is not None:
            self._closed = closed
        else:
            assert encoded is not None
            self._latest = encoded
            self._posts += 1
        self._changed.set()  # wakes the pulls waiting now; later ones wait on a fresh event
        self._changed = asyncio.Event()


class Versioned(Protocol):
    """What ``VersionMarks`` reads of what it follows: a dense shard or piece, or a shard's sparse tables."""

    @property
    def shard_id(self) -> int: ...

    @property
    def workers(self) -> int: ...

    @property
    def version_now(self) -> int: ...


class VersionMarks:
    """When a piece (or the whole shard) reaches a version, as shared-memory, bulk and row pulls wait for it (issue 12).

    Those pulls need no encoding, so no follower thread either: they wait on the loop for an event the data plane sets
    after every call that may move the shard on (a push that completed a piece, ``SetWorkers``), and read the
    version without the shard's lock (``version_now``). A waiting pull also looks every ``FOLLOW_POLL_S``, so a
    version reached some other way is seen within that time. No thread wakes per version and per piece, and a pull
    that finds its version already there does not wait at all.
    """

    def __init__(self, source: Versioned) -> None:
        self._source = source
        self._changed = asyncio.Event()

    async def get(self, min_version: int, timeout_s: float) -> None:
        """Return once the source is at ``min_version`` or newer (``NotReady`` once closed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (version := self._source.version_now) < min_version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WaitTimeout(
                    f"shard {self._source.shard_id} is at version {version}; version {min_version} did not appear "
                    f"within {timeout_s:.1f}s (are all {self._source.workers} workers pushing?)"
                )
            await _next_change(self._changed, min(remaining, FOLLOW_POLL_S))

    def moved(self) -> None:
        """The source may be at a newer version (on the loop): the waiting pulls look again."""
        self._changed.set()
        self._changed = asyncio.Event()


async def _next_change(changed: asyncio.Event, limit_s: float) -> None:
    """Return once ``changed`` is set or ``limit_s`` has passed, whichever comes first; the caller looks again.

    ``Within``, not ``asyncio.wait_for``: before Python 3.12 the latter lost a cancel that came as the event was
    set, and a pull whose caller had gone went on waiting (holding its place among the shard's waiting pulls)
    until its version came or its timeout passed. Here a cancel always ends the wait."""
    with contextlib.suppress(TimeoutError):
        await Within(limit_s)(changed.wait())
