"""Snapshots handed to a checkpoint writer in the order they were taken, though handed over outside the lock.

A shard (dense ``shard.py``, sparse ``sparse_table.py``) copies a due checkpoint's state under its lock and hands
the copy to the writer after letting go of it, since the hand-over may wait for the previous write
(backpressure). Once the lock is gone the step's version is published and the workers may complete the next due
step while the first thread is preempted or waiting: handed over first, the newer snapshot would be written first
and the older one after it (or, the writer's guard, ``SnapshotWriter._in_order``, dropping it, never written: that
checkpoint step would never be committed). ``HandOverTurns`` numbers the snapshots as they are taken, under the
shard's lock, and lets each through only after every earlier one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class HandOverTurns:
    """Turns for hand-overs: ``take`` one under the lock that orders the snapshots, then hand over ``in_turn``.

    The turn passes on however the hand-over ends (a write that failed, an exception), so a failed one never
    holds the later ones up for good.
    """

    def __init__(self, condition: threading.Condition | None = None) -> None:
        # Its own lock, not the shard's: a hand-over waits here without the shard's lock, which is never taken
        # while this one is held. ``condition`` lets a test watch who waits.
        self._cond = condition if condition is not None else threading.Condition(threading.Lock())
        self._taken = 0  # turns given out; only under the owner's lock, in snapshot order
        self._handed = 0  # hand-overs finished (or failed), under ``_cond``

    def take(self) -> int:
        """The next turn. Call it under the lock that orders the snapshots, as each is taken: that is their order."""
        turn = self._taken
        self._taken += 1
        return turn

    @contextmanager
    def in_turn(self, turn: int) -> Iterator[None]:
        """Wait until every earlier turn's hand-over has ended, run the body, then pass the turn on."""
        with self._cond:
            self._cond.wait_for(lambda: self._handed == turn)
        try:
            yield
        finally:
            with self._cond:
                self._handed += 1
                self._cond.notify_all()
