"""The workers' model buffers at checkpoint steps (issue 11): BatchNorm running statistics and the like.

Buffers are not parameters: the PS never sees them, each device replica of each worker updates its
own in forward, and so a checkpoint of the parameters alone does not resume a model with buffers
where it was. At every checkpoint step ``t`` (``checkpoint.every_steps`` and the last step) each
worker uploads the buffers of all its replicas as they are after the update to version ``t``
(``worker/slot_buffers.py``); the coordinator commits checkpoint ``t`` only once every shard has
confirmed it **and** every worker slot's buffers of ``t`` are here (``CheckpointLedger.commit``),
and writes them to ``buffers-<t>.pt`` beside the manifest, before it (the manifest is the commit).
A resumed slot (rollback, restart, ``pstrain local``) fetches its slot's buffers of the resume step
back before it trains; a replacement worker (S2.5) gets its slot's newest buffers at or before the
step it redoes, exact only when that is the checkpoint step they are of.

Names on the wire and on disk are ``"<replica>/<buffer name>"``; every upload is checked against
the model's buffers (name, dtype, shape) times the job's devices per worker before it is kept.
A model without buffers keeps nothing and gates no commit.

Memory: per slot, the buffers of the newest committed step (for replacements) and of the steps
uploaded since (awaiting their commit); older ones are dropped at each commit.

Disk, before the commit: each upload is also written atomically to ``buffers-<t>-w<slot>.part``
(``spool``) before it is acknowledged, because a worker uploads once. A coordinator restarted from
its journal (the coordinator alone, not a rollback) takes back the parts newer than the last commit,
so checkpoint ``t`` still commits once the shards confirm it; without them it never would, and at the
last step the job would wait for a final manifest until its timeout. Parts at or below a committed
step are pruned with the commit; a job that starts anew (a resume, a rollback, ``--fresh``) drops them
all: its workers upload again.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pstrain.coordinator.errors import ConfigError, InvalidRequest
from pstrain.coordinator.journal import JournalUnusable
from pstrain.protos.codec import wire_dtype
from pstrain.runtime.atomic_io import atomic_write

log = logging.getLogger(__name__)

_FILE = re.compile(r"^buffers-(\d+)\.pt$")
_PART = re.compile(r"^buffers-(\d+)-w(\d+)\.part$")
FORMAT_VERSION = 1


def buffers_path(directory: Path, step: int) -> Path:
    return directory / f"buffers-{step:09d}.pt"


def part_path(directory: Path, step: int, worker_id: int) -> Path:
    return directory / f"buffers-{step:09d}-w{worker_id}.part"


def part_files(directory: Path) -> list[tuple[int, int]]:
    """(step, slot) of every upload kept on disk awaiting its commit, in order."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), int(m.group(2))) for p in directory.iterdir() if (m := _PART.match(p.name)))


def buffer_files(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _FILE.match(p.name)))


def check_names(what: str, got: Iterable[str], expected: Iterable[str]) -> None:
    """``InvalidRequest`` naming the missing and the unknown buffers unless ``got`` names exactly ``expected``.

    An upload is all of the model's buffers or nothing: a partial one kept would stand for the whole
    (model.pt would mix trained statistics with initial ones; a later upload would drop the rest), so the
    refusal names what to add or drop, and nothing is kept."""
    missing, unknown = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if not missing and not unknown:
        return
    problems = [f"{label} {_listed(names)}" for label, names in (("missing", missing), ("unknown", unknown)) if names]
    raise InvalidRequest(
        f"{what} are incomplete or name buffers the model does not have ({'; '.join(problems)}): upload every "
        "buffer of the model (named_buffers()) under its own name, and no other, in one call; nothing was kept"
    )


def _listed(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def slot_names(model: torch.nn.Module, replicas: int) -> dict[str, torch.Tensor]:
    """The model's buffers under their slot names, one copy per replica (shape and dtype only matter)."""
    own = dict(model.named_buffers())
    return {f"{r}/{name}": b for r in range(replicas) for name, b in own.items()}


SlotBuffers = dict[str, torch.Tensor]


class BufferStore:
    """Every worker slot's buffers by checkpoint step; thread-safe (a leaf lock)."""

    def __init__(
        self,
        model: torch.nn.Module,
        workers: int,
        replicas: int,
        slots_at: Callable[[int], Iterable[int]] | None = None,
    ) -> None:
        self.workers = workers
        self.slots_at = slots_at  # the slots whose buffers checkpoint ``t`` needs; default: all (cluster.min_workers)
        self._model = {n: (b.dtype, tuple(b.shape)) for n, b in slot_names(model, replicas).items()}
        self._held: dict[int, dict[int, SlotBuffers]] = {}  # step -> slot -> buffers
        self._spool: Path | None = None  # where each upload is kept until its commit (``spool``)
        self._lock = threading.Lock()

    @property
    def needed(self) -> bool:
        """Whether the model has buffers at all: without them nothing is uploaded and no commit waits."""
        return bool(self._model)

    def expected(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Name -> (wire dtype, shape): what an upload may announce (``checked_tensor_stream``)."""
        return {name: (wire_dtype(dtype), shape) for name, (dtype, shape) in self._model.items()}

    def spool(self, directory: Path, recovered_from: int | None) -> None:
        """Keep every upload from now on in ``directory`` too, until its commit (see the module docstring).

        ``recovered_from``: the last committed step of a job taken back from its journal; its parts of later
        steps are taken back (``JournalUnusable`` if one cannot be: the job rolls back), the others pruned.
        None: a job that starts anew, whose workers upload again.
        """
        if not self.needed:
            return
        drop_partial_writes(directory)
        for step, worker_id in part_files(directory):
            path = part_path(directory, step, worker_id)
            if recovered_from is None or step <= recovered_from or not 0 <= worker_id < self.workers:
                path.unlink(missing_ok=True)
                continue
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
                if payload.get("step") != step or payload.get("worker") != worker_id:
                    raise InvalidRequest(f"{path} holds the buffers of another step or slot")
                self._check(worker_id, step, dict(payload["buffers"]))
            except Exception as exc:  # noqa: BLE001 - any unreadable part: the journal's job cannot be taken back
                raise JournalUnusable(f"the uploaded buffers in {path} cannot be taken back: {exc}") from exc
            self._keep(worker_id, step, dict(payload["buffers"]))
            log.info("took back slot %d's buffers of step %d, uploaded before the restart", worker_id, step)
        self._spool = directory

    def put(self, worker_id: int, step: int, buffers: SlotBuffers) -> None:
        """Keep slot ``worker_id``'s uploaded buffers of ``step`` (on disk too, once ``spool``-ed): every buffer
        of every replica, as the model's."""
        self._check(worker_id, step, buffers)
        if self._spool is not None:
            payload = {"format": FORMAT_VERSION, "step": step, "worker": worker_id, "buffers": buffers}
            atomic_write(part_path(self._spool, step, worker_id), lambda fh: torch.save(payload, fh))
        self._keep(worker_id, step, buffers)

    def _check(self, worker_id: int, step: int, buffers: SlotBuffers) -> None:
        if not 0 <= worker_id < self.workers:
            raise InvalidRequest(f"worker slot {worker_id} out of range 0..{self.workers - 1}")
        check_names(f"the buffers of slot {worker_id} at step {step}", buffers, self._model)
        for name, value in buffers.items():
            dtype, shape = self._model[name]
            if value.dtype != dtype or tuple(value.shape) != shape:
                raise InvalidRequest(f"buffer {name!r} is {value.dtype} {tuple(value.shape)}, not {dtype} {shape}")

    def _keep(self, worker_id: int, step: int, buffers: SlotBuffers) -> None:
        with self._lock:
            self._held.setdefault(step, {})[worker_id] = buffers

    def complete(self, step: int) -> bool:
        """Whether every slot's buffers of ``step`` are here (always, for a model without buffers)."""
        if not self.needed:
            return True
        wanted = set(self.slots_at(step)) if self.slots_at is not None else set(range(self.workers))
        with self._lock:
            return wanted <= set(self._held.get(step, {}))

    def newest(self, worker_id: int, step: int) -> tuple[int, SlotBuffers] | None:
        """Slot ``worker_id``'s newest buffers at or before ``step``, and the step they are of."""
        with self._lock:
            steps = [s for s, slots in self._held.items() if s <= step and worker_id in slots]
            if not steps:
                return None
            return max(steps), self._held[max(steps)][worker_id]

    def write(self, directory: Path, step: int) -> None:
        """Write every slot's buffers of ``step`` atomically, then forget the steps before it.

        Called by the commit before it writes the manifest: a manifest always has its buffers file.
        """
        if not self.needed:
            return
        with self._lock:
            slots = dict(self._held[step])
            for older in [s for s in self._held if s < step]:
                del self._held[older]
        payload = {"format": FORMAT_VERSION, "step": step, "slots": slots}
        atomic_write(buffers_path(directory, step), lambda fh: torch.save(payload, fh))

    def load(self, directory: Path, step: int) -> bool:
        """Take the committed buffers of ``step`` back (a resumed job); False (logged) when there are none."""
        if not self.needed or step <= 0:
            return False
        path = buffers_path(directory, step)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            log.warning("checkpoint %d has no buffers file (%s): the workers keep their initial buffers", step, path)
            return False
        except Exception as exc:  # noqa: BLE001 - truncated, not a torch file, unpicklable: a damaged checkpoint
            raise _damaged(path, step, f"it cannot be read ({exc})") from exc
        try:
            slots = {int(w): dict(b) for w, b in payload["slots"].items()}
            if payload.get("step") != step or not set(slots) <= set(range(self.workers)):
                raise InvalidRequest(f"it holds the buffers of step {payload.get('step')} or of another cluster shape")
            for worker_id, buffers in slots.items():  # all checked before any is kept: a refused file changes nothing
                self._check(worker_id, step, buffers)
        except (InvalidRequest, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _damaged(path, step, f"it does not fit this job's model: {exc}") from exc
        for worker_id, buffers in slots.items():
            self._keep(worker_id, step, buffers)
        log.info("loaded the workers' buffers of checkpoint %d", step)
        return True


def _damaged(path: Path, step: int, why: str) -> ConfigError:
    """The error for a committed checkpoint whose buffers file is unusable.

    A ``ConfigError`` (the coordinator exits 2 with one line, and is not restarted into the same crash) that
    says what to do: the resume point is chosen already, and resuming without the buffers would silently
    give the model its initial BatchNorm statistics back."""
    manifest = path.with_name(f"manifest-{step:09d}.json")  # checkpoints.manifest_path, which imports this module
    return ConfigError(
        f"checkpoint.dir: the buffers of checkpoint {step} in {path} are damaged: {why}; restore the file, move "
        f"{manifest.name} aside to resume from the previous checkpoint, or start anew with --fresh"
    )


def drop_partial_writes(directory: Path) -> None:
    """Remove the temp files of buffers files and uploads whose writer was killed (``atomic_write`` renames a
    whole file into place, but a SIGKILL leaves its temp file behind, as large as every slot's buffers, and
    nothing else removes it). Called as a coordinator starts, holding ``checkpoint.dir`` (``runtime.dir_lock``)."""
    if not directory.is_dir():
        return
    for leftover in directory.glob(".buffers-*.tmp"):
        leftover.unlink(missing_ok=True)
        log.warning("removed %s, left by a coordinator killed while writing it", leftover)


def prune_buffers(directory: Path, keep_steps: list[int]) -> None:
    """Drop the buffers files of every step but ``keep_steps`` (the committed checkpoints kept), and the
    uploads kept on disk at or below the newest of them (all of them when none is kept).

    Called after the manifest is written: a crash before it leaves the parts, so the commit can be redone.
    """
    for step in buffer_files(directory):
        if step not in keep_steps:
            buffers_path(directory, step).unlink(missing_ok=True)
    newest = max(keep_steps, default=None)
    for step, worker_id in part_files(directory):
        if newest is None or step <= newest:
            part_path(directory, step, worker_id).unlink(missing_ok=True)
