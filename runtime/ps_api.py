"""What a worker needs from the parameter server, independent of how it is reached.

Shaped like ps-lite's ``KVWorker``: ``push`` returns a handle at once and ``wait`` collects the
shards' acknowledgements; ``pull`` blocks until a version exists and writes it into a buffer
the caller owns. Two implementations keep the same contract (``tests/test_ps_client_contract.py``
runs one suite against both):

- ``pstrain.runtime.ps_client.PsClient``: gRPC streams to every shard, concurrently.
- ``pstrain.ps_server.local_client.LocalPsClient``: calls in-memory ``ParameterShard``s directly,
  so the trainer is unit-tested without a network.

Errors are the seam's own: each implementation translates what its transport raises (gRPC
status codes, the shard's ``PsError``s) into the hierarchy below, so a caller handles a stale
step or a timeout the same way whichever client it holds. Anything the mapping does not name
(an internal server error, a bug) is raised unchanged.

Retries live with the caller, not in the clients: a push is idempotent per (worker, step) and
a pull is read-only, so ``with_retries`` can repeat a whole call after an ``Unavailable``, and
the trainer passes its stop flag as the backoff wait so SIGTERM cuts a backoff short.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pstrain.runtime.shard_map import ShardRange

T = TypeVar("T")


class PsClientError(Exception):
    """Base of every error a ``ParameterServerClient`` raises on purpose."""


class InvalidRequest(PsClientError, ValueError):
    """Wrong size, dtype or shape of a buffer, or a request a shard finds malformed (INVALID_ARGUMENT)."""


class UnknownWorker(PsClientError):
    """The shards do not know this worker id (NOT_FOUND)."""


class StepConflict(PsClientError):
    """A push for a step the shard is not at: stale (past) or ahead of it (FAILED_PRECONDITION)."""


class Unavailable(PsClientError):
    """A shard cannot be reached, is not ready yet or is shutting down (UNAVAILABLE); retryable."""


class WaitTimeout(PsClientError):
    """A call did not finish within its deadline, e.g. a pull of a version nobody produces (DEADLINE_EXCEEDED)."""


class Cancelled(PsClientError):
    """The client was closed: ``close(cancel=True)`` cut the call short, or it came after ``close``."""


RETRYABLE: tuple[type[PsClientError], ...] = (Unavailable,)


@dataclass(frozen=True)
class ShardAck:
    """One shard's answer to one push."""

    shard_id: int
    version: int  # the shard's version after this push
    duplicate: bool  # already counted for this (worker, step): acknowledged, not counted again
    completed: bool  # this push was the last of its step and the shard applied the update
    skipped: bool = False  # the step completed without an update (some worker skipped it)


@dataclass
class PushHandle:
    """One push in flight to every shard; ``wait`` returns the acknowledgements in shard order.

    A shard's error is raised from ``wait``, not from ``push``: the other shards' slices are
    already on their way, and the caller decides whether to repeat the (idempotent) push.
    """

    futures: list[Future[ShardAck]]

    def wait(self) -> list[ShardAck]:
        return [result_of(f) for f in self.futures]


@dataclass
class PullHandle:
    """Pulls of some pieces in flight; ``wait`` returns the version they agree on (``pull_pieces``)."""

    futures: list[Future[int]]

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> int:
        return agreed_version([result_of(f) for f in self.futures])


def result_of(future: Future[T]) -> T:
    """``future.result()``, with a future dropped by ``close(cancel=True)`` reported as ``Cancelled``."""
    try:
        return future.result()
    except CancelledError as exc:
        raise Cancelled("the parameter-server client was closed before this call started") from exc


class ParameterServerClient(Protocol):
    """A worker's view of the sharded parameter server (S1.2, synchronous).

    The flat float32 parameter vector of ``total`` elements is split by ``ranges`` (from
    ``shard_map.shard_ranges``, the one shard map). Version v of the parameters is the result
    of steps 0..v-1; a worker pulls version t, computes step t, pushes it and pulls t + 1.
    """

    ranges: list[ShardRange]
    total: int

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        """Send every shard its slice of ``flat`` (contiguous 1-D float32, ``total`` long) for ``step``.

        ``flat`` is the sum of ``device_count`` devices' gradients; the shard divides the step's
        total by the sum of the device counts pushed for it. Raises ``InvalidRequest`` at once
        for a wrong buffer; shard errors (``StepConflict``, ``UnknownWorker``, ...) come from
        ``wait``. Repeating a push for the same (worker, step) is acknowledged as a duplicate
        and not counted twice.
        """
        ...

    def skip_step(self, worker_id: int, step: int, device_count: int) -> PushHandle:
        """Contribute to ``step`` without a gradient: the step completes on every shard without an
        update (``fault.on_nonfinite: skip``). Same sync rules as ``push``: one per (worker, step).
        """
        ...

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        """``push`` of only ``pieces`` (S4, ``runtime.buckets``): each piece ``[start, end)`` of ``flat`` goes to
        its shard, which collects and updates it apart from its other pieces. The sync rules hold per piece.
        A piece that is not one of the shard's raises ``InvalidRequest`` (from ``wait``)."""
        ...

    def skip_pieces(self, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int) -> PushHandle:
        """``skip_step`` for only ``pieces``: each completes ``step`` without an update."""
        ...

    def push_targets(self, pieces: Sequence[ShardRange], worker_id: int) -> list[torch.Tensor | None]:
        """Per piece, host memory a GPU may copy the piece's gradient into for ``push_pull_pieces(placed=...)`` to
        send from where it lies (``PsClient``: a colocated shard's page-locked push region), or None."""
        ...

    def push_pull_pieces(
        self,
        flat: torch.Tensor,
        pieces: Sequence[ShardRange],
        worker_id: int,
        step: int,
        device_count: int,
        out: torch.Tensor,
        placed: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[PushHandle, PullHandle]:
        """``push_pieces``, then ``pull_pieces`` of version ``step + 1`` into ``out`` once the pushes are acknowledged;
        returns at once. A push's error is also the pull's (the caller repeats the push, then the pull).
        ``push_then_pull`` does exactly this for the whole set; a transport may instead pull each piece once it is
        acknowledged, or fold a piece's push and pull into one call (``PsClient``, over shared memory).
        ``placed[i]``, where given, holds piece i's gradient in place of ``flat`` (``placed_sources``): a GPU copied
        it into the piece's ``push_targets`` memory, which a transport sends it from without a copy."""
        ...

    def pull_pieces(self, min_version: int, out: torch.Tensor, pieces: Sequence[ShardRange]) -> PullHandle:
        """Start pulling ``pieces`` at ``min_version`` or newer into their ranges of ``out``; returns at once.

        The caller waits on the handle (per bucket, before the next forward needs it); errors come
        from ``wait``, as for ``pull``."""
        ...

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        """Wait until every shard is at ``min_version`` or newer, fill ``out``, return the version.

        Raises ``WaitTimeout`` past the client's pull deadline and ``Cancelled`` when the
        client is closed with ``cancel=True`` meanwhile.
        """
        ...

    def contributed(self, worker_id: int) -> int:
        """The last step ``worker_id`` contributed to every piece of every shard (-1: none), without waiting:
        whether a failed worker's last push reached everywhere (S2.5, a replacement's rejoin)."""
        ...

    def pull_at(self, version: int, out: torch.Tensor) -> None:
        """Fill ``out`` with exactly version ``version`` of every shard (S2.5, a replacement's rejoin).

        A shard keeps the version before its current one, so this succeeds where a failed worker
        pushed step ``version`` to some pieces only (they are one version ahead). Raises
        ``StepConflict`` when a shard is past ``version + 1`` and ``WaitTimeout`` as ``pull`` does.
        """
        ...

    def close(self, cancel: bool = False) -> None:
        """Release the client. Without ``cancel`` calls in flight finish first; with it they
        fail at once with ``Cancelled`` (how a worker honours SIGTERM during a blocked pull).
        Every later call raises ``Cancelled``."""
        ...


def push_then_pull(
    client: ParameterServerClient,
    flat: torch.Tensor,
    pieces: Sequence[ShardRange],
    worker_id: int,
    step: int,
    device_count: int,
    out: torch.Tensor,
    placed: Sequence[torch.Tensor | None] | None = None,
) -> tuple[PushHandle, PullHandle]:
    """``push_pull_pieces`` from ``push_pieces`` and ``pull_pieces``: the pull starts from the last acknowledgement's
    callback (so nothing waits for it) and its handle is one future, settled when the pull is. ``placed`` pieces
    are gathered into a copy of ``flat`` first (no transport here reads them in place)."""
    check_push_buffer(flat, client.total)
    check_pieces(pieces, client.ranges)
    sources = placed_sources(flat, pieces, placed)
    if placed is not None and any(t is not None for t in placed):  # a test's client: a copy, the caller's untouched
        flat = flat.clone()
        for p, source in zip(pieces, sources, strict=True):
            flat[p.start : p.end] = source
    pushed = client.push_pieces(flat, pieces, worker_id, step, device_count)
    if not pushed.futures:  # nothing to acknowledge: the pull (of no pieces) answers for itself
        return pushed, client.pull_pieces(step + 1, out, pieces)
    pulled: Future[int] = Future()
    left = [len(pushed.futures)]
    lock = threading.Lock()
    settled = [False]

    def settle(pull: PullHandle, _: object) -> None:
        if not pull.done():
            return
        with lock:  # the last two pulls may finish at once: one of them settles
            if settled[0]:
                return
            settled[0] = True
        try:
            version = pull.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the pull
            pulled.set_exception(exc)
        else:
            pulled.set_result(version)

    def acknowledged(_: object) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = next((f for f in pushed.futures if f.cancelled() or f.exception() is not None), None)
        if failed is not None:
            if failed.cancelled():
                pulled.cancel()
            else:
                pulled.set_exception(failed.exception())  # type: ignore[arg-type]
            return
        try:
            pull = client.pull_pieces(step + 1, out, pieces)
        except BaseException as exc:  # noqa: BLE001 - a closed client: the pull's waiter sees it
            pulled.set_exception(exc)
            return
        for future in pull.futures:
            future.add_done_callback(functools.partial(settle, pull))

    for future in pushed.futures:
        future.add_done_callback(acknowledged)
    return pushed, PullHandle([pulled])


def check_push_buffer(flat: torch.Tensor, total: int) -> None:
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != total:
        raise InvalidRequest(
            f"push needs a 1-D float32 vector of {total} elements, got {flat.dtype} of shape {tuple(flat.shape)}"
        )


def placed_sources(
    flat: torch.Tensor, pieces: Sequence[ShardRange], placed: Sequence[torch.Tensor | None] | None
) -> list[torch.Tensor]:
    """Where each piece's gradient is read from: ``placed[i]`` where given (checked to fit the piece), else its
    slice of ``flat``."""
    if placed is None:
        return [flat[p.start : p.end] for p in pieces]
    if len(placed) != len(pieces):
        raise InvalidRequest(f"placed names {len(placed)} pieces for a push of {len(pieces)}")
    sources = []
    for p, source in zip(pieces, placed, strict=True):
        if source is None:
            sources.append(flat[p.start : p.end])
            continue
        fits = source.dtype == torch.float32 and source.shape == (p.numel,) and source.device.type == "cpu"
        if not fits or not source.is_contiguous():
            raise InvalidRequest(
                f"piece [{p.start}, {p.end}) placed in a {source.device.type} {source.dtype} tensor of shape "
                f"{tuple(source.shape)}; it needs a contiguous 1-D float32 host tensor of {p.numel} elements"
            )
        sources.append(source)
    return sources


def round_push(piece: torch.Tensor, push_dtype: torch.dtype) -> torch.Tensor:
    """A float32 gradient piece as it is pushed (``transport.push_dtype``): as is, or rounded to bfloat16 (nearest
    even) once. Both clients call this, so the in-memory and the gRPC path hand the shard the same values."""
    return piece if push_dtype == torch.float32 else piece.to(push_dtype)


def check_pull_buffer(out: torch.Tensor, total: int) -> None:
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != total or not out.is_contiguous():
        raise InvalidRequest(
            f"pull needs a contiguous 1-D float32 buffer of {total} elements, "
            f"got {out.dtype} of shape {tuple(out.shape)}"
        )


def check_pieces(pieces: Sequence[ShardRange], ranges: Sequence[ShardRange]) -> None:
    """Every piece must lie inside its shard's range (a shard checks it is one of its pieces)."""
    for p in pieces:
        if not 0 <= p.shard_id < len(ranges):
            raise InvalidRequest(f"piece {p} names shard {p.shard_id}; there are {len(ranges)} shards")
        r = ranges[p.shard_id]
        if not r.start <= p.start <= p.end <= r.end:
            raise InvalidRequest(f"piece [{p.start}, {p.end}) is not inside shard {r.shard_id}'s [{r.start}, {r.end})")


def agreed_version(versions: list[int]) -> int:
    """The version every shard returned; shards that disagree mean the job is broken."""
    if len(set(versions)) != 1:
        raise RuntimeError(f"shards returned different versions {versions}; the job is inconsistent")
    return versions[0]


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to repeat a call that failed with a ``RETRYABLE`` error."""

    retries: int = 3  # repeats after the first try
    first_delay_s: float = 0.2  # doubles after every failed repeat

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be non-negative, got {self.retries}")
        if self.first_delay_s < 0:
            raise ValueError(f"first_delay_s must be non-negative, got {self.first_delay_s}")


def with_retries(
    call: Callable[[], T],
    policy: RetryPolicy,
    wait: Callable[[float], bool],
    on_retry: Callable[[PsClientError, float], None] | None = None,
) -> T:
    """Run ``call``, repeating it after a ``RETRYABLE`` error with exponential backoff.

    ``wait(delay)`` sleeps between tries and returns True to give up early (pass a stop
    event's ``wait``); giving up raises ``Cancelled`` from the last error.
    """
    delay = policy.first_delay_s
    for attempt in range(policy.retries + 1):
        try:
            return call()
        except RETRYABLE as exc:
            if attempt == policy.retries:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
            if wait(delay):
                raise Cancelled("stopped while waiting to retry a parameter-server call") from exc
            delay *= 2
    raise AssertionError("unreachable")
