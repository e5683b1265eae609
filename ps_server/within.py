"""A time limit on one await that never swallows the caller's own cancellation.

``asyncio.wait_for`` (before Python 3.12) awaits in a task of its own; a cancel of the caller that
arrives as that inner task finishes is lost (``wait_for`` returns the inner result instead). On a
shard that cancel is how gRPC says the caller is gone, so a lost one left a push waiting for a
payload that would never come (holding the worker's bulk socket), or a pull looping on for a
version nobody would read (holding its place among the waiting pulls), each until its own timeout.
``Within`` awaits in the caller's task instead, bounded by a timer that cancels that task, and
tells its own cancel from anyone else's.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Within:
    """Awaits something for at most ``limit_s`` seconds, then raises ``expired()`` (``TimeoutError`` by default)."""

    limit_s: float
    expired: Callable[[], Exception] = TimeoutError

    async def __call__(self, waiting: Awaitable[T]) -> T:
        """Awaited in the caller's own task: a cancel of the caller always ends the wait as ``CancelledError``.

        The timer's cancel is told apart by the task's count of cancel requests (``Task.uncancel``, Python 3.11+),
        so a cancel from outside that lands as the limit passes still cancels the caller rather than reading as a
        timeout (which a caller that waits in a loop would take as "look again"). Python 3.10 keeps no count:
        there such a cancel, landing in the same turn of the loop as the limit, reads as the timeout.
        """
        task = asyncio.current_task()
        assert task is not None, "Within is awaited in a task"
        before = _requests(task)
        fired = False

        def expire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.limit_s, expire)
        try:
            result = await waiting
        except asyncio.CancelledError:
            if fired and _withdraw(task) <= before:  # only the timer's cancel: the limit passed
                raise self.expired() from None
            raise
        except BaseException:  # what was awaited absorbed the timer's cancel, then failed: the request goes too
            if fired:
                _withdraw(task)
            raise
        finally:
            timer.cancel()
        if fired:  # what was awaited absorbed the timer's cancel and finished: its result stands
            _withdraw(task)
        return result


def _requests(task: asyncio.Task[Any]) -> int:
    """The cancel requests ``task`` has not withdrawn (0 on Python 3.10, which does not count them)."""
    if sys.version_info >= (3, 11):
        return task.cancelling()
    return 0


def _withdraw(task: asyncio.Task[Any]) -> int:
    """Withdraw the timer's cancel request from ``task``; the requests left (0 on Python 3.10)."""
    if sys.version_info >= (3, 11):
        return task.uncancel()
    return 0
