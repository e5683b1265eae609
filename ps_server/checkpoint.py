"""A shard's checkpoints: a host-memory snapshot taken under the shard's lock, written behind.

Training blocks only for the snapshot (a memcpy of the range and the optimizer state); a
background thread writes it with ``atomic_write`` (temp file, fsync, rename), so a process
killed mid-write leaves the previous file intact and never half of a new one. Once the file
is durable the writer calls ``on_written(step)``: the PS process tells the coordinator, which
commits checkpoint ``step`` only after every shard has confirmed it.

Snapshots are written in order and never skipped: if the disk is slower than the checkpoint
frequency, the next ``submit`` waits (training slows) rather than leaving a step some shard
never wrote. A snapshot no newer than one the writer already took is dropped, not written, so
each step is written (and confirmed) at most once and the newest file never moves backwards,
whatever order concurrent callers reach the queue in (a shard hands its snapshots over in
version order; this is the writer's own guard). A shard deletes only files older than the
``keep`` newest steps the coordinator has reported committed to it (each confirmation's answer
names the newest one), so the last ``keep`` committed checkpoints are always on disk whatever the
shards' relative speeds, and a step written but never committed (another shard's write failed)
costs a file, never a committed one's place. Files past the step just written are a discarded
run's and go; so do the temp files of writes a killed process left behind, when the writer starts.
"""

from __future__ import annotations

import logging
import pickle
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from pstrain.runtime.atomic_io import atomic_write

log = logging.getLogger(__name__)

S = TypeVar("S")  # a snapshot: what a SnapshotWriter writes

FORMAT_VERSION = 1
_FILE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, unreadable or belongs to another shard."""


@dataclass(frozen=True)
class ShardState:
    """Everything a shard needs to continue from ``version``: its range and optimizer state."""

    shard_id: int
    start: int
    end: int
    version: int
    params: torch.Tensor
    optimizer: dict[str, Any]  # torch.optim state_dict, tensors cloned


def shard_dir(directory: Path, shard_id: int) -> Path:
    return directory / f"shard-{shard_id}"


def shard_file(directory: Path, shard_id: int, step: int) -> Path:
    return shard_dir(directory, shard_id) / f"step-{step:09d}.pt"


def written_steps(directory: Path, shard_id: int) -> list[int]:
    """Steps this shard has a complete file for, oldest first (temp files are ignored)."""
    folder = shard_dir(directory, shard_id)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _FILE.match(p.name)))


def save_state(directory: Path, state: ShardState) -> Path:
    path = shard_file(directory, state.shard_id, state.version)
    payload = {
        "format": FORMAT_VERSION,
        "shard_id": state.shard_id,
        "start": state.start,
        "end": state.end,
        "version": state.version,
        "params": state.params,
        "optimizer": state.optimizer,
    }
    atomic_write(path, lambda fh: torch.save(payload, fh))
    return path


def load_state(directory: Path, shard_id: int, start: int, end: int, step: int) -> ShardState:
    """Read this shard's checkpoint of ``step``; refuse one of another shard, range or format."""
    path = shard_file(directory, shard_id, step)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"shard {shard_id} has no checkpoint of step {step} at {path}; is checkpoint.dir the same "
            f"directory on this host as when the checkpoint was written?"
        ) from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    expected = (FORMAT_VERSION, shard_id, start, end, step)
    found = tuple(payload.get(k) for k in ("format", "shard_id", "start", "end", "version"))
    if found != expected:
        raise CheckpointError(
            f"{path} holds (format, shard, start, end, step) = {found}, expected {expected}; "
            f"the job's model or shard count changed since it was written"
        )
    params = payload["params"]
    if not isinstance(params, torch.Tensor) or params.dtype != torch.float32 or params.numel() != end - start:
        raise CheckpointError(f"{path}: parameters do not cover [{start}, {end}) as float32")
    return ShardState(shard_id, start, end, step, params, payload["optimizer"])


@dataclass(frozen=True)
class WriteRecord:
    step: int
    write_s: float  # background time to write and fsync the snapshot


class SnapshotWriter(Generic[S]):
    """One background thread per shard that writes snapshots in order, confirms each and prunes.

    The dense range (``CheckpointWriter``) and the sparse tables
    (``sparse_checkpoint.SparseCheckpointWriter``) are written the same way; they differ only in
    what a snapshot is and where its file goes, which ``save``, ``version_of``, ``steps`` and
    ``file_of`` say.
    """

    def __init__(
        self,
        shard_id: int,
        keep: int,
        on_written: Callable[[int], int | None],
        save: Callable[[S], object],
        version_of: Callable[[S], int],
        steps: Callable[[], list[int]],
        file_of: Callable[[int], Path],
        what: str = "checkpoint",
    ) -> None:
        """``on_written(step)`` reports a durable file and returns the newest committed step, if known."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.shard_id = shard_id
        self.keep = keep
        self._on_written = on_written
        self._save = save
        self._version_of = version_of
        self._steps = steps
        self._file_of = file_of
        self._what = what
        self._queue: queue.Queue[S | None] = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._commits: list[int] = []  # the committed steps the coordinator told us of, ascending
        self._newest_taken = -1  # the newest step the writer thread took off the queue (written or failed)
        self.records: list[WriteRecord] = []
        self.error: BaseException | None = None  # the last write's failure, cleared by a success
        self._drop_temp_files()
        name = what.replace(" ", "-")
        self._thread = threading.Thread(target=self._run, name=f"{name}-{shard_id}", daemon=True)
        self._thread.start()

    def _drop_temp_files(self) -> None:
        """A process killed mid-write leaves its temp file (``atomic_write``), as large as a snapshot: nothing else
        removes it, and every such kill would add one."""
        folder = self._file_of(0).parent
        if not folder.is_dir():
            return
        for temp in folder.glob(".*.tmp"):
            try:
                temp.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("shard %d: cannot remove %s left by an interrupted write: %s", self.shard_id, temp, exc)

    def submit_snapshot(self, snapshot: S) -> None:
        """Hand a snapshot over; waits while the previous one is still queued (backpressure).

        A failed write never fails training: it is logged (and kept in ``error``) and that step
        is simply never committed, so the job keeps its last committed checkpoint.
        """
        while not self._closed.is_set():
            try:
                self._queue.put(snapshot, timeout=1.0)
                return
            except queue.Full:
                continue
        log.warning(
            "shard %d: writer closed; %s of step %d not written", self.shard_id, self._what, self._version_of(snapshot)
        )

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the queued writes (a clean stop keeps its last checkpoint), then stop."""
        self._closed.set()
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.error("shard %d: %s writer still busy after %.0fs; leaving it", self.shard_id, self._what, timeout_s)
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            version = self._version_of(snapshot)
            if not self._in_order(version):
                continue
            started = time.perf_counter()
            try:
                self._save(snapshot)
            except BaseException as exc:  # noqa: BLE001 - logged; that step is never committed
                log.exception("shard %d: writing %s of step %d failed", self.shard_id, self._what, version)
                self.error = exc
                continue
            self.error = None
            write_s = time.perf_counter() - started
            self.records.append(WriteRecord(version, write_s))
            log.info("shard %d: %s of step %d written in %.3fs", self.shard_id, self._what, version, write_s)
            try:
                committed = self._on_written(version)
                if committed is not None and committed >= 0 and committed not in self._commits:
                    self._commits = sorted([*self._commits, committed])[-self.keep :]
            except Exception as exc:  # noqa: BLE001 - the coordinator may be restarting; a later step commits
                log.warning("shard %d: could not confirm %s %d: %s", self.shard_id, self._what, version, exc)
            try:  # the thread must outlive a failed prune: training waits on its queue
                self._prune(version)
            except Exception as exc:  # noqa: BLE001 - logged; the next write prunes again
                log.warning("shard %d: could not prune old %s files: %s", self.shard_id, self._what, exc)

    def _in_order(self, version: int) -> bool:
        """Whether ``version`` is newer than every step taken before (the writer thread only); logs a drop.

        An older one arriving late would be written after the newer one: its confirmation would go backwards
        and its prune (files past the step written are a discarded run's) would delete the newer, confirmed
        file. The same step twice would be written and confirmed twice."""
        if version > self._newest_taken:
            self._newest_taken = version
            return True
        log.warning(
            "shard %d: %s of step %d dropped: step %d was handed over before it",
            self.shard_id,
            self._what,
            version,
            self._newest_taken,
        )
        return False

    def _prune(self, written: int) -> None:
        """Drop files past ``written`` (a discarded run's) and those older than the ``keep`` newest committed steps
        this shard knows of (none while it knows fewer): the last ``keep`` committed checkpoints stay on disk."""
        steps = self._steps()
        stale = [s for s in steps if s > written]
        if len(self._commits) == self.keep:
            stale += [s for s in steps if s < self._commits[0]]
        for step in stale:
            self._file_of(step).unlink(missing_ok=True)


class CheckpointWriter(SnapshotWriter[ShardState]):
    """The dense range's snapshots: ``shard-<id>/step-<t>.pt`` files."""

    def __init__(self, directory: Path, shard_id: int, keep: int, on_written: Callable[[int], int | None]) -> None:
        self.directory = directory
        super().__init__(
            shard_id,
            keep,
            on_written,
            save=lambda state: save_state(directory, state),
            version_of=lambda state: state.version,
            steps=lambda: written_steps(directory, shard_id),
            file_of=lambda step: shard_file(directory, shard_id, step),
        )

    def submit(self, state: ShardState) -> None:
        self.submit_snapshot(state)
