"""The asyncio server's loop: gRPC's own wake-up race while a server stops is not reported as an error (a PS shard
that exits right after it started printed an asyncio traceback: ``OSError: [Errno 9] Bad file descriptor`` from
``PollerCompletionQueue._handle_events``); every other error of the loop still is."""

from __future__ import annotations

import errno
import logging
import threading

import pytest

from pstrain.runtime.transport import AsyncioServer, is_poller_wakeup_race


def _handle_events() -> None:  # named as gRPC's poller callback, whose frame the check looks for
    raise OSError(errno.EBADF, "Bad file descriptor")


def raised(fn) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    raise AssertionError("did not raise")


def elsewhere() -> None:
    raise OSError(errno.EBADF, "Bad file descriptor")


def test_only_the_pollers_closed_or_drained_socket_is_the_race():
    assert is_poller_wakeup_race(raised(_handle_events))
    assert not is_poller_wakeup_race(raised(elsewhere))  # a closed socket of ours is a bug
    assert not is_poller_wakeup_race(RuntimeError("boom")) and not is_poller_wakeup_race(None)


@pytest.mark.parametrize("stopping", [False, True])
def test_the_loop_reports_the_race_only_while_the_server_runs(caplog, stopping):
    runner = AsyncioServer()
    try:
        runner.stopping = stopping
        reported = threading.Event()
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for exc in (raised(_handle_events), RuntimeError("a real failure")):
                runner.loop.call_soon_threadsafe(
                    runner.loop.call_exception_handler, {"message": "Exception in callback", "exception": exc}
                )
            runner.loop.call_soon_threadsafe(reported.set)
            assert reported.wait(10)
        messages = [str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio" and r.exc_info]
        expected = ["a real failure"] if stopping else ["[Errno 9] Bad file descriptor", "a real failure"]
        assert messages == expected
    finally:
        runner.stop(grace_s=0)
