"""A pull whose caller is gone stops waiting at once (``ps_server.within``), whenever the cancel lands.

gRPC cancels a handler's task when its caller goes away. Before Python 3.12, ``asyncio.wait_for``
lost a cancel that arrived as the event it waited for was set: the pull looked again, found its
version not there yet and went on waiting, holding its place among the shard's waiting pulls, until
its timeout. Each test lands the cancel a few turns of the loop after the wake-up, one offset per
trial, so one of them falls in that window.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import EncodedReplies
from pstrain.ps_server.shard import ParameterShard
from pstrain.ps_server.versions import VersionFollower, VersionMarks
from pstrain.ps_server.within import Within

OFFSETS = range(8)  # turns of the loop between the wake-up and the cancel
PULL_WAIT_S = 60.0  # what a pull would hold its place for, had it missed its cancel
PROMPT_S = 2.0  # how long a cancelled pull may take to end


class Source:
    """What ``VersionMarks`` follows, at a version the test sets."""

    shard_id = 0
    workers = 2

    def __init__(self) -> None:
        self.version_now = 0


async def turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


async def cancelled_promptly(task: asyncio.Task[Any], offset: int) -> None:
    assert task.cancel(), "the pull ended before it was cancelled"
    await asyncio.wait([task], timeout=PROMPT_S)
    assert task.done(), f"cancelled {offset} turns after the wake-up, the pull went on waiting"
    assert task.cancelled()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


@pytest.mark.parametrize("offset", OFFSETS)
def test_a_shared_memory_or_bulk_pull_cancelled_as_the_shard_moves_stops_waiting(offset):
    async def main() -> None:
        source = Source()
        marks = VersionMarks(source)
        pull = asyncio.create_task(marks.get(5, PULL_WAIT_S))
        await turns(3)  # waiting
        source.version_now = 1  # a push moved the shard on, not yet to the version the pull waits for
        marks.moved()
        await turns(offset)
        await cancelled_promptly(pull, offset)

    run(main)


def test_a_streamed_pull_cancelled_as_a_version_is_published_stops_waiting_and_leaves_no_waiter():
    shard = ParameterShard(0, 0, 4, torch.zeros(4), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1.0), 2)

    async def main() -> None:
        follower = VersionFollower(shard, 1024, asyncio.get_running_loop())
        for offset in OFFSETS:
            pull = asyncio.create_task(follower.get(99, PULL_WAIT_S))
            await until(lambda: follower.waiting == 1, "the pull to wait")
            # A newer version, not the one the pull waits for: published as the follower's thread does.
            follower._publish(EncodedReplies(offset + 1, torch.zeros(4), 1024), None)
            await turns(offset)
            await cancelled_promptly(pull, offset)
            assert follower.waiting == 0, "a cancelled pull still counts as waiting"

    try:
        run(main)
    finally:
        shard.close()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 keeps no count of a task's cancel requests")
@pytest.mark.parametrize("offset", OFFSETS)
def test_a_cancel_that_lands_as_the_limit_passes_is_a_cancel_not_a_timeout(offset):
    """A caller that waits in a loop takes a timeout as "look again": the cancel must win."""

    async def main() -> None:
        never = asyncio.Event()
        waiting = asyncio.create_task(Within(0.0)(never.wait()))  # the limit passes on the turn after it starts
        await turns(1 + offset)
        if waiting.cancel():
            await asyncio.wait([waiting], timeout=PROMPT_S)
            assert waiting.cancelled(), f"cancelled {offset} turns in, the wait ended as {waiting.exception()!r}"
        else:  # the limit came and went first
            assert isinstance(waiting.exception(), TimeoutError)

    run(main)


def test_the_limit_raises_the_callers_error_and_withdraws_its_own_cancel():
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(LookupError, match="too late"):
            await Within(0.01, lambda: LookupError("too late"))(asyncio.Event().wait())
        if sys.version_info >= (3, 11):  # asyncio.timeout or a TaskGroup later in this task is not misled
            assert task.cancelling() == 0
        assert await Within(5.0)(asyncio.sleep(0, result="in time")) == "in time"

    run(main)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 keeps no count of cancel requests")
def test_a_wait_that_absorbs_the_limits_cancel_and_then_fails_leaves_no_cancel_request_behind():
    async def absorbs_then_fails() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("failed on its way out") from None

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(ValueError, match="on its way out"):
            await Within(0.01)(absorbs_then_fails())
        assert task.cancelling() == 0  # an asyncio.timeout or a TaskGroup later in this task is not misled

    run(main)
