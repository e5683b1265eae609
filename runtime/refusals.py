"""Every refused request is counted and logged, and a flood of them cannot flood the log.

``note_refusal`` increments ``pstrain_rejected_requests_total{code}`` for every refusal and logs
peer, method, code and reason, at most ``BURST`` lines per (code, method) per ``WINDOW_S``; the
next line that gets through says how many were left out. Callers pass reasons that never hold
the token or a credential (the interceptors and ``identity`` word them so).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from pstrain.runtime.metrics import REJECTED

log = logging.getLogger(__name__)

WINDOW_S = 10.0
BURST = 5


class RateLimitedLog:
    """At most ``burst`` lines per key per ``window_s``; counts what it drops."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], tuple[float, int, int]] = {}  # key -> (start, logged, dropped)

    def admit(self, key: tuple[str, str]) -> int | None:
        """None: drop this line; else how many lines of ``key`` were dropped before it."""
        now = self._clock()
        with self._lock:
            start, logged, dropped = self._windows.get(key, (now, 0, 0))
            if now - start >= self._window_s:
                start, logged = now, 0
            if logged >= self._burst:
                self._windows[key] = (start, logged, dropped + 1)
                return None
            self._windows[key] = (start, logged + 1, 0)
            return dropped


_LOG = RateLimitedLog()
_COUNTERS: dict[grpc.StatusCode, Any] = {}  # code -> its labelled counter: a flood of refusals skips the label lookup


def note_refusal(code: grpc.StatusCode, method: str, peer: str, reason: str) -> None:
    """Count and (rate-limited) log one refused request: a counter increment and a dict update per refusal, the
    formatting only for the lines that get through (a refusal flood costs the log nothing)."""
    counter = _COUNTERS.get(code)
    if counter is None:
        counter = _COUNTERS[code] = REJECTED.labels(code.name)
    counter.inc()
    dropped = _LOG.admit((code.name, method))
    if dropped is None:
        return
    more = f" ({dropped} more like it not logged)" if dropped else ""
    log.warning("%s from %s refused: %s: %s%s", method, peer, code.name, reason, more)
