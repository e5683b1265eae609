"""The sparse tables' part of a PS shard's checkpoints, and the shard's sparse part built from the job (issue 9).

A checkpoint of step ``t`` of a job with tables is, per PS shard, two files: the dense range
(``shard-<k>/step-<t>.pt``, ``ps_server/checkpoint.py``) and the rows this shard holds with their
per-row optimizer state (``sparse-<k>/step-<t>.pt``). Both are taken the same way: a copy under
the lock when version ``t`` completes (for the tables a memcpy of the held rows in slot order),
written behind by a background thread with ``atomic_write`` (temp file, fsync, rename), so a
kill mid-write leaves the previous file whole.

One confirmation covers both (``CheckpointJoin``): the shard reports ``CheckpointWritten(t)``
to the coordinator only once its dense *and* its sparse file of ``t`` are durable, whichever
finished last. The dense and sparse versions of a step complete at different moments (the
worker pushes the dense buckets during backward and its rows after), so neither file can
stand for the other; with the join the coordinator never commits a ``t`` whose sparse file is
missing. Pruning follows the committed step the coordinator answers with, as for the dense
files: files past the one just written (a discarded run's) go, and below the committed step
all but the ``keep - 1`` newest, so the last ``keep`` committed checkpoints stay whole.
Only rows a shard holds (touched rows) are written, never the whole table.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.checkpoint import CheckpointError, SnapshotWriter
from pstrain.ps_server.errors import InvalidArgument
from pstrain.ps_server.sparse_table import SparseCheckpoints, SparseShard, TableState
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.sparse_rows import RowError, TableSpec, decode_block

log = logging.getLogger(__name__)

_FILE = re.compile(r"^step-(\d+)\.pt$")

Confirm = Callable[[int], "int | None"]
"""Report a durable file of step t; returns the newest committed step, if known."""


def sparse_file(directory: Path, shard_id: int, step: int) -> Path:
    return directory / f"sparse-{shard_id}" / f"step-{step:09d}.pt"


def sparse_steps(directory: Path, shard_id: int) -> list[int]:
    """Steps this shard has a complete sparse file for, oldest first (temp files are ignored)."""
    folder = directory / f"sparse-{shard_id}"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _FILE.match(p.name)))


def save_tables(
    directory: Path, shard_id: int, version: int, states: dict[str, TableState], keep: int | None = None
) -> Path:
    """Write one shard's tables at ``version`` atomically (ids ascending); with ``keep``, prune all but the
    ``keep + 1`` newest files (the writer prunes by the committed step instead)."""
    path = sparse_file(directory, shard_id, version)
    ordered = {name: s.sorted() for name, s in states.items()}
    payload = {
        "shard_id": shard_id,
        "version": version,
        "tables": {
            name: {"spec": s.spec.to_pb().SerializeToString(), "ids": s.ids, "rows": s.rows, "state": s.state}
            for name, s in ordered.items()
        },
    }
    atomic_write(path, lambda fh: torch.save(payload, fh))
    if keep is not None:
        steps = sparse_steps(directory, shard_id)
        for old in steps[: max(0, len(steps) - (keep + 1))]:
            sparse_file(directory, shard_id, old).unlink(missing_ok=True)
    return path


def load_tables(directory: Path, shard_id: int, version: int) -> dict[str, TableState]:
    path = sparse_file(directory, shard_id, version)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"sparse tables of shard {shard_id} at step {version}: no file {path}") from None
    except Exception as exc:  # noqa: BLE001 - unreadable, whatever the cause
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if payload.get("shard_id") != shard_id or payload.get("version") != version:
        raise CheckpointError(f"{path} holds shard {payload.get('shard_id')} at step {payload.get('version')}")
    states = {}
    for name, t in payload["tables"].items():
        spec = TableSpec.from_pb(pb.EmbeddingTableSpec.FromString(t["spec"]))
        states[name] = TableState(spec, t["ids"], t["rows"], t["state"])
    return states


class CheckpointJoin:
    """Confirms step t to the coordinator once every part of this shard (dense, sparse) has written t."""

    def __init__(self, parts: Iterable[str], confirm: Confirm) -> None:
        self._parts = frozenset(parts)
        self._confirm = confirm
        self._written: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self.committed: int | None = None  # the newest committed step any confirmation returned

    def part(self, name: str) -> Confirm:
        """The ``on_written`` callback of one part's writer."""
        if name not in self._parts:
            raise ValueError(f"unknown checkpoint part {name!r}")
        return lambda step: self.written(name, step)

    def written(self, part: str, step: int) -> int | None:
        """``part``'s file of ``step`` is durable; confirm ``step`` if it was the last part missing."""
        with self._lock:
            done = self._written.setdefault(step, set())
            done.add(part)
            if done != self._parts:
                return self.committed
            for old in [s for s in self._written if s <= step]:
                del self._written[old]
        committed = self._confirm(step)  # outside the lock: a gRPC call
        with self._lock:
            if committed is not None and (self.committed is None or committed > self.committed):
                self.committed = committed
            return self.committed


class SparseCheckpointWriter(SnapshotWriter[tuple[int, dict[str, TableState]]]):
    """The tables' snapshots, ``sparse-<shard>/step-<t>.pt``: written, confirmed and pruned exactly as
    ``ps_server.checkpoint.CheckpointWriter`` does the dense range (the same failure rules)."""

    def __init__(self, directory: Path, shard_id: int, keep: int, on_written: Confirm) -> None:
        self.directory = directory
        super().__init__(
            shard_id,
            keep,
            on_written,
            save=lambda snapshot: save_tables(directory, shard_id, *snapshot),
            version_of=lambda snapshot: snapshot[0],
            steps=lambda: sparse_steps(directory, shard_id),
            file_of=lambda step: sparse_file(directory, shard_id, step),
            what="sparse checkpoint",
        )

    def submit(self, version: int, states: dict[str, TableState]) -> None:
        self.submit_snapshot((version, states))


def sparse_shard_for(
    job: pb.JobSpec,
    shard_id: int,
    resume_step: int,
    on_written: Confirm | None = None,
    initial_rows: Callable[[], Iterable[pb.RowBlock]] | None = None,
) -> tuple[SparseShard, SparseCheckpointWriter | None]:
    """This PS shard's part of the job's tables (fresh, or restored from its file of ``resume_step``) and
    its checkpoint writer (when the job checkpoints and has tables; ``on_written`` confirms each file).

    A fresh shard takes the rows ``initial_rows()`` streams (``model.init_checkpoint``'s rows this shard
    owns, from the coordinator: ``Coordinator.FetchInitialRows``) as their initial values, block by block;
    rows it does not stream keep the seeded init.

    Raises ``CheckpointError`` when resuming finds no usable file, or its tables differ from the job's.
    """
    specs = [TableSpec.from_pb(t) for t in job.embeddings]
    directory = Path(job.checkpoint_dir) if job.checkpoint_dir else None
    writer = None
    policy = None
    if directory is not None and job.checkpoint_every_steps > 0 and specs and on_written is not None:
        writer = SparseCheckpointWriter(directory, shard_id, job.checkpoint_keep, on_written)
        policy = SparseCheckpoints(job.checkpoint_every_steps, job.steps, writer.submit)
    try:
        shard = _build(job, shard_id, resume_step, specs, directory, policy)
        if resume_step == 0 and specs and initial_rows is not None:
            load_initial_rows(shard, initial_rows())
        return shard, writer
    except BaseException:
        if writer is not None:
            writer.close()
        raise


def _build(
    job: pb.JobSpec,
    shard_id: int,
    resume_step: int,
    specs: list[TableSpec],
    directory: Path | None,
    policy: SparseCheckpoints | None,
) -> SparseShard:
    schedule = job.lr_schedule if job.HasField("lr_schedule") else None
    if resume_step > 0 and specs:
        if directory is None:
            raise CheckpointError("resuming a job with sparse tables needs its checkpoint directory")
        states = load_tables(directory, shard_id, resume_step)
        if sorted(states) != sorted(s.name for s in specs) or any(states[s.name].spec != s for s in specs):
            raise CheckpointError(
                f"the sparse tables in {sparse_file(directory, shard_id, resume_step)} differ from the job's"
            )
        return SparseShard.restore(
            shard_id, job.ps_shards, resume_step, states, job.workers, job.total_devices, schedule, policy
        )
    return SparseShard(shard_id, job.ps_shards, specs, job.workers, job.total_devices, 0, schedule, policy)


def load_initial_rows(shard: SparseShard, blocks: Iterable[pb.RowBlock]) -> int:
    """Set the initial value of the rows ``blocks`` carry (one block in memory at a time); the rows loaded.

    Raises ``CheckpointError`` for a block of an unknown table, of rows another shard owns, or of the wrong size.
    """
    loaded = 0
    for block in blocks:
        table = shard.tables.get(block.table)
        if table is None:
            raise CheckpointError(f"init_checkpoint rows for table {block.table!r}, which this job does not declare")
        try:
            ids, values, _ = decode_block(block, table.spec.dim)
            if values is None and ids.numel():
                raise RowError(f"table {block.table!r}: an init_checkpoint block carries no values")
            if ids.numel():
                assert values is not None
                table.load(ids, values)
        except (RowError, InvalidArgument) as exc:
            raise CheckpointError(f"shard {shard.shard_id}: init_checkpoint rows rejected: {exc}") from exc
        loaded += int(ids.numel())
    if loaded:
        log.info("shard %d: %d table rows from init_checkpoint", shard.shard_id, loaded)
    return loaded
