"""Data shards: which samples each worker trains on, and who holds which data shard (S2.5 bookkeeping).

A data shard is a slice of one epoch's sample order, never a PS shard (see ``runtime.shard_map``).
An epoch is a permutation of the dataset (seeded by job seed + epoch) cut into data shards of
``data_shard_size`` samples (the job file's ``data.shard_size``); data shard ``k`` is the
``k % per_epoch``-th slice of epoch ``k // per_epoch``.

Data order is a function of (seed, epoch, worker slot, step): worker slot ``w`` of ``slots``
gets data shards ``w, w + slots, w + 2 * slots, ...`` in that order, whenever it asks. So the
samples of a step do not depend on which worker asked first, and a job resumed from the
checkpoint of step ``t`` (``resume``) trains on exactly the samples an uninterrupted run would.

A data shard is recorded against the worker it is dispatched to and the record is cleared when
that worker reports it done; the data shards of a failed worker can be requeued for its slot
(``outstanding``/``requeue``, S2.5), so its replacement trains on them and no data is lost.
A replacement that resumes the slot at step ``t`` (the version it pulled) gets the slot
``reposition``-ed there: what the failed worker consumed before ``t`` counts as done (it was
pushed), the data shard it was inside is handed out again from the first sample of step ``t``.
Every completion is kept (``completed_ids``): the ledger that shows each sample trained once. It is
kept as runs of ids (``IdRanges``), so it stays as small as the holes in it however long the job
runs; a completion of an id already done (a bug) is kept apart and shows as a repeat.

A slot whose worker was dropped (``cluster.min_workers``, issue 11) is positioned at the step it
stops at and ``adopt``-ed by a live worker: that worker's requests then take the lowest fresh data
shard of its own slot and the adopted one, so every data shard is still dispatched once. A worker
that takes the slot back later (``release``) goes on from where the slot's sequence stands.

From then on a slot's position is no function of the step (the tracker is no longer ``positional``):
each worker's ``stream`` (the data shards dispatched to it since it began at a step) says what it
consumed, ``samples_per_step`` a step it contributed to, in dispatch order (``worker/data_feed.py``).
``_rewind`` gives back what a worker did not consume before a step (a slot repositioned, dropped), and
``state_at(t)`` is the tracker as it stood at step ``t``: what a committed checkpoint records, so a
rollback to ``t`` continues the same data assignment (``restore``) and every sample is trained once.
A committed step is never asked for again: ``fold`` then drops what the streams consumed before it, so
they stay as short as the data shards still in play, however long the job runs.

A restarted coordinator rebuilds the tracker from its journal (``coordinator/journal.py``): the
state at the last compaction (``snapshot``/``restore``) and then the same calls again, which are
deterministic. A request numbered ``seq`` that is asked again (its reply was lost with the old
coordinator) gets the same data shard; a completion asked again is refused (NOT_FOUND), which the
worker's retry takes as done (``worker/coordinator_link.py``).

Thread-safe on its own: the tracker's lock is a leaf lock, never held while calling out.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pstrain.coordinator.errors import UnknownMember, WrongState
from pstrain.coordinator.id_ranges import IdRanges

log = logging.getLogger(__name__)

Consumed = Callable[[int, int], int]
"""(worker, the step its stream began at) -> samples it consumed from its stream before a given step."""


@dataclass(frozen=True)
class DataShardAssignment:
    data_shard_id: int
    epoch: int
    indices: list[int]


@dataclass(frozen=True)
class DataShardCounts:
    todo: int  # left in the current epoch (plus requeued)
    doing: int
    done: int


class DataShardTracker:
    def __init__(self, dataset_size: int, data_shard_size: int, shuffle: bool, seed: int, slots: int = 1) -> None:
        if dataset_size <= 0:
            raise ValueError("the dataset is empty")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.dataset_size = dataset_size
        self.data_shard_size = data_shard_size
        self.shuffle = shuffle
        self.seed = seed
        self.slots = slots
        self.data_shards_per_epoch = -(-dataset_size // data_shard_size)
        self._next = list(range(slots))  # per slot: the next fresh data shard id
        self._requeued: list[deque[DataShardAssignment]] = [deque() for _ in range(slots)]
        self._doing: dict[int, tuple[int, DataShardAssignment]] = {}  # data shard id -> (worker, data shard)
        self._done = 0
        self._completed = IdRanges()  # data shard ids completed (a resumed tracker: since the resume)
        self._completed_again: list[int] = []  # ids completed a second time: empty unless something is wrong
        self._last: dict[int, tuple[int, DataShardAssignment]] = {}  # worker -> (seq, data shard) of its last request
        self._adopted: dict[int, int] = {}  # slot -> the live worker that serves it (cluster.min_workers)
        self._streams: dict[int, list[DataShardAssignment]] = {}  # worker -> data shards dispatched since its start
        self._stream_start: dict[int, int] = {}  # worker -> the step its stream began at (default ``_base``)
        self._skip: dict[int, int] = {}  # worker -> samples at its stream's head consumed before its start (``fold``)
        self._base = 0  # the step this tracker began at (a resume)
        self._settled = 0  # no state before this step can be computed (a stream was folded there)
        self.positional = True  # every slot's position is step * samples_per_step (no slot adopted or released)
        self._perm_epoch = -1
        self._perm = torch.arange(0)
        self._lock = threading.Lock()

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                # Modulo 2**64, what a generator takes: any job.seed works (smaller seeds keep their permutations).
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
                self._perm = torch.randperm(self.dataset_size, generator=gen)
            else:
                self._perm = torch.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def _slot(self, worker_id: int) -> int:
        return worker_id % self.slots

    def _served(self, worker_id: int) -> list[int]:
        """The slots a worker takes data shards from: its own, then those it adopted."""
        own = self._slot(worker_id)
        return [own, *sorted(slot for slot, w in self._adopted.items() if w == worker_id and slot != own)]

    def adopt(
        self, worker_id: int, step: int, samples_per_step: int, adopter: int, consumed: Consumed | None = None
    ) -> list[int]:
        """``worker_id`` was dropped at ``step``: position its slot there (``reposition``) and let ``adopter``
        serve it, and any slot ``worker_id`` had adopted, from now on; returns the ids counted done by the
        positioning."""
        done = self.reposition(worker_id, step, samples_per_step, consumed)
        with self._lock:
            for slot, serving in list(self._adopted.items()):  # else a slot it had adopted is served by nobody
                if serving == worker_id:
                    self._adopted[slot] = adopter
            self._adopted[self._slot(worker_id)] = adopter
            self.positional = False
        return done

    def release(self, worker_id: int, step: int) -> None:
        """A worker took ``worker_id``'s dropped slot back from ``step``: it serves the slot again from where it is."""
        with self._lock:
            self._adopted.pop(self._slot(worker_id), None)
            self._streams.pop(worker_id, None)
            self._skip.pop(worker_id, None)
            self._stream_start[worker_id] = step
            self.positional = False

    def stream_start(self, worker_id: int) -> int:
        with self._lock:
            return self._stream_start.get(worker_id, self._base)

    @property
    def pristine(self) -> bool:
        """Nothing dispatched, positioned or restored yet."""
        with self._lock:
            return self.positional and not self._streams and not self._doing and self._next == list(range(self.slots))

    def _fresh(self, slot: int) -> DataShardAssignment:
        data_shard_id = self._next[slot]
        self._next[slot] += self.slots
        epoch, k = divmod(data_shard_id, self.data_shards_per_epoch)
        order = self._order(epoch)
        size = self.data_shard_size
        return DataShardAssignment(data_shard_id, epoch, order[k * size : (k + 1) * size].tolist())

    def dispatch(self, worker_id: int, seq: int = 0) -> DataShardAssignment:
        """The next data shard of the worker's slot; request ``seq`` (> 0) asked again gets the same one.

        ``WrongState`` for a request numbered below the worker's last one, or numbered as its last one once that
        request's data shard is completed: an attempt its worker gave up on (its handler waited past the call's
        deadline) and retried, which has since moved on. Served, it would hand out a data shard nobody receives,
        counted in the worker's stream: never trained, and a later rewind would place the worker's position after
        samples it never saw. A new process of the worker numbers from 1 again, but it registers first, and every
        way back in (``requeue``, ``reposition``, a rollback) forgets the old number.
        """
        with self._lock:
            last = self._last.get(worker_id)
            if seq > 0 and last is not None and seq < last[0]:
                raise WrongState(
                    f"data shard request {seq} of worker {worker_id} arrived after its request {last[0]}: an attempt "
                    "it gave up on; nothing handed out"
                )
            if seq > 0 and last is not None and last[0] == seq:
                if last[1].data_shard_id in self._doing:
                    return last[1]
                raise WrongState(  # the worker has it done: this attempt is as late as one numbered below
                    f"data shard request {seq} of worker {worker_id} was answered with data shard "
                    f"{last[1].data_shard_id}, which it has completed since: an attempt it gave up on; "
                    "nothing handed out"
                )
            slots = self._served(worker_id)
            queue = next((self._requeued[slot] for slot in slots if self._requeued[slot]), None)
            data_shard = queue.popleft() if queue else self._fresh(min(slots, key=lambda slot: self._next[slot]))
            self._doing[data_shard.data_shard_id] = (worker_id, data_shard)
            self._streams.setdefault(worker_id, []).append(data_shard)
            if seq > 0:
                self._last[worker_id] = (seq, data_shard)
            return data_shard

    def resume(self, step: int, samples_per_step: int) -> None:
        """Position every slot where an uninterrupted run is after ``step`` steps.

        Each worker consumes ``samples_per_step`` samples a step from its slot's sequence, so
        the position is known from the step alone: whole data shards behind it count as done,
        and the one it is inside is handed out again from the first unconsumed sample.
        """
        with self._lock:
            if self._doing or any(self._requeued) or self._next != list(range(self.slots)):
                raise RuntimeError("resume() positions a fresh tracker; this one has dispatched data shards")
            self._base = self._settled = step
            for slot in range(self.slots):
                left = step * samples_per_step
                while left > 0:
                    data_shard = self._fresh(slot)
                    taken = min(left, len(data_shard.indices))
                    left -= taken
                    if taken == len(data_shard.indices):
                        self._done += 1
                    else:
                        rest = DataShardAssignment(
                            data_shard.data_shard_id, data_shard.epoch, data_shard.indices[taken:]
                        )
                        self._requeued[slot].append(rest)

    def complete(self, worker_id: int, data_shard_id: int) -> None:
        with self._lock:
            holder = self._doing.get(data_shard_id)
            if holder is None or holder[0] != worker_id:
                raise UnknownMember(f"data shard {data_shard_id} is not held by worker {worker_id}")
            del self._doing[data_shard_id]
            self._done += 1
            self._record_completed([data_shard_id])

    def reposition(
        self, worker_id: int, step: int, samples_per_step: int, consumed: Consumed | None = None
    ) -> list[int]:
        """A replacement resumes ``worker_id``'s slot at ``step``: position the slot where an
        uninterrupted run is after ``step`` steps (S2.5); returns the ids counted done here.
        A tracker no longer ``positional`` rewinds the worker's stream instead (``consumed``: how many
        samples a worker whose stream began at a step consumed before ``step``).

        The slot's dispatched-but-unfinished data shards (held, or already requeued by ``requeue``) are
        dropped: the ones wholly behind the position were trained and pushed by the failed worker before
        it could report them, so they count as done now; the one the position is inside is requeued from
        its first unconsumed sample.
        """
        with self._lock:
            if not self.positional:
                if consumed is None:
                    raise ValueError("a tracker that is not positional needs what the worker consumed")
                return self._rewind(worker_id, step, consumed)
            self._streams.pop(worker_id, None)
            self._skip.pop(worker_id, None)
            self._stream_start[worker_id] = step
            self._settled = max(self._settled, step)
            slot = self._slot(worker_id)
            doing = {dsid for dsid in self._doing if dsid % self.slots == slot}
            for dsid in doing:
                del self._doing[dsid]
            # Held, never completed: in flight, or requeued when the worker was declared failed (``requeue``
            # runs first), or the partial data shard a ``resume`` left. Those behind the position were pushed.
            held = doing | {data_shard.data_shard_id for data_shard in self._requeued[slot]}
            for worker in [w for w in self._last if self._slot(w) == slot]:
                del self._last[worker]
            dispatched_before = self._next[slot]
            self._requeued[slot].clear()
            self._next[slot] = slot
            finished: list[int] = []
            left = step * samples_per_step
            while left > 0:
                data_shard = self._fresh(slot)
                taken = min(left, len(data_shard.indices))
                left -= taken
                if taken < len(data_shard.indices):
                    rest = DataShardAssignment(data_shard.data_shard_id, data_shard.epoch, data_shard.indices[taken:])
                    self._requeued[slot].append(rest)
                elif data_shard.data_shard_id in held or data_shard.data_shard_id >= dispatched_before:
                    finished.append(data_shard.data_shard_id)
            self._done += len(finished)
            self._record_completed(finished)
            return finished

    def _record_completed(self, ids: list[int]) -> None:
        for dsid in ids:
            if not self._completed.add(dsid):
                log.error("data shard %d was completed twice: its samples were trained twice", dsid)
                self._completed_again.append(dsid)

    def _rewind(self, worker_id: int, step: int, consumed: Consumed) -> list[int]:
        """Give back what ``worker_id`` did not consume before ``step`` (the lock held); returns the ids counted done.

        Its stream's data shards wholly consumed count as done (pushed, maybe never reported); the one it was
        inside goes back from the first sample not consumed, the rest whole (a completion of one of them is undone:
        its samples are trained again), all to the head of the worker's own slot's queue in the stream's order, an
        adopted slot's data shards too: whoever serves the slot next (its replacement, its adopter, the worker
        itself after a rollback) trains them in the order the worker would have. Its stream begins again at
        ``step``.
        """
        stream = self._streams.pop(worker_id, [])
        start = self._stream_start.get(worker_id, self._base)
        left = self._skip.pop(worker_id, 0) + (consumed(worker_id, start) if start < step else 0)
        ids = {d.data_shard_id for d in stream}
        for dsid in [dsid for dsid, (w, _) in self._doing.items() if w == worker_id]:
            del self._doing[dsid]
        self._requeued = [deque(d for d in queue if d.data_shard_id not in ids) for queue in self._requeued]
        completed = self._completed
        finished: list[int] = []
        back: list[DataShardAssignment] = []
        for data_shard in stream:
            size = len(data_shard.indices)
            if left >= size:
                left -= size
                if data_shard.data_shard_id not in completed:
                    finished.append(data_shard.data_shard_id)
                continue
            back.append(replace(data_shard, indices=data_shard.indices[left:]))
            left = 0
            if data_shard.data_shard_id in completed:
                if data_shard.data_shard_id in self._completed_again:
                    self._completed_again.remove(data_shard.data_shard_id)
                else:
                    self._completed.discard(data_shard.data_shard_id)
                self._done -= 1
        if left:
            raise RuntimeError(f"worker {worker_id} consumed {left} samples more than it was handed")
        own = self._requeued[self._slot(worker_id)]  # an adopted slot's data shards too: in the stream's order
        for data_shard in reversed(back):
            own.appendleft(data_shard)
        self._done += len(finished)
        self._record_completed(finished)
        self._last.pop(worker_id, None)
        self._stream_start[worker_id] = step
        self._settled = max(self._settled, step)
        return finished

    def fold(self, step: int, consumed: Consumed) -> None:
        """Forget what the streams consumed before ``step``, a committed checkpoint's: no state before it is asked
        for again (``_settled``), so a stream keeps only what a later ``_rewind``/``state_at`` can give back and
        stays bounded however long the job runs (its size, a snapshot's, a commit's cost).

        A stream's head of data shards wholly consumed before ``step`` and no longer held (completed) is dropped and
        its start moves to ``step``; what it consumed before ``step`` of the data shards it keeps is ``_skip``.
        """
        with self._lock:
            if step <= self._settled:
                return
            held = set(self._doing) | {d.data_shard_id for queue in self._requeued for d in queue}
            for worker_id, stream in self._streams.items():
                start = self._stream_start.get(worker_id, self._base)
                if start >= step:
                    continue
                left = self._skip.get(worker_id, 0) + consumed(worker_id, start)
                dropped = 0
                for data_shard in stream:
                    size = len(data_shard.indices)
                    if size > left or data_shard.data_shard_id in held:
                        break
                    left -= size
                    dropped += 1
                del stream[:dropped]
                self._stream_start[worker_id] = step
                if left:
                    self._skip[worker_id] = left
                else:
                    self._skip.pop(worker_id, None)
            self._settled = step

    def state_at(self, step: int, consumed: Consumed, workers: tuple[int, ...]) -> dict[str, Any] | None:
        """The tracker as it stood at step ``step`` with ``workers`` training it, as a ``snapshot`` (what a
        checkpoint of ``step`` records); None when a stream was folded past ``step`` (it cannot be told).

        Every stream gives back what its worker did not consume before ``step``; a slot not among ``workers``
        is served by its adopter if that one trains at ``step``, else by the lowest of them.
        """
        with self._lock:
            if step < self._settled:
                return None
            state = self._snapshot()
        at = DataShardTracker(self.dataset_size, self.data_shard_size, self.shuffle, self.seed, self.slots)
        at.restore(state)
        with at._lock:
            for worker_id in list(at._streams):
                at._rewind(worker_id, step, consumed)
            at._base, at._stream_start, at._last, at._skip = step, {}, {}, {}
            served = {slot: at._adopted.get(slot, min(workers)) for slot in range(self.slots) if slot not in workers}
            at._adopted = {slot: (w if w in workers else min(workers)) for slot, w in served.items()}
            if at._doing:
                raise RuntimeError(f"data shards {sorted(at._doing)} are held by no stream")
            return at._snapshot()

    def completed_ids(self) -> list[int]:
        """Every data shard completed through this tracker, in id order, then any completed again (a bug)."""
        with self._lock:
            return [*self._completed, *self._completed_again]

    def outstanding(self, worker_id: int) -> list[int]:
        """The ids of the data shards a worker holds and has not completed (S2.5: what a failure loses)."""
        with self._lock:
            return sorted(dsid for dsid, (w, _) in self._doing.items() if w == worker_id)

    def requeue(self, worker_id: int) -> list[int]:
        """Put a failed worker's unfinished data shards first in line for its slot (S2.5); returns their ids."""
        with self._lock:
            mine = sorted(dsid for dsid, (w, _) in self._doing.items() if w == worker_id)
            for dsid in reversed(mine):  # back to the slot it belongs to (an adopted slot's, too)
                self._requeued[dsid % self.slots].appendleft(self._doing.pop(dsid)[1])
            self._last.pop(worker_id, None)
            return mine

    # ------------------------------------------------------------------ the journal's snapshot

    def _ref(self, data_shard: DataShardAssignment) -> list[int]:
        """A data shard as (id, samples skipped): every assignment is a suffix of its slice of the epoch."""
        full = min(
            self.data_shard_size,
            self.dataset_size - (data_shard.data_shard_id % self.data_shards_per_epoch) * self.data_shard_size,
        )
        return [data_shard.data_shard_id, full - len(data_shard.indices)]

    def _unref(self, ref: list[int]) -> DataShardAssignment:
        data_shard_id, skipped = ref
        epoch, k = divmod(data_shard_id, self.data_shards_per_epoch)
        size = self.data_shard_size
        indices = self._order(epoch)[k * size : (k + 1) * size].tolist()[skipped:]
        return DataShardAssignment(data_shard_id, epoch, indices)

    def snapshot(self) -> dict[str, Any]:
        """The tracker's state as plain JSON (sample lists as (id, skipped) references)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        return {
            "next": list(self._next),
            "requeued": [[self._ref(d) for d in queue] for queue in self._requeued],
            "doing": [[worker, *self._ref(d)] for worker, d in self._doing.values()],
            "last": [[worker, seq, *self._ref(d)] for worker, (seq, d) in self._last.items()],
            "done": self._done,
            "completed_ranges": self._completed.to_json(),
            "completed_again": list(self._completed_again),
            "adopted": [[slot, worker] for slot, worker in sorted(self._adopted.items())],
            "streams": [
                [w, self._stream_start.get(w, self._base), [self._ref(d) for d in ds]]
                for w, ds in sorted(self._streams.items())
            ],
            "starts": [[w, start] for w, start in sorted(self._stream_start.items())],
            "skips": [[w, n] for w, n in sorted(self._skip.items())],
            "base": self._base,
            "settled": self._settled,
            "positional": self.positional,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take a ``snapshot``'s state (a restarted coordinator, before replaying its journal)."""
        with self._lock:
            if len(state["next"]) != self.slots:
                raise ValueError(f"the snapshot has {len(state['next'])} slots, this tracker {self.slots}")
            self._next = [int(n) for n in state["next"]]
            self._requeued = [deque(self._unref(r) for r in queue) for queue in state["requeued"]]
            self._doing = {}
            for worker, *ref in state["doing"]:
                data_shard = self._unref(ref)
                self._doing[data_shard.data_shard_id] = (worker, data_shard)
            self._last = {worker: (seq, self._unref(ref)) for worker, seq, *ref in state["last"]}
            self._done = int(state["done"])
            if "completed_ranges" in state:
                self._completed = IdRanges.from_json(state["completed_ranges"])
                self._completed_again = [int(dsid) for dsid in state.get("completed_again", [])]
            else:  # a snapshot written before the ranges: a list of ids in completion order
                self._completed, self._completed_again = IdRanges(), []
                self._record_completed([int(dsid) for dsid in state["completed"]])
            self._adopted = {int(slot): int(worker) for slot, worker in state.get("adopted", [])}
            self._streams = {int(w): [self._unref(r) for r in refs] for w, _, refs in state.get("streams", [])}
            self._stream_start = {int(w): int(start) for w, start in state.get("starts", [])}
            self._skip = {int(w): int(n) for w, n in state.get("skips", [])}
            self._base = int(state.get("base", 0))
            self._settled = int(state.get("settled", 0))
            self.positional = bool(state.get("positional", True))

    def counts(self) -> DataShardCounts:
        with self._lock:
            fresh = sum((nxt - slot) // self.slots for slot, nxt in enumerate(self._next))
            left_in_epoch = self.data_shards_per_epoch - fresh % self.data_shards_per_epoch
            requeued = sum(len(q) for q in self._requeued)
            return DataShardCounts(todo=left_in_epoch + requeued, doing=len(self._doing), done=self._done)
