"""Committed checkpoints: the coordinator's manifest over the shards' checkpoint files.

Each PS shard writes its own file for step ``t`` on its own host and confirms it. Only when
every shard has confirmed ``t`` does the coordinator write ``manifest-<t>.json`` (atomically):
that file *is* the commit. A checkpoint without a manifest is ignored, so a shard killed
mid-write, or a coordinator killed before committing, leaves the previous committed checkpoint
as the resume point. The last ``keep`` manifests are kept.

A manifest names the job file it belongs to (``job_hash``); resuming a different job file
from it is refused, never silently mixed. It also records what a resume needs beyond the step
(``resume_state``, set by the Job): the workers training step ``t`` (``cluster.min_workers`` may have
dropped some) and, once a slot's data was adopted or released, the data-shard tracker's state at ``t``;
a step whose state cannot be told any more is not committed (a later one is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from pstrain.coordinator.buffer_store import BufferStore, prune_buffers
from pstrain.runtime.atomic_io import atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MANIFEST = re.compile(r"^manifest-(\d+)\.json$")


class CheckpointMismatch(ValueError):
    """The checkpoint directory holds checkpoints of a different job file or cluster shape."""


class ManifestDamaged(ValueError):
    """A manifest file that cannot be read back (truncated or edited by hand)."""


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: the step every shard has durably written, and what it belongs to."""

    step: int
    job_hash: str
    ps_shards: int
    total_params: int
    workers: int
    per_worker_batch: int
    committed_unix_s: float
    format: int = FORMAT_VERSION
    worker_ids: list[int] | None = None  # the workers of step ``step``; None: every slot (an older manifest)
    tracker: dict[str, Any] | None = None  # DataShardTracker.state_at(step); None: positioned from the step alone
    settings: dict[str, Any] | None = None  # resolved_settings of the job file; None: an older manifest
    worker_device_bytes: int = 0  # the probe's S2.2 estimate per worker when it committed; 0: none (or older)
    worker_host_bytes: int = 0


# Sections that say how a job is run, kept and watched, not what it trains: a resume may change them.
_NOT_HASHED = ("security", "eval", "checkpoint", "fault")
# Single settings of the same kind: ``job.steps`` may grow (train longer); ``data.prefetch`` moves only when a
# batch is read (a user who turns it off for a dataset that is not thread-safe keeps the checkpoints).
_NOT_HASHED_KEYS = ("job.steps", "data.prefetch")


def _without_unhashed_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (nested dicts) without the ``_NOT_HASHED_KEYS``."""
    trimmed = dict(config)
    for key in _NOT_HASHED_KEYS:
        section, name = key.split(".")
        if isinstance(trimmed.get(section), dict):
            trimmed[section] = {k: v for k, v in trimmed[section].items() if k != name}
    return trimmed


def _is_section(value: Any) -> bool:
    return is_dataclass(value) and not isinstance(value, type)


def _tables(value: Any) -> bool:
    """A dict of sections (``embeddings``: table name -> its settings)."""
    return isinstance(value, dict) and bool(value) and all(_is_section(v) for v in value.values())


def explicit_settings(config: Any) -> dict[str, Any]:
    """The settings of a parsed job file that differ from their defaults, as nested dicts.

    Hashing these rather than the whole normalized config keeps a checkpoint directory valid across
    a pstrain upgrade that adds a key: a new key's default keeps the old behaviour, so it changes
    nothing a job trains and must not change the job's identity either.
    """
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        if _is_section(value):
            nested = explicit_settings(value)
            if nested:
                out[f.name] = nested
        elif _tables(value):
            out[f.name] = {name: explicit_settings(table) for name, table in value.items()}
        elif value != default:
            out[f.name] = value
    return out


def resolved_settings(config: Any) -> dict[str, Any]:
    """Every setting a job trains with, defaults resolved, flat (``optimizer.lr``) and as JSON values.

    A manifest records them, so a resume under a pstrain whose default for a setting changed is refused
    with the setting named, though the job file (and its hash) are the same.
    """
    out: dict[str, Any] = {}

    def walk(section: Any, prefix: str) -> None:
        for f in fields(section):
            value, key = getattr(section, f.name), prefix + f.name
            if _is_section(value):
                walk(value, f"{key}.")
            elif _tables(value):
                for name, table in value.items():
                    walk(table, f"{key}.{name}.")
            elif key.split(".")[0] not in _NOT_HASHED and key not in _NOT_HASHED_KEYS:
                out[key] = json.loads(json.dumps(value, default=str))

    walk(config, "")
    return out


def job_hash(config: dict[str, Any]) -> str:
    """A stable digest of a job file's settings (``explicit_settings``), without what a resume may change.

    ``job.steps`` may grow (train longer); ``data.prefetch``, security, eval, checkpointing and fault handling
    do not change what is trained.
    """
    trimmed = _without_unhashed_keys({k: v for k, v in config.items() if k not in _NOT_HASHED})
    trimmed = {k: v for k, v in trimmed.items() if v != {}}
    canonical = json.dumps(trimmed, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def legacy_job_hash(config: Any) -> str:
    """The digest manifests written before ``explicit_settings`` carry: the whole normalized config without
    ``security``, ``eval`` and ``job.steps``. Accepted on resume, so their directories stay usable."""
    trimmed = _without_unhashed_keys({k: v for k, v in asdict(config).items() if k not in ("security", "eval")})
    canonical = json.dumps(trimmed, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobIdentity:
    """What a checkpoint directory must belong to for a job to resume from it (``check``)."""

    digest: str  # job_hash(explicit_settings(cfg)): what new manifests carry
    settings: dict[str, Any] = field(default_factory=dict)  # resolved_settings(cfg)
    legacy_digest: str = ""  # legacy_job_hash(cfg)

    @classmethod
    def of(cls, config: Any) -> JobIdentity:
        return cls(job_hash(explicit_settings(config)), resolved_settings(config), legacy_job_hash(config))

    def check(self, manifest: Manifest, directory: Path) -> None:
        """Raise ``CheckpointMismatch`` unless ``manifest`` is of this job file, naming the settings that differ."""
        recorded = manifest.settings or {}
        differ = [k for k, v in self.settings.items() if k in recorded and recorded[k] != v]
        if manifest.job_hash in (self.digest, self.legacy_digest) and not differ:
            return
        named = "; ".join(f"{k}: {recorded[k]!r} there, {self.settings[k]!r} now" for k in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        why = f"settings differ: {named}{more}" if differ else f"hash {manifest.job_hash}, this one {self.digest}"
        raise CheckpointMismatch(
            f"{directory} holds checkpoints of another job file ({why}); use another output directory, or --fresh "
            f"to discard them"
        )


def manifest_path(directory: Path, step: int) -> Path:
    return directory / f"manifest-{step:09d}.json"


def committed_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _MANIFEST.match(p.name)))


def read_manifest(directory: Path, step: int) -> Manifest:
    """Raises ``ManifestDamaged`` for a manifest that is not one (truncated, edited, of an unknown layout)."""
    path = manifest_path(directory, step)
    try:
        data = json.loads(path.read_bytes())
        known = {f.name for f in fields(Manifest)}
        newer = sorted(set(data) - known) if isinstance(data, dict) else []
        if newer:  # written by a newer pstrain: what this one knows of it still holds
            log.warning("%s has fields this version does not know (%s); they are ignored", path, ", ".join(newer))
            data = {k: v for k, v in data.items() if k in known}
        return Manifest(**data)
    except (ValueError, TypeError) as exc:  # JSONDecodeError, not UTF-8, not an object, missing keys
        raise ManifestDamaged(f"{path} is not a readable manifest: {exc}") from exc


def _newest_readable(directory: Path, steps: list[int]) -> Manifest | None:
    """The newest of ``steps`` whose manifest reads; a damaged one is logged and set aside (``.damaged``), so
    the job resumes from the previous committed checkpoint and no ledger or prune counts it as committed."""
    for step in reversed(steps):
        try:
            return read_manifest(directory, step)
        except ManifestDamaged as exc:
            aside = manifest_path(directory, step).with_name(f"{manifest_path(directory, step).name}.damaged")
            manifest_path(directory, step).replace(aside)
            log.error("%s; moved to %s, falling back to the previous committed checkpoint", exc, aside.name)
    return None


def newest_manifest(directory: Path, identity: JobIdentity) -> Manifest | None:
    """The newest readable committed checkpoint of this job file, None if there is none.

    Raises ``CheckpointMismatch`` when the newest one belongs to another job file.
    """
    manifest = _newest_readable(directory, committed_steps(directory))
    if manifest is not None:
        identity.check(manifest, directory)
    return manifest


class CheckpointLedger:
    """Collects the shards' confirmations and commits a step once all have confirmed it."""

    def __init__(self, directory: Path, template: Manifest, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be at least 1, got {keep}")
        self.directory = directory
        self._template = template
        self._keep = keep
        self._confirmed: dict[int, set[int]] = {}  # step -> shards that wrote it
        self.buffers: BufferStore | None = None  # issue 11: the workers' buffers, set by the Job; they gate commits
        self.resume_state: Callable[[int], dict[str, Any] | None] | None = None  # set by the Job: worker_ids, tracker
        self._lock = threading.Lock()
        steps = committed_steps(directory)
        self.last_committed = steps[-1] if steps else -1

    def estimate(self, worker_device_bytes: int, worker_host_bytes: int) -> None:
        """The probe's memory estimate per worker: manifests carry it, so a job resumed from one (which runs no
        probe) still reports it and serves it to a replacement worker."""
        with self._lock:
            self._template = replace(
                self._template, worker_device_bytes=worker_device_bytes, worker_host_bytes=worker_host_bytes
            )

    def rebatch(self, per_worker_batch: int) -> None:
        """The probe re-planned the job at another batch before it started: manifests record that one, so a resume
        trains (and positions its data) at the batch the probe found to fit, not at the one planned first."""
        with self._lock:
            self._template = replace(self._template, per_worker_batch=per_worker_batch)

    def confirm(self, shard_id: int, step: int) -> None:
        """Record that ``shard_id`` has durably written ``step``."""
        if not 0 <= shard_id < self._template.ps_shards:
            raise ValueError(f"shard id {shard_id} out of range 0..{self._template.ps_shards - 1}")
        with self._lock:
            if step > self.last_committed:  # else a repeated confirmation after a restart
                self._confirmed.setdefault(step, set()).add(shard_id)

    def commit(self, completed_steps: int) -> Manifest | None:
        """Commit the newest step every shard has written and the job has recorded; None if none is new.

        With a model that has buffers (``buffers``), a step also needs every worker slot's buffers of
        it; they are written (``buffers-<t>.pt``) before the manifest, so a manifest always has them.

        ``completed_steps`` is how many steps the coordinator has recorded: a checkpoint of step
        ``t`` is only committed once steps ``0..t-1`` are in metrics.jsonl, so a resume never
        leaves a gap there (a shard can finish step ``t``'s update before the workers report it).
        """
        with self._lock:
            ready = [
                step
                for step, shards in self._confirmed.items()
                if len(shards) == self._template.ps_shards
                and step <= completed_steps
                and (self.buffers is None or self.buffers.complete(step))
            ]
            extra: dict[str, Any] | None = None
            for step in sorted(ready, reverse=True):
                extra = self.resume_state(step) if self.resume_state is not None else {}
                if extra is not None:
                    break
            if extra is None:
                return None
            manifest = Manifest(**{**asdict(self._template), **extra, "step": step, "committed_unix_s": time.time()})
            if self.buffers is not None:
                self.buffers.write(self.directory, step)
            atomic_write(
                manifest_path(self.directory, step),
                lambda fh: fh.write(json.dumps(asdict(manifest), indent=1).encode()),
            )
            self.last_committed = step
            for older in [s for s in self._confirmed if s <= step]:
                del self._confirmed[older]
            for old in committed_steps(self.directory)[: -self._keep]:
                manifest_path(self.directory, old).unlink(missing_ok=True)
            prune_buffers(self.directory, committed_steps(self.directory))
            log.info("checkpoint of step %d committed (%d shards)", step, self._template.ps_shards)
            return manifest


def discard(directory: Path) -> None:
    """Forget every committed checkpoint here (``--fresh``, or a finished run trained anew).

    Only the manifests (and the workers' buffers files beside them) go: without them no shard file
    is ever used, and each shard prunes the files of a discarded run the first time it writes its own.
    """
    for step in committed_steps(directory):
        manifest_path(directory, step).unlink(missing_ok=True)
    prune_buffers(directory, [])


def resume_point(
    directory: Path, identity: JobIdentity, steps: int, fresh: bool, export: Path | None = None
) -> Manifest | None:
    """The checkpoint to resume from: the newest committed one of this job file before ``steps``.

    ``fresh`` discards what is there. A run that reached ``steps`` and wrote its model
    (``export`` newer than its final manifest) is finished: its checkpoints are discarded and the
    job trains anew. One that reached ``steps`` but died before its model was written resumes
    from its newest earlier checkpoint, so only the tail is trained again.
    """
    if fresh:
        discard(directory)
        return None
    manifest = newest_manifest(directory, identity)
    if manifest is None or manifest.step < steps:
        return manifest
    final = manifest_path(directory, manifest.step)
    if export is not None and export.exists() and export.stat().st_mtime_ns >= final.stat().st_mtime_ns:
        log.info("the checkpoints in %s are of a finished run (step %d); training anew", directory, manifest.step)
        discard(directory)
        return None
    earlier = [s for s in committed_steps(directory) if s < steps]
    resume = _newest_readable(directory, earlier)
    if resume is None:
        discard(directory)
        return None
    log.info("the run reached step %d but its model was not written; resuming from step %d", manifest.step, resume.step)
    # The later manifests go: the ledger would count them as committed (so this run would commit nothing), and the
    # shards, told of them, would delete the files of the steps this run writes and resumes from.
    for later in [s for s in committed_steps(directory) if s > resume.step]:
        manifest_path(directory, later).unlink(missing_ok=True)
    prune_buffers(directory, committed_steps(directory))
    return resume
