"""The export: once the last step is recorded, write the trained model to ``model.pt``.

The parameters come from the PS shards (``pull`` reads every shard at the final version); the
buffers (BatchNorm statistics and the like live on the workers, not the PS) come from worker 0's
upload. A model with buffers waits for that upload up to ``buffers_wait_s``, then exports with
the buffers it has (the initial ones). Any failure is raised to the ``Job``, which fails the job.
Worker 0's buffers are its own to the end, through every resume: a resumed or replacement worker
loads its slot's buffers of the checkpoint it resumes from first (issue 11, ``buffer_store.py``).

Locking: the export shares the ``Job``'s condition; ``run`` blocks (waits for the buffers, then
pulls over the network) and never holds the condition while it pulls or writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pstrain.coordinator.errors import InvalidRequest
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.table_export import PullTables, table_entries
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.sparse_rows import TableSpec

log = logging.getLogger(__name__)

PullFinal = Callable[[list[str], int], torch.Tensor]
"""Pull the final parameters: (PS addresses in shard order, version) -> flat vector."""


class ModelExport:
    def __init__(
        self,
        model: ModelState,
        out_dir: Path | None,
        pull: PullFinal,
        buffers_wait_s: float,
        cond: threading.Condition,
    ) -> None:
        self.model = model
        self.out_dir = out_dir
        self._pull = pull
        self._buffers_wait_s = buffers_wait_s
        self._cond = cond
        self._buffers: dict[str, torch.Tensor] | None = None
        self.pull_tables: PullTables | None = None  # issue 9: set when the job has sparse tables (table_export.py)
        self.table_specs: list[TableSpec] = []

    def upload_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Keep the workers' final buffers for the export; each must match the model's by name, dtype and shape."""
        own = dict(self.model.model.named_buffers())
        for name, value in buffers.items():
            if name not in own:
                raise InvalidRequest(f"the model has no buffer {name!r}")
            if own[name].shape != value.shape or own[name].dtype != value.dtype:
                raise InvalidRequest(
                    f"buffer {name!r} is {value.dtype} {tuple(value.shape)}, the model's is "
                    f"{own[name].dtype} {tuple(own[name].shape)}"
                )
        with self._cond:
            self._buffers = buffers
            self._cond.notify_all()

    def run(self, addresses: list[str], version: int) -> None:
        """Pull the parameters at ``version`` and write model.pt (when there is an out dir); raises on failure."""
        with self._cond:
            if any(True for _ in self.model.model.buffers()):
                deadline = time.monotonic() + self._buffers_wait_s  # a real wait, not the injected clock
                while self._buffers is None and (remaining := deadline - time.monotonic()) > 0:
                    self._cond.wait(min(remaining, 1.0))
                if self._buffers is None:
                    log.warning("no buffers uploaded within %.0fs: exporting the initial ones", self._buffers_wait_s)
            buffers = self._buffers or {}
        flat = self._pull(addresses, version)
        tables = self.pull_tables(addresses, version) if self.pull_tables is not None else None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            drop_partial_exports(self.out_dir)
            if tables is None:
                self.model.save(self.out_dir / "model.pt", flat, buffers)
            else:  # issue 9: the sparse tables join the dense state (or go to out_dir/tables past a size)
                state = self.model.state_dict(flat, buffers)
                state.update(table_entries(self.model.model, self.table_specs, tables, self.out_dir))
                atomic_write(self.out_dir / "model.pt", lambda fh: torch.save(state, fh))


def drop_partial_exports(out_dir: Path) -> None:
    """Remove what an export killed mid-write left: ``atomic_write``'s temp files of model.pt and the tables.

    The rename keeps model.pt whole, but each killed export (a coordinator stopped, OOM-killed, restarted into
    the export again) leaves its temp file behind, as large as the model, and nothing else ever removes it.
    Only this coordinator writes them: it holds ``--out`` (``runtime.dir_lock``) for its life."""
    for directory, pattern in ((out_dir, ".model.pt.*.tmp"), (out_dir / "tables", ".*.pt.*.tmp")):
        if directory.is_dir():
            for leftover in directory.glob(pattern):
                leftover.unlink(missing_ok=True)
                log.warning("removed %s, left by an export that was killed while writing it", leftover)
