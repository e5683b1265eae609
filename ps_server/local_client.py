"""An in-memory ``ParameterServerClient``: calls ``ParameterShard``s directly, no network.

It keeps the gRPC client's contract (``tests/test_ps_client_contract.py`` runs one suite on
both) so the trainer is unit-tested without sockets. The shard's ``PsError``s become the
same ``ps_api`` errors the gRPC client derives from status codes; any other error is raised
unchanged.

Pushes run on the caller's thread, one shard after another; a shard's error still comes from
``PushHandle.wait``, as it does over gRPC. (With LARS/LAMB and a parameter split across shards,
the push that completes one holder's step waits there for the other holder's norms, which may
need this caller's next push: such a job needs its pushes made at once, as the gRPC client's
calls are; ``tests/test_rejoin_pull.py`` has such a client.) A pull waits on each shard in
slices of ``CANCEL_POLL_S`` so that ``close(cancel=True)`` from another thread ends it
promptly without closing the shards, which other clients (other workers) share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from pstrain.ps_server import errors as shard_errors
from pstrain.ps_server.pieces import PiecedShard, as_pieced
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.ps_api import (
    Cancelled,
    InvalidRequest,
    PsClientError,
    PullHandle,
    PushHandle,
    ShardAck,
    StepConflict,
    Unavailable,
    UnknownWorker,
    WaitTimeout,
    agreed_version,
    check_pieces,
    check_pull_buffer,
    check_push_buffer,
    push_then_pull,
    round_push,
)
from pstrain.runtime.shard_map import ShardRange, shard_ranges

# The shard's error -> the client error; the same pairs the gRPC path makes via status codes.
ERRORS: dict[type[shard_errors.PsError], type[PsClientError]] = {
    shard_errors.InvalidArgument: InvalidRequest,
    shard_errors.UnknownWorker: UnknownWorker,
    shard_errors.StepConflict: StepConflict,
    shard_errors.NotReady: Unavailable,
    shard_errors.WaitTimeout: WaitTimeout,
}

CANCEL_POLL_S = 0.05  # the longest a cancelled pull keeps waiting on a shard


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except shard_errors.PsError as exc:
        error = next((ERRORS[cls] for cls in type(exc).__mro__ if cls in ERRORS), None)
        if error is None:
            raise
        raise error(str(exc)) from exc


class LocalPsClient:
    """A client over shards in this process. It does not own them: ``close`` leaves them open."""

    def __init__(
        self,
        shards: Sequence[ParameterShard | PiecedShard],
        pull_timeout_s: float = 600.0,
        push_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``push_dtype``: gradients are handed to the shards as this (``transport.push_dtype``), rounded as the
        gRPC client rounds them (``round_push``)."""
        if not shards:
            raise ValueError("a parameter-server client needs at least one shard")
        self.total = shards[-1].end
        self.ranges: list[ShardRange] = shard_ranges(self.total, len(shards))
        held = [ShardRange(s.shard_id, s.start, s.end) for s in shards]
        if held != self.ranges:
            raise ValueError(f"shards {held} do not follow the shard map {self.ranges}; pass them in shard order")
        self._shards = [as_pieced(s) for s in shards]
        self._pulls: ThreadPoolExecutor | None = None  # pull_pieces' waits; made on first use
        self._pull_timeout_s = pull_timeout_s
        self._push_dtype = push_dtype
        self._cancel = threading.Event()
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        check_push_buffer(flat, self.total)
        return self._push(flat, worker_id, step, device_count)

    def skip_step(self, worker_id: int, step: int, device_count: int) -> PushHandle:
        return self._push(None, worker_id, step, device_count)

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        check_push_buffer(flat, self.total)
        check_pieces(pieces, self.ranges)
        return self._push(flat, worker_id, step, device_count, pieces)

    def skip_pieces(self, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int) -> PushHandle:
        check_pieces(pieces, self.ranges)
        return self._push(None, worker_id, step, device_count, pieces)

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
        check_pull_buffer(out, self.total)  # before anything is pushed
        return push_then_pull(self, flat, pieces, worker_id, step, device_count, out, placed)

    def push_targets(self, pieces: Sequence[ShardRange], worker_id: int) -> list[torch.Tensor | None]:
        """None for every piece: the shards in this process read the pushed tensor itself."""
        check_pieces(pieces, self.ranges)
        return [None] * len(pieces)

    def _push(
        self,
        flat: torch.Tensor | None,
        worker_id: int,
        step: int,
        device_count: int,
        pieces: Sequence[ShardRange] | None = None,
    ) -> PushHandle:
        futures: list[Future[ShardAck]] = []
        with self._call():
            for r in self.ranges if pieces is None else pieces:
                shard = self._shards[r.shard_id]
                future: Future[ShardAck] = Future()
                try:
                    with _translated():
                        piece = None if flat is None else round_push(flat[r.start : r.end], self._push_dtype)
                        result = shard.push(
                            worker_id,
                            step,
                            piece,
                            device_count,
                            skip=flat is None,
                            piece_start=None if pieces is None else r.start,
                        )
                except Exception as exc:  # noqa: BLE001 - delivered by wait(), as over gRPC
                    future.set_exception(exc)
                else:
                    future.set_result(
                        ShardAck(r.shard_id, result.version, result.duplicate, result.completed, result.skipped)
                    )
                futures.append(future)
        return PushHandle(futures)

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        check_pull_buffer(out, self.total)
        with self._call():
            deadline = time.monotonic() + self._pull_timeout_s
            versions = [
                self._pull_one(shard, min_version, out[r.start : r.end], deadline)
                for r, shard in zip(self.ranges, self._shards, strict=True)
            ]
        return agreed_version(versions)

    def contributed(self, worker_id: int) -> int:
        with self._call():
            return min(shard.last_step_of(worker_id) for shard in self._shards)

    def pull_at(self, version: int, out: torch.Tensor) -> None:
        check_pull_buffer(out, self.total)
        with self._call(), _translated():
            deadline = time.monotonic() + self._pull_timeout_s
            for r, shard in zip(self.ranges, self._shards, strict=True):
                while True:  # in slices, as ``_pull_one`` waits: ``close(cancel=True)`` ends the wait at once
                    if self._cancel.is_set():
                        raise Cancelled(f"pull of version {version} cancelled: the client was closed")
                    remaining = deadline - time.monotonic()
                    try:
                        with shard.read_at(version, max(0.0, min(CANCEL_POLL_S, remaining))) as params:
                            out[r.start : r.end].copy_(params)
                        break
                    except shard_errors.WaitTimeout as exc:
                        if remaining > CANCEL_POLL_S:
                            continue
                        raise WaitTimeout(
                            f"shard {shard.shard_id} has no version {version} to read within "
                            f"{self._pull_timeout_s:.1f}s"
                        ) from exc

    def pull_pieces(self, min_version: int, out: torch.Tensor, pieces: Sequence[ShardRange]) -> PullHandle:
        """Each piece waits in a thread of its own (a shard's read blocks), so the caller goes on at once."""
        check_pull_buffer(out, self.total)
        check_pieces(pieces, self.ranges)
        with self._cond:
            if self._closed:
                raise Cancelled("the parameter-server client is closed")
            if self._pulls is None:
                self._pulls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="local-pull")
            pool = self._pulls
            self._in_flight += len(pieces)  # in flight from now, queued or not: ``close`` lets them finish
        deadline = time.monotonic() + self._pull_timeout_s

        def pull(p: ShardRange) -> int:
            return self._pull_one(self._shards[p.shard_id], min_version, out[p.start : p.end], deadline, p.start)

        futures: list[Future[int]] = []
        try:
            for p in pieces:
                futures.append(pool.submit(pull, p))
                futures[-1].add_done_callback(lambda _: self._landed(1))  # run, failed or cancelled by close
        except RuntimeError as exc:  # close(cancel=True) shut the pool down between the check and the submit
            self._landed(len(pieces) - len(futures))
            raise Cancelled("the parameter-server client is closed") from exc
        return PullHandle(futures)

    def _landed(self, calls: int) -> None:
        with self._cond:
            self._in_flight -= calls
            self._cond.notify_all()

    def close(self, cancel: bool = False) -> None:
        """Refuse new calls; with ``cancel`` end waiting pulls now, else wait for calls in flight."""
        with self._cond:
            self._closed = True
            if cancel:
                self._cancel.set()
                if self._pulls is not None:
                    self._pulls.shutdown(wait=False, cancel_futures=True)
                return
            while self._in_flight:
                self._cond.wait()
        if self._pulls is not None:
            self._pulls.shutdown(wait=False)

    @contextmanager
    def _call(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise Cancelled("the parameter-server client is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            self._landed(1)

    def _pull_one(
        self, shard: PiecedShard, min_version: int, dest: torch.Tensor, deadline: float, piece: int | None = None
    ) -> int:
        with _translated():
            while True:
                if self._cancel.is_set():
                    raise Cancelled(f"pull of version {min_version} cancelled: the client was closed")
                remaining = deadline - time.monotonic()
                try:
                    wait_s = max(0.0, min(CANCEL_POLL_S, remaining))
                    with shard.read(min_version, wait_s, piece_start=piece) as (version, params):
                        dest.copy_(params)
                        return version
                except shard_errors.WaitTimeout as exc:
                    if remaining > CANCEL_POLL_S:
                        continue
                    raise WaitTimeout(
                        f"shard {shard.shard_id} is at version {shard.version}; version {min_version} did not "
                        f"appear within {self._pull_timeout_s:.1f}s"
                    ) from exc
