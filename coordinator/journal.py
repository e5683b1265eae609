"""The coordinator's journal: its decisions, one JSON line per event, appended and fsynced.

Why: the committed manifest says where training stood at the last checkpoint; the journal says
what the coordinator decided since (a worker declared failed, its replacement, where the slot
resumed, the data shards dispatched and completed, each step's record). It is the ledger a test
or an operator reads to check that every sample was trained exactly once per epoch, and it is
compacted when a checkpoint commits: what came before is in the manifest, so the journal starts
again from a ``checkpoint`` line. A job whose checkpoints do not commit (``checkpoint.every_steps: 0``, no
checkpoint directory, a shard whose writes keep failing) compacts it too, once ``COMPACT_BYTES`` of events
were appended since the last compaction: else it grows by every step (some 750 bytes a step with two
workers) for as long as the job runs, and a restarted coordinator reads all of it back into memory.

Each line is ``{"t": <unix s>, "event": <name>, ...fields}``. A line torn by a crash mid-write is
skipped by ``read_journal``; a damaged line before the last makes the journal unusable (a rollback), and an
append that failed (disk full) is cut off again. Thread-safe: one lock around each append.

A restarted coordinator reads it back (``recovery``): the compaction writes a ``snapshot`` of the
job's state after the ``checkpoint`` line (members, credential incarnations, the data-shard
tracker, the step reports of steps not yet recorded), and every event after it says what changed
since, so the job continues where it was instead of rolling back to the checkpoint. Decisions
(registrations, failures, step records) are fsynced; the frequent events (data shards, step
reports) are written and flushed, not fsynced: they survive the coordinator's process dying, and
a host crash that loses them ends in the rollback, as a journal that cannot be used does.

The PS shards' checkpoint confirmations (``checkpoint_confirmed``, and the snapshot's ``confirmations``:
those of steps not committed yet) are kept too: a shard confirms a step once, so a coordinator that died
between the last confirmation and the commit would otherwise never commit that step (at the final step:
no final manifest). They are flushed, not fsynced: a lost one can only leave a step uncommitted (the next
checkpoint commits, a final one is retrained from the previous), never commit a wrong one.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pstrain.runtime.atomic_io import atomic_write, fsync_dir

JOURNAL_NAME = "journal.jsonl"

COMPACT_BYTES = 4 << 20
"""Events appended since the last compaction past which a job compacts without a committed checkpoint: the
journal stays a few MB (a restart reads it in well under a second) and a compaction comes every few thousand
steps, its cost (a snapshot of a few KB, one fsync) nothing against theirs."""

TRACKER_EVENTS = (
    "data_shard_dispatched",
    "data_shard_completed",
    "worker_failed",
    "worker_rejoined",
    "workers_changed",  # cluster.min_workers: a slot dropped (its data adopted) and the step ledger's workers
    "worker_returned",  # a worker that took a dropped slot back trains in it: its return is no longer pending
)
"""Events that changed the data-shard tracker, replayed in order on top of the snapshot's state."""


class JournalUnusable(Exception):
    """The journal cannot bring the job back (no job, the job is over, a line is missing): roll back."""


class Journal:
    def __init__(self, path: Path, fsync: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fsync = fsync
        self._lock = threading.Lock()
        _drop_torn_tail(path)
        self._file = self._open("ab")
        self._appended = os.fstat(self._file.fileno()).st_size  # what was there counts: nothing compacted it yet

    def _open(self, mode: str) -> IO[Any]:
        """Unbuffered: an append that failed (disk full) must leave nothing behind to be written by the next one.
        A journal this call creates has its directory entry fsynced, else a power loss can take the whole file
        after its events were reported durable."""
        created = not self.path.exists()
        handle = open(self.path, mode, buffering=0)  # noqa: SIM115 - closed in close()
        if created and self._fsync:
            fsync_dir(self.path.parent)
        return handle

    def append(self, event: str, durable: bool = True, **fields: Any) -> None:
        """Write one event (append, flush, and with ``durable`` fsync) before the decision takes effect outside.

        A failed write (``ENOSPC``) raises and is cut off again: the caller was told the decision failed, so a
        later append must not complete it, nor append after half a line (a replay refuses a damaged line)."""
        line = json.dumps({"t": round(time.time(), 6), "event": event, **fields}, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return
            fd = self._file.fileno()
            end = os.fstat(fd).st_size
            try:
                data = (line + "\n").encode()
                _write_all(fd, data)
                if self._fsync and durable:
                    os.fsync(fd)
            except OSError:
                _truncate_quietly(fd, end)
                raise
            self._appended += len(data)

    @property
    def appended_bytes(self) -> int:
        """Bytes of events appended since the last compaction or reset (a reopened journal: its whole size)."""
        with self._lock:
            return self._appended

    def compact(self, step: int, snapshot: dict[str, Any] | None = None) -> None:
        """Checkpoint ``step`` committed (or, without a new commit, the journal grew by ``COMPACT_BYTES``: ``step``
        is the last committed, -1 if none; ``recovery`` reads the snapshot, not this step): replace the journal by
        a ``checkpoint`` line and, given one, the job's ``snapshot`` (atomically: a crash leaves the old journal or
        the new one, never half)."""
        now = round(time.time(), 6)
        lines = [{"t": now, "event": "checkpoint", "step": step}]
        if snapshot is not None:
            lines.append({"t": now, "event": "snapshot", **snapshot})
        text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
            try:
                atomic_write(self.path, lambda fh: fh.write(text.encode()))
                self._appended = 0
            finally:  # failed (disk full): the old journal is whole and later events must still reach it
                self._file = self._open("ab")

    def reset(self) -> None:
        """A new job (not a recovered one): the previous job's events go."""
        with self._lock:
            self._file.close()
            self._file = self._open("wb")
            self._appended = 0
            if self._fsync:  # else a power loss can bring the previous job's events back for a restart to replay
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _truncate_quietly(fd: int, size: int) -> None:
    """Best effort: if even this fails, the next start cuts a torn last line, and a replay refuses a damaged one."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, size)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line a crash left without its newline, so the next append starts a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every complete event of a journal, oldest first; a torn last line is skipped.

    Only the last line can be torn (a crash mid-append): one before it that is not an event means the file was
    damaged, and replaying around it would silently lose a decision (a credential, a completed data shard), so
    it raises ``JournalUnusable`` naming the line."""
    lines = path.read_bytes().split(b"\n")
    tail = _event(lines.pop())  # after the last newline: nothing, or a line a crash tore
    events = []
    for number, line in enumerate(lines, 1):
        event = _event(line)
        if event is None:
            raise JournalUnusable(
                f"{path}: line {number} of {len(lines)} is not a complete event ({bytes(line[:60])!r}); "
                f"the journal was damaged, so the job resumes from its last committed checkpoint"
            )
        events.append(event)
    return events if tail is None else [*events, tail]


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


@dataclass(frozen=True)
class Recovery:
    """What a restarted coordinator takes back from its journal (see the module docstring)."""

    job_id: str
    per_device_batch: int  # the plan's batch once the probe accepted it
    start_step: int  # where the tracker began when the job started (a resume from a checkpoint), if no snapshot
    completed: int  # steps recorded
    members: list[dict[str, Any]]
    incarnations: dict[tuple[str, int], int]  # the newest credential issued per member
    replacements: int
    tracker: dict[str, Any] | None  # the snapshot's tracker state; None: a tracker positioned at start_step
    tracker_ops: list[dict[str, Any]] = field(default_factory=list)  # TRACKER_EVENTS after it, in order
    reports: list[dict[str, Any]] = field(default_factory=list)  # step reports of steps not recorded, in order
    worker_sets: list[list[Any]] = field(default_factory=list)  # the snapshot's [from step, worker ids] changes
    confirmations: list[tuple[int, int]] = field(default_factory=list)  # (shard, step) confirmed, not committed
    joining: dict[int, int] = field(default_factory=dict)  # the snapshot's returns in progress: worker -> first step
    worker_device_bytes: int = 0  # the probe's S2.2 estimates when the job started; 0: no probe (or an older journal)
    worker_host_bytes: int = 0


def recovery(path: Path, job_hash: str = "") -> Recovery:
    """The job as its journal left it; ``JournalUnusable`` when it cannot be continued from it.

    Events are taken in order: a ``snapshot`` (the compaction's) sets every part anew, and each
    later event changes it; ``job_started``, written when training began, names the job. Given the
    ``job_hash`` of the job file now, a journal whose job records another is refused: its decisions were
    made for another model, data or optimizer (a journal that records none, an older one, is taken).
    """
    if not path.exists():
        raise JournalUnusable(f"no journal at {path}")
    events = read_journal(path)
    job: dict[str, Any] | None = None
    members: list[dict[str, Any]] = []
    incarnations: dict[tuple[str, int], int] = {}
    tracker: dict[str, Any] | None = None
    ops: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    worker_sets: list[list[Any]] = []
    confirmations: list[tuple[int, int]] = []
    joining: dict[int, int] = {}
    completed = replacements = 0
    for event in events:
        kind = event["event"]
        if kind == "job_over":
            raise JournalUnusable(f"the journal's job is over ({event.get('state')}: {event.get('message', '')})")
        if kind in ("job_started", "snapshot"):
            job = event
            completed = max(completed, event["completed"])
        if kind == "snapshot":
            members, tracker = event["members"], event["tracker"]
            incarnations = {(role, member_id): n for role, member_id, n in event["incarnations"]}
            reports, ops, replacements = list(event["reports"]), [], event["replacements"]
            worker_sets = list(event.get("worker_sets", []))
            confirmations = [(shard, step) for shard, step in event.get("confirmations", [])]
            joining = {int(worker): int(step) for worker, step in event.get("joining", [])}
        elif kind == "members":
            members = event["members"]
        elif kind == "credential":
            incarnations[(event["role"], event["id"])] = event["incarnation"]
        elif kind == "step":
            completed = max(completed, event["step"] + 1)
        elif kind == "report":
            reports.append(event["report"])
        elif kind == "worker_registered" and event.get("replacement"):
            replacements += 1
        elif kind == "checkpoint_confirmed":
            confirmations.append((event["shard"], event["step"]))
        elif kind == "checkpoint_committed":
            confirmations = [(shard, step) for shard, step in confirmations if step > event["step"]]
        if kind in TRACKER_EVENTS:
            ops.append(event)
    if job is None:
        raise JournalUnusable("the journal holds no running job (the coordinator died before training began)")
    if not members:
        raise JournalUnusable("the journal names no members")
    recorded = job.get("job_hash", "")
    if job_hash and recorded and recorded != job_hash:
        raise JournalUnusable(
            f"the journal's job {job.get('job_id')} was started from another job file (hash {recorded}, this one "
            f"{job_hash}); restore that job file to take the job back"
        )
    return Recovery(
        job_id=job["job_id"],
        per_device_batch=job["per_device_batch"],
        start_step=job["start_step"],
        completed=completed,
        members=members,
        incarnations=incarnations,
        replacements=replacements,
        tracker=tracker,
        tracker_ops=ops,
        reports=[r for r in reports if r["step"] >= completed],
        worker_sets=worker_sets,
        confirmations=confirmations,
        joining=joining,
        worker_device_bytes=int(job.get("worker_device_bytes", 0)),
        worker_host_bytes=int(job.get("worker_host_bytes", 0)),
    )
