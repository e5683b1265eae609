"""A PS shard cut into pieces that are collected and updated independently (S4).

The pieces of a shard are its range cut at the workers' gradient-bucket boundaries
(``runtime.buckets.shard_pieces``). Each piece is a ``ParameterShard`` of its own: its own
version, optimizer state, published buffer, in-order summing, non-finite refusal and skip —
so the sync protocol of ``shard.py`` holds per piece unchanged (exactly one contribution per
worker per step, duplicates idempotent, stale/ahead rejected, bad input changes nothing).
A piece whose contributions are all in updates at once, while the workers are still pushing
(and computing the backward for) the shard's other pieces.

The whole shard, as the checkpoints, the export and whole-shard pushes/pulls see it:

* version = the lowest piece version; a whole-shard read waits until every piece is at the
  same version ``>= min_version`` (a worker pulling version v always finds that: no piece can
  pass v before this worker has pushed step v) and lends the pieces' published buffers
  concatenated (one copy: whole-shard pulls serve the coordinator's export and old clients).
* a whole-shard push is validated in full (every piece's step check and the finiteness of the
  whole gradient) before any piece takes it, so a rejected push still changes nothing.
* a checkpoint of version t is the concatenation of the pieces at t, in the format of an
  unpieced shard (one parameter vector, one optimizer state), so checkpoints do not depend on
  ``bucket_bytes``: each piece snapshots itself at t, the last one to do so hands the joined
  state on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointError, ShardState
from pstrain.ps_server.errors import InvalidArgument, WaitTimeout
from pstrain.ps_server.layerwise import Layers
from pstrain.ps_server.shard import PUSH_DTYPES, CheckpointPolicy, ParameterShard, PushResult, ShardSnapshot
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.shm_board import Board

log = logging.getLogger(__name__)


class PiecedShard:
    """The shard one PS process serves: its pieces, each a ``ParameterShard``, in flat order."""

    def __init__(self, pieces: Sequence[ParameterShard], checkpoints: CheckpointPolicy | None = None) -> None:
        if not pieces:
            raise InvalidArgument("a shard needs at least one piece")
        for a, b in zip(pieces, pieces[1:], strict=False):
            if a.end != b.start or a.shard_id != b.shard_id or a.workers != b.workers:
                raise InvalidArgument(f"pieces [{a.start}, {a.end}) and [{b.start}, {b.end}) do not join up")
        self.pieces = list(pieces)
        self.shard_id = pieces[0].shard_id
        self.start = pieces[0].start
        self.end = pieces[-1].end
        self._by_start = {p.start: p for p in self.pieces}
        self._checkpoints = checkpoints
        self._snapshots: dict[int, dict[int, ShardState]] = {}  # version -> piece start -> its state
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls,
        pieces: Sequence[ShardRange],
        initial: torch.Tensor,
        optimizer: pb.OptimizerSpec,
        schedule: pb.LrSchedule,
        workers: int,
        version: int = 0,
        optimizer_state: dict[str, Any] | None = None,
        checkpoints: CheckpointPolicy | None = None,
        layers: Layers | None = None,
        push_dtype: int = pb.FLOAT32,
    ) -> PiecedShard:
        """A shard of ``pieces`` (one shard's range cut in flat order) starting from ``initial``."""
        start, end = pieces[0].start, pieces[-1].end
        if initial.dim() != 1 or initial.numel() != end - start:
            raise InvalidArgument(f"shard needs {end - start} initial values, got shape {tuple(initial.shape)}")
        states = split_optimizer_state(optimizer_state, [p.end - p.start for p in pieces])
        shard = cls.__new__(cls)
        policy = None
        if checkpoints is not None:
            policy = CheckpointPolicy(checkpoints.every_steps, checkpoints.final_version, shard._piece_snapshot)
        built = [
            ParameterShard(
                p.shard_id,
                p.start,
                p.end,
                initial[p.start - start : p.end - start],
                optimizer,
                schedule,
                workers,
                version=version,
                optimizer_state=state,
                checkpoints=policy,
                layers=None if layers is None else layers.restrict(p.start - start, p.end - start),
                push_dtype=push_dtype,
            )
            for p, state in zip(pieces, states, strict=True)
        ]
        cls.__init__(shard, built, checkpoints)
        return shard

    @classmethod
    def restore(
        cls,
        state: ShardState,
        pieces: Sequence[ShardRange],
        optimizer: pb.OptimizerSpec,
        schedule: pb.LrSchedule,
        workers: int,
        checkpoints: CheckpointPolicy | None = None,
        layers: Layers | None = None,
        push_dtype: int = pb.FLOAT32,
    ) -> PiecedShard:
        """A shard continuing from a checkpoint (written with any bucket size; see ``split_optimizer_state``)."""
        if (state.start, state.end) != (pieces[0].start, pieces[-1].end):
            raise InvalidArgument(
                f"checkpoint holds [{state.start}, {state.end}), the shard is [{pieces[0].start}, {pieces[-1].end})"
            )
        return cls.build(
            pieces,
            state.params,
            optimizer,
            schedule,
            workers,
            state.version,
            state.optimizer,
            checkpoints,
            layers,
            push_dtype,
        )

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def workers(self) -> int:
        return self.pieces[0].workers

    @property
    def push_dtype(self) -> int:
        return self.pieces[0].push_dtype

    @property
    def version(self) -> int:
        return min(p.version for p in self.pieces)

    @property
    def version_now(self) -> int:
        """``version`` without the pieces' locks (``ParameterShard.version_now``)."""
        return min(p.version_now for p in self.pieces)

    def piece(self, piece_start: int, numel: int) -> ParameterShard:
        """The piece ``[piece_start, piece_start + numel)``; ``InvalidArgument`` if that is not one of ours."""
        found = self._by_start.get(piece_start)
        if found is None or found.numel != numel:
            ours = ", ".join(f"[{p.start}, {p.end})" for p in self.pieces[:8])
            raise InvalidArgument(
                f"[{piece_start}, {piece_start + numel}) is not a piece of shard {self.shard_id} (its pieces: {ours}"
                f"{', ...' if len(self.pieces) > 8 else ''}); do the worker and the shard use the same bucket_bytes?"
            )
        return found

    # ------------------------------------------------------------------ push

    def check_push(
        self,
        shard_id: int,
        worker_id: int,
        step: int,
        device_count: int,
        dtype: int,
        numel: int,
        piece_start: int | None = None,
    ) -> bool:
        """``ParameterShard.check_push`` for one piece, or for every piece of a whole-shard push."""
        if piece_start is not None:
            return self.piece(piece_start, numel).check_push(shard_id, worker_id, step, device_count, dtype, numel)
        self._check_whole(numel)
        duplicates = [p.check_push(shard_id, worker_id, step, device_count, dtype, p.numel) for p in self.pieces]
        return all(duplicates)

    def check_header(
        self, shard_id: int, worker_id: int, device_count: int, dtype: int, numel: int, piece_start: int | None = None
    ) -> None:
        """``ParameterShard.check_header`` (no lock) for one piece or the whole shard: every piece has the same job."""
        if piece_start is not None:
            self.piece(piece_start, numel).check_header(shard_id, worker_id, device_count, dtype, numel)
            return
        self._check_whole(numel)
        first = self.pieces[0]
        first.check_header(shard_id, worker_id, device_count, dtype, first.numel)

    def _check_whole(self, numel: int) -> None:
        if numel != self.numel:
            raise InvalidArgument(
                f"shard {self.shard_id} owns {self.numel} elements [{self.start}, {self.end}), push has {numel}"
            )

    def push(
        self,
        worker_id: int,
        step: int,
        grad: torch.Tensor | None,
        device_count: int,
        skip: bool = False,
        piece_start: int | None = None,
        recycle: Callable[[torch.Tensor], None] | None = None,
        lent: bool = False,
    ) -> PushResult:
        """One worker's contribution to one piece (``piece_start``) or to all of them. ``recycle`` as in
        ``ParameterShard.push``, for a piece's push or a whole shard of one piece (a push to several pieces is cut
        into views: none is adopted); ``lent`` as there, for every piece."""
        if piece_start is None and len(self.pieces) == 1 and grad is not None and grad.numel() == self.numel:
            piece_start = self.start
        if piece_start is not None:
            found = self._by_start.get(piece_start)
            numel = (found.numel if found is not None else 0) if grad is None else grad.numel()
            piece = self.piece(piece_start, numel)
            return piece.push(worker_id, step, grad, device_count, skip=skip, recycle=recycle, lent=lent)
        numel = self.numel if grad is None else grad.numel()
        dtype = self.push_dtype if grad is None else PUSH_DTYPES.get(grad.dtype, pb.DTYPE_UNSPECIFIED)
        duplicate = self.check_push(self.shard_id, worker_id, step, device_count, dtype, numel)
        if grad is not None and not duplicate and grad.dim() == 1 and not all_finite(grad):
            raise InvalidArgument(
                f"worker {worker_id}'s gradient for step {step} has NaN or Inf values; a worker skips such a "
                f"step (fault.on_nonfinite) instead of pushing it"
            )
        results = [
            p.push(
                worker_id,
                step,
                None if grad is None else grad[p.start - self.start : p.end - self.start],
                device_count,
                skip=skip,
                lent=lent,
            )
            for p in self.pieces
        ]
        return PushResult(
            min(r.version for r in results),
            duplicate=all(r.duplicate for r in results),
            completed=all(r.completed for r in results),
            update_s=sum(r.update_s for r in results),
            skipped=any(r.skipped for r in results),
        )

    # ------------------------------------------------------------------ pull

    @contextmanager
    def read(
        self, min_version: int, timeout_s: float, piece_start: int | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """One piece's ``read``, or the whole shard at one version ``>= min_version`` (see the module doc)."""
        if piece_start is not None:
            with self._piece_at(piece_start).read(min_version, timeout_s) as lent:
                yield lent
            return
        if len(self.pieces) == 1:
            with self.pieces[0].read(min_version, timeout_s) as lent:
                yield lent
            return
        deadline = time.monotonic() + timeout_s
        want = min_version
        while True:
            with ExitStack() as stack:
                held: list[tuple[int, torch.Tensor]] = []
                for p in self.pieces:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise WaitTimeout(
                            f"shard {self.shard_id} is at version {self.version}; version {min_version} did not "
                            f"appear within {timeout_s:.1f}s (are all {self.workers} workers pushing?)"
                        )
                    held.append(stack.enter_context(p.read(want, remaining)))
                versions = {v for v, _ in held}
                if len(versions) == 1:
                    joined = torch.cat([t for _, t in held])
                    break
                want = max(versions)  # pieces in mid-step: wait for the laggards to catch up
        yield versions.pop(), joined

    def last_step_of(self, worker_id: int) -> int:
        """The last step ``worker_id`` contributed to every piece: whether a failed worker's push reached all."""
        return min(p.last_step_of(worker_id) for p in self.pieces)

    @contextmanager
    def read_at(self, version: int, timeout_s: float, piece_start: int | None = None) -> Iterator[torch.Tensor]:
        """One piece, or the whole shard, at exactly ``version`` (``ParameterShard.read_at``): a replacement worker
        reads the held step's parameters even where its failed predecessor's push already moved a piece on."""
        pieces = self.pieces if piece_start is None else [self._piece_at(piece_start)]
        deadline = time.monotonic() + timeout_s
        with ExitStack() as stack:
            lent = [stack.enter_context(p.read_at(version, max(0.0, deadline - time.monotonic()))) for p in pieces]
            yield lent[0] if len(lent) == 1 else torch.cat(lent)

    def publish_on(self, board: Board) -> None:
        """Issue 12: every piece publishes into its place on ``board`` (``ParameterShard.publish_on``)."""
        if board.numel != self.numel or board.pieces != len(self.pieces):
            raise InvalidArgument(
                f"a board of {board.numel} elements in {board.pieces} pieces for a shard of {self.numel} in "
                f"{len(self.pieces)}"
            )
        for index, p in enumerate(self.pieces):
            p.publish_on(board.piece(index, p.start - self.start, p.numel))

    def board_slot(self, piece_start: int, min_version: int) -> tuple[int, int] | None:
        """A piece's newest version on the board and its slot, if ``min_version`` or newer (``ParameterShard``)."""
        return self._piece_at(piece_start).board_slot(min_version)

    def _piece_at(self, piece_start: int) -> ParameterShard:
        piece = self._by_start.get(piece_start)
        if piece is None:
            raise InvalidArgument(f"{piece_start} is not where a piece of shard {self.shard_id} starts")
        return piece

    def parameters(self) -> tuple[int, torch.Tensor]:
        """The current parameters and the lowest piece version (for tests and checkpoints)."""
        got = [p.parameters() for p in self.pieces]
        return min(v for v, _ in got), torch.cat([t for _, t in got])

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> ShardState:
        """The pieces' states joined (consistent when no step is in flight, e.g. at the end of a job)."""
        return join_states([p.checkpoint_state() for p in self.pieces])

    def _piece_snapshot(self, state: ShardState) -> None:
        """A piece reached a checkpoint version; the last piece to reach it hands on the joined state."""
        with self._lock:
            held = self._snapshots.setdefault(state.version, {})
            held[state.start] = state
            if len(held) < len(self.pieces):
                return
            del self._snapshots[state.version]
        assert self._checkpoints is not None
        self._checkpoints.on_snapshot(join_states([held[p.start] for p in self.pieces]))

    # ------------------------------------------------------------------ lifecycle

    def each(self, call: Callable[[ParameterShard], object]) -> None:
        """Apply ``call`` to every piece: the one place a whole-shard change (e.g. the expected
        worker count at a step boundary, issue 11) reaches the pieces."""
        for p in self.pieces:
            call(p)

    def set_workers(self, from_version: int, ids: Sequence[int], scaled_lr: float) -> tuple[bool, bool]:
        """``ParameterShard.set_workers`` on every piece (``cluster.min_workers``); returns (every piece, some
        piece) kept a removed worker's contribution to step ``from_version`` (it pushed some pieces before it died).
        Every piece is asked first (``check_workers``): one that refuses leaves every piece as it was."""
        for p in self.pieces:
            p.check_workers(from_version, ids, scaled_lr)
        included = [p.set_workers(from_version, tuple(ids), scaled_lr) for p in self.pieces]
        log.info(
            "shard %d: workers %s contribute from step %d on (lr %g)", self.shard_id, list(ids), from_version, scaled_lr
        )
        return all(included), any(included)

    def close(self) -> None:
        self.each(ParameterShard.close)

    def snapshot(self) -> ShardSnapshot:
        parts = [p.snapshot() for p in self.pieces]
        return ShardSnapshot(
            self.shard_id,
            self.start,
            self.end,
            min(s.version for s in parts),
            max(s.pushes_waiting for s in parts),
            parts[0].workers_expected,
            sum(s.bytes_held for s in parts),
            parts[0].optimizer,
            max(s.skipped_steps for s in parts),
        )


def as_pieced(shard: ParameterShard | PiecedShard) -> PiecedShard:
    """A bare ``ParameterShard`` as a shard of one piece (tests and benches build those)."""
    return shard if isinstance(shard, PiecedShard) else PiecedShard([shard])


# ---------------------------------------------------------------------- optimizer state: join and split

_PER_PIECE = "piece_values"  # entries that are not per element and differ between pieces (e.g. Adam's step)
_PIECE_SIZES = "piece_sizes"  # with ``_PER_PIECE``: the writer's pieces, whose values those are
_ABSENT = "absent"  # under ``_PER_PIECE``: the piece had no such entry (it never stepped: torch makes state lazily)


def join_states(states: Sequence[ShardState]) -> ShardState:
    """One shard's state from its pieces' states at the same version, as an unpieced shard writes it.

    Per-element optimizer tensors (same length as their piece) are concatenated; anything else
    (step counters) is taken from the first piece that has it, and kept per piece under ``piece_values``
    when the pieces disagree (a step one piece skipped and another applied). A piece that never stepped
    has no state at all (torch makes it at the first step): its span of a per-element entry is zeros and it
    is marked absent under ``piece_values``, so restoring it with the same pieces starts it fresh again.
    """
    first = states[0]
    if len(states) == 1:
        return first
    versions = {s.version for s in states}
    if len(versions) != 1:
        raise InvalidArgument(f"pieces snapshotted at different versions {sorted(versions)}")
    params = torch.cat([s.params for s in states])
    entries = [s.optimizer["state"].get(0, {}) for s in states]
    keys = list(dict.fromkeys(key for entry in entries for key in entry))  # every piece's, in first-seen order
    joined: dict[str, Any] = {}
    per_piece: list[dict[str, Any]] = [{} for _ in states]
    for key in keys:
        values = [e.get(key) for e in entries]
        present = [(v, st) for v, e, st in zip(values, entries, states, strict=True) if key in e]
        if all(_per_element(v, st.end - st.start) for v, st in present):
            like = present[0][0]
            joined[key] = torch.cat(
                [
                    v if key in e else torch.zeros(st.end - st.start, dtype=like.dtype)
                    for v, e, st in zip(values, entries, states, strict=True)
                ]
            )
            if len(present) < len(states):
                for kept, e in zip(per_piece, entries, strict=True):
                    if key not in e:
                        kept[key] = _ABSENT
            continue
        value = present[0][0]
        joined[key] = value
        if len(present) < len(states) or any(not _same(v, value) for v, _ in present):
            for kept, v, e in zip(per_piece, values, entries, strict=True):
                kept[key] = v if key in e else _ABSENT
    groups = first.optimizer["param_groups"]
    optimizer: dict[str, Any] = {"state": {0: joined} if joined else {}, "param_groups": groups}
    if any(per_piece):
        optimizer[_PER_PIECE] = per_piece
        optimizer[_PIECE_SIZES] = [st.end - st.start for st in states]
    return ShardState(first.shard_id, first.start, states[-1].end, first.version, params, optimizer)


def split_optimizer_state(state: dict[str, Any] | None, sizes: Sequence[int]) -> list[dict[str, Any] | None]:
    """The inverse of ``join_states`` for pieces of ``sizes`` (which may differ from the writer's).

    With other pieces than the writer's, a piece's per-piece values are those of the writer's first piece; that
    cannot stand for a piece that had never stepped (its state is absent, not the first piece's), so such a
    checkpoint is only restored with the pieces it was written with."""
    if state is None:
        return [None] * len(sizes)
    if len(sizes) == 1 and _PER_PIECE not in state:
        return [state]
    entry = state["state"].get(0, {})
    total = sum(sizes)
    per_piece = state.get(_PER_PIECE)
    written = state.get(_PIECE_SIZES)  # older checkpoints lack it: their piece count is all there is to compare
    same = per_piece is not None and (
        list(written) == list(sizes) if written is not None else len(per_piece) == len(sizes)
    )
    if per_piece is not None and not same:
        if any(_absent(v) for kept in per_piece for v in kept.values()):
            cut = f"pieces of {list(written)} elements" if written is not None else f"{len(per_piece)} pieces"
            raise CheckpointError(
                f"this checkpoint was written by a shard cut into {cut}, some of which had never stepped (their "
                f"optimizer state is empty); it restores only into those pieces, not {list(sizes)}: resume with "
                "the transport.bucket_bytes it was written with"
            )
        # Another bucketing wrote it: each piece takes the values of the written pieces it overlaps, which must agree
        # (a step count that one piece has and another lacks, after a skip, is no rounding: Adam's bias correction).
        per_piece = _regroup(per_piece, written, sizes)
    out: list[dict[str, Any] | None] = []
    offset = 0
    for index, n in enumerate(sizes):
        piece: dict[str, Any] = {}
        for key, value in entry.items():
            kept = per_piece[index] if per_piece is not None else {}
            if _absent(kept.get(key)):
                continue  # this piece had never stepped: torch makes its state at its first step
            if _per_element(value, total):
                piece[key] = value[offset : offset + n].clone()
            elif key in kept:
                piece[key] = kept[key].clone() if isinstance(kept[key], torch.Tensor) else kept[key]
            else:
                piece[key] = value.clone() if isinstance(value, torch.Tensor) else value
        offset += n
        out.append({"state": {0: piece} if piece else {}, "param_groups": [dict(g) for g in state["param_groups"]]})
    return out


def _regroup(
    per_piece: Sequence[dict[str, Any]], written: Sequence[int] | None, sizes: Sequence[int]
) -> list[dict[str, Any]]:
    """The per-piece values of ``per_piece`` (for the writer's pieces of ``written`` elements) for pieces of ``sizes``:
    a piece takes the values of the written pieces it overlaps; ``CheckpointError`` where those differ."""
    if written is None:
        raise CheckpointError(
            f"this checkpoint's {len(per_piece)} pieces hold different optimizer step counts (a step some skipped) "
            f"and it does not say their sizes; it restores only into {len(per_piece)} pieces, not {list(sizes)}: "
            "resume with the transport.bucket_bytes it was written with"
        )
    bounds = [0]
    for n in written:
        bounds.append(bounds[-1] + n)
    out: list[dict[str, Any]] = []
    start = 0
    for n in sizes:
        end = start + n
        over = [j for j in range(len(written)) if bounds[j] < end and start < bounds[j + 1]] if n else []
        kept: dict[str, Any] = {}
        for key in dict.fromkeys(k for j in over for k in per_piece[j]):
            values = [per_piece[j].get(key) for j in over]
            if any(not _same(v, values[0]) for v in values):
                raise CheckpointError(
                    f"this checkpoint was written by a shard cut into pieces of {list(written)} elements whose "
                    f"optimizer state {key!r} differs ({', '.join(str(_plain(v)) for v in values)}: a step some of "
                    f"them skipped); [{start}, {end}) of the shard spans several of them, so it restores only into "
                    f"pieces none of which spans two that differ, not {list(sizes)}: resume with the "
                    "transport.bucket_bytes it was written with"
                )
            kept[key] = values[0]
        out.append(kept)
        start = end
    return out


def _plain(value: object) -> object:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _absent(value: object) -> bool:
    return isinstance(value, str) and value == _ABSENT


def _per_element(value: object, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
