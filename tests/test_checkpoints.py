"""Shard checkpoint files and the coordinator's commit: atomic, ordered, pruned, never mixed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from dataclasses import field, fields, make_dataclass, replace
from pathlib import Path

import pytest
import torch

from pstrain.coordinator.checkpoints import (
    CheckpointLedger,
    CheckpointMismatch,
    JobIdentity,
    Manifest,
    committed_steps,
    explicit_settings,
    job_hash,
    legacy_job_hash,
    newest_manifest,
    read_manifest,
    resume_point,
)
from pstrain.coordinator.config import parse_config
from pstrain.ps_server.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    ShardState,
    load_state,
    save_state,
    shard_dir,
    shard_file,
    written_steps,
)
from pstrain.runtime.atomic_io import atomic_write
from tests.helpers import REPO_ROOT, wait_for
from tests.test_job import RAW


def state(step: int, shard_id: int = 0, numel: int = 10) -> ShardState:
    params = torch.arange(numel, dtype=torch.float32) + step
    return ShardState(shard_id, 0, numel, step, params, {"state": {0: {"momentum_buffer": params * 2}}, "x": 1})


def test_saved_state_loads_back_exactly(tmp_path):
    save_state(tmp_path, state(7))
    loaded = load_state(tmp_path, 0, 0, 10, 7)
    assert loaded.version == 7 and torch.equal(loaded.params, state(7).params)
    assert torch.equal(loaded.optimizer["state"][0]["momentum_buffer"], state(7).params * 2)


def test_load_refuses_another_shard_range_or_missing_step(tmp_path):
    save_state(tmp_path, state(3))
    with pytest.raises(CheckpointError, match="no checkpoint of step 4"):
        load_state(tmp_path, 0, 0, 10, 4)
    with pytest.raises(CheckpointError, match="shard or shard count changed|model or shard count changed"):
        load_state(tmp_path, 0, 0, 11, 3)
    (shard_file(tmp_path, 0, 5)).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_state(tmp_path, 0, 0, 10, 5)


def test_writer_writes_in_order_confirms_and_keeps_the_newest(tmp_path):
    confirmed: list[int] = []
    done = threading.Event()

    def on_written(step: int) -> int:
        confirmed.append(step)
        if step == 50:
            done.set()
        return step - 10  # the coordinator commits a step once a slower shard has written it too

    writer = CheckpointWriter(tmp_path, 0, keep=2, on_written=on_written)
    for step in range(10, 60, 10):
        writer.submit(state(step))
    assert done.wait(30)
    writer.close()
    assert confirmed == [10, 20, 30, 40, 50]
    assert written_steps(tmp_path, 0) == [30, 40, 50]  # committed 40 and the one before it, and 50 not yet
    assert [r.step for r in writer.records] == confirmed


def test_a_writer_that_hears_of_no_commit_deletes_nothing(tmp_path):
    done = threading.Event()
    writer = CheckpointWriter(tmp_path, 0, keep=1, on_written=lambda step: None if step < 30 else done.set())
    for step in (10, 20, 30):
        writer.submit(state(step))
    assert done.wait(30)
    writer.close()
    assert written_steps(tmp_path, 0) == [10, 20, 30]


def test_a_failed_write_never_fails_training_and_is_never_confirmed(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    confirmed: list[int] = []
    writer = CheckpointWriter(blocker, 0, keep=1, on_written=confirmed.append)
    writer.submit(state(1))
    wait_for(lambda: writer.error is not None, 30, "the write to fail")
    writer.submit(state(2))  # does not raise: the job keeps its last committed checkpoint
    writer.close()
    assert confirmed == [] and writer.records == []


def test_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL a process while it writes a large checkpoint: the old one loads, no partial file."""
    save_state(tmp_path, state(1, numel=10))
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from pstrain.ps_server.checkpoint import ShardState, save_state
        big = torch.ones(300_000_000 // 4)
        while True:
            save_state(Path({str(tmp_path)!r}), ShardState(0, 0, 10, 2, torch.zeros(10), {{"big": big}}))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO_ROOT)
    try:
        folder = shard_dir(tmp_path, 0)
        wait_for(lambda: any(p.name.endswith(".tmp") for p in folder.iterdir()), 120, "a checkpoint temp file")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps = written_steps(tmp_path, 0)
    assert 1 in steps
    assert torch.equal(load_state(tmp_path, 0, 0, 10, 1).params, state(1).params)
    for step in steps:  # whatever exists under its final name is whole
        load_state(tmp_path, 0, 0, 10, step)


def template(shards: int = 2, digest: str = "abc", settings: dict | None = None) -> Manifest:
    return Manifest(
        step=-1,
        job_hash=digest,
        ps_shards=shards,
        total_params=10,
        workers=2,
        per_worker_batch=8,
        committed_unix_s=0.0,
        settings=settings,
    )


def test_ledger_commits_only_when_every_shard_confirmed_and_the_step_is_recorded(tmp_path):
    ledger = CheckpointLedger(tmp_path, template(shards=3), keep=2)
    ledger.confirm(0, 5)
    ledger.confirm(2, 5)
    assert ledger.commit(completed_steps=9) is None and committed_steps(tmp_path) == []
    ledger.confirm(1, 5)
    assert ledger.commit(completed_steps=4) is None  # step 4's record is not in metrics.jsonl yet
    manifest = ledger.commit(completed_steps=5)
    assert manifest is not None and manifest.step == 5 and committed_steps(tmp_path) == [5]
    ledger.confirm(1, 5)  # repeated after the commit: nothing new
    assert ledger.commit(completed_steps=5) is None
    for step in (10, 15):
        for shard in range(3):
            ledger.confirm(shard, step)
    assert ledger.commit(completed_steps=20).step == 15  # type: ignore[union-attr]
    assert committed_steps(tmp_path) == [5, 15]  # the newest ready step; keep 2
    assert newest_manifest(tmp_path, JobIdentity("abc")).step == 15  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="out of range"):
        ledger.confirm(3, 20)


def test_newest_manifest_refuses_another_job_file(tmp_path):
    assert newest_manifest(tmp_path, JobIdentity("abc")) is None
    ledger = CheckpointLedger(tmp_path, template(shards=1), keep=1)
    ledger.confirm(0, 4)
    ledger.commit(4)
    with pytest.raises(CheckpointMismatch, match="another job file"):
        newest_manifest(tmp_path, JobIdentity("other"))


def test_job_hash_ignores_steps_security_and_eval_only():
    base = {"model": {"factory": "m:f"}, "job": {"steps": 10, "seed": 0}, "security": {"token_file": "a"}}
    assert job_hash(base) == job_hash({**base, "job": {"steps": 99, "seed": 0}, "security": {}, "eval": {"x": 1}})
    assert job_hash(base) != job_hash({**base, "job": {"steps": 10, "seed": 1}})
    assert job_hash(base) != job_hash({**base, "model": {"factory": "m:g"}})


def with_new_key(config):
    """``config`` as a later pstrain would parse the same file: its transport section has one more key."""
    transport = config.transport
    later = make_dataclass(
        "LaterTransport",
        [(f.name, f.type, field(default=getattr(transport, f.name))) for f in fields(transport)]
        + [("a_new_key", int, field(default=7))],
        frozen=True,
    )
    return replace(config, transport=later())


def job_file_hash(raw):
    return job_hash(explicit_settings(parse_config(raw)))


def test_a_job_file_keeps_its_hash_across_an_upgrade_that_adds_a_key():
    config = parse_config(RAW)
    assert job_hash(explicit_settings(with_new_key(config))) == job_file_hash(RAW)
    assert set(explicit_settings(config)) <= set(RAW)  # only the sections the file sets
    explicit_default = {**RAW, "transport": {"bucket_bytes": parse_config(RAW).transport.bucket_bytes}}
    assert job_file_hash(explicit_default) == job_file_hash(RAW)  # a default spelled out is the same job
    resilient = {**RAW, "checkpoint": {"every_steps": 3, "keep": 5}, "fault": {"max_restarts": 9}}
    assert job_file_hash(resilient) == job_file_hash(RAW)  # how it is kept and restarted is not what it trains
    assert job_file_hash({**RAW, "batch": {"per_device": 8}}) != job_file_hash(RAW)
    assert job_file_hash({**RAW, "optimizer": {"name": "adam", "lr": 0.001}}) != job_file_hash(RAW)


def commit_one(directory: Path, identity: JobIdentity) -> None:
    ledger = CheckpointLedger(directory, template(shards=1, digest=identity.digest, settings=identity.settings), keep=2)
    ledger.confirm(0, 4)
    assert ledger.commit(4) is not None


def test_a_resume_names_the_settings_that_differ_and_accepts_older_manifests(tmp_path: Path):
    config = parse_config(RAW)
    identity = JobIdentity.of(config)
    commit_one(tmp_path / "same", identity)
    assert read_manifest(tmp_path / "same", 4).settings == identity.settings
    assert newest_manifest(tmp_path / "same", identity).step == 4  # type: ignore[union-attr]
    other = JobIdentity.of(parse_config({**RAW, "optimizer": {"name": "sgd", "lr": 0.5}}))
    with pytest.raises(CheckpointMismatch, match=r"optimizer\.lr: 0\.1 there, 0\.5 now"):
        newest_manifest(tmp_path / "same", other)
    # A later pstrain with another default for a setting: the same job file (and hash), other resolved settings.
    changed_default = JobIdentity(identity.digest, {**identity.settings, "data.shuffle": "a new default"})
    with pytest.raises(CheckpointMismatch, match="data.shuffle"):
        newest_manifest(tmp_path / "same", changed_default)
    # A manifest of the release before: the whole-config hash and no settings.
    commit_one(tmp_path / "older", JobIdentity(legacy_job_hash(config)))
    assert newest_manifest(tmp_path / "older", identity).step == 4  # type: ignore[union-attr]
    with pytest.raises(CheckpointMismatch, match="hash"):
        newest_manifest(tmp_path / "older", other)


def test_a_fast_shard_keeps_the_files_of_every_committed_checkpoint(tmp_path: Path):
    """A shard far ahead of a slow one deletes nothing the coordinator may still resume from."""
    ledger = CheckpointLedger(tmp_path, template(shards=2), keep=2)

    def on_written(shard: int, step: int) -> int:
        ledger.confirm(shard, step)
        ledger.commit(completed_steps=100)
        return ledger.last_committed

    fast, slow = (
        CheckpointWriter(tmp_path, s, keep=2, on_written=lambda step, s=s: on_written(s, step)) for s in (0, 1)
    )
    for step in (1, 2, 3):
        slow.submit(state(step, shard_id=1))
    slow.close()
    for step in (1, 2, 3, 4, 5, 6):
        fast.submit(state(step, shard_id=0))
    fast.close()
    assert committed_steps(tmp_path) == [2, 3]
    for step in committed_steps(tmp_path):  # both committed checkpoints load on every shard
        for s in (0, 1):
            assert load_state(tmp_path, s, 0, 10, step).version == step
    assert written_steps(tmp_path, 0) == [2, 3, 4, 5, 6]


def test_a_step_written_but_never_committed_takes_no_committed_checkpoints_place(tmp_path: Path):
    """Shard 1's write of step 20 fails, so 20 is never committed: shard 0, which writes each step last and so
    hears of each commit at once, keeps its file of 20 and still those of the committed 10 and 30 (the files of
    the committed steps, not a number of files)."""
    ledger = CheckpointLedger(tmp_path, template(shards=2), keep=2)

    def on_written(shard: int, step: int) -> int:
        ledger.confirm(shard, step)
        ledger.commit(completed_steps=100)
        return ledger.last_committed

    def write(writer: CheckpointWriter, step: int, shard: int) -> None:
        before = len(writer.records)
        writer.submit(state(step, shard_id=shard))
        wait_for(lambda: len(writer.records) > before or writer.error is not None, 30, f"shard {shard}'s write")

    writers = [CheckpointWriter(tmp_path, s, keep=2, on_written=lambda step, s=s: on_written(s, step)) for s in (0, 1)]
    in_the_way = tmp_path / "not-a-directory"
    in_the_way.write_text("a file where shard 1's directory would be")
    failing = CheckpointWriter(in_the_way, 1, keep=2, on_written=lambda step: on_written(1, step))
    for step in (10, 20, 30):
        write(failing if step == 20 else writers[1], step, 1)  # 20: the disk was full, say
        write(writers[0], step, 0)
    for writer in (*writers, failing):
        writer.close()
    assert failing.error is not None and committed_steps(tmp_path) == [10, 30]
    for step in committed_steps(tmp_path):
        for s in (0, 1):
            assert load_state(tmp_path, s, 0, 10, step).version == step
    assert written_steps(tmp_path, 0) == [10, 20, 30]


def test_a_failed_prune_leaves_the_writer_writing(tmp_path: Path):
    """Listing or deleting old files fails (EIO, ESTALE on NFS): the next snapshots are still taken and written."""
    writer = CheckpointWriter(tmp_path, 0, keep=1, on_written=lambda step: step)
    listed = writer._steps
    failures = [OSError(5, "Input/output error")]

    def flaky() -> list[int]:
        if failures:
            raise failures.pop()
        return listed()

    writer._steps = flaky  # type: ignore[method-assign]
    for step in (1, 2, 3):
        submitting = threading.Thread(target=writer.submit, args=(state(step),), daemon=True)
        submitting.start()
        submitting.join(30)
        assert not submitting.is_alive(), "the writer thread died: training would wait on its queue for good"
    writer.close()
    assert [r.step for r in writer.records] == [1, 2, 3] and not failures
    assert written_steps(tmp_path, 0) == [3]  # the later prunes went through


def test_a_writer_removes_the_temp_files_of_writes_a_kill_interrupted(tmp_path: Path):
    save_state(tmp_path, state(10))
    left = shard_dir(tmp_path, 0) / ".step-000000020.pt.abcd1234.tmp"  # as atomic_write names its temp file
    left.write_bytes(b"half a checkpoint")
    writer = CheckpointWriter(tmp_path, 0, keep=2, on_written=lambda step: None)
    writer.close()
    assert not left.exists() and written_steps(tmp_path, 0) == [10]


def test_a_writer_drops_files_of_a_discarded_run_past_its_step(tmp_path):
    """After --fresh, files of the old run's later steps would outrank the new ones: they go."""
    for step in (40, 50):
        save_state(tmp_path, state(step))
    done = threading.Event()
    writer = CheckpointWriter(tmp_path, 0, keep=2, on_written=lambda step: done.set())
    writer.submit(state(5))
    assert done.wait(30)
    writer.close()
    assert written_steps(tmp_path, 0) == [5]


def test_resume_point_trains_anew_after_a_finished_run_and_redoes_the_tail_of_an_unexported_one(tmp_path):
    ckpt, model = tmp_path / "ckpt", tmp_path / "model.pt"
    ledger = CheckpointLedger(ckpt, template(shards=1), keep=3)
    for step in (4, 8, 10):
        ledger.confirm(0, step)
        ledger.commit(step)
    assert resume_point(ckpt, JobIdentity("abc"), steps=12, fresh=False, export=model).step == 10  # type: ignore[union-attr]
    # Reached the last step (10) but died before writing model.pt: resume before the end, and forget the later
    # manifest, which the run would otherwise count as committed (and the shards would prune for).
    assert resume_point(ckpt, JobIdentity("abc"), steps=10, fresh=False, export=model).step == 8  # type: ignore[union-attr]
    assert committed_steps(ckpt) == [4, 8]
    ledger = CheckpointLedger(ckpt, template(shards=1), keep=3)
    assert ledger.last_committed == 8
    ledger.confirm(0, 10)
    assert ledger.commit(10) is not None  # the redone tail commits again
    model.write_bytes(b"the exported model")  # written after the final manifest: finished
    assert resume_point(ckpt, JobIdentity("abc"), steps=10, fresh=False, export=model) is None
    assert committed_steps(ckpt) == []  # discarded: the job trains anew
    ledger = CheckpointLedger(ckpt, template(shards=1), keep=3)
    ledger.confirm(0, 4)
    ledger.commit(4)
    assert resume_point(ckpt, JobIdentity("abc"), steps=10, fresh=True) is None and committed_steps(ckpt) == []


def test_an_atomic_write_that_makes_its_directories_makes_their_entries_durable_too(tmp_path: Path, monkeypatch):
    """The first checkpoint of a shard creates ``shard-<id>``: fsyncing the file and its directory is not enough,
    the new directory's own entry in its parent must reach the disk too, or a power loss takes both after the write
    was reported durable. Every directory the write created is fsynced in its parent; the file is 0600."""
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    target = tmp_path / "a" / "b" / "file"
    atomic_write(target, lambda fh: fh.write(b"x"))
    assert target.read_bytes() == b"x" and target.stat().st_mode & 0o777 == 0o600
    for directory in (tmp_path / "a" / "b", tmp_path / "a", tmp_path):  # the file's, and each created one's parent
        assert str(directory) in synced
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]
    synced.clear()
    atomic_write(target, lambda fh: fh.write(b"y"))  # nothing created this time: only the file and its directory
    assert synced[1:] == [str(tmp_path / "a" / "b")]


def test_the_job_key_is_written_whole_and_private(tmp_path: Path):
    from pstrain.coordinator.main import job_keys

    keys = job_keys(tmp_path / "out", recovered=False)
    key_file = tmp_path / "out" / "job.key"
    assert key_file.read_bytes() == keys.job_key and key_file.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in key_file.parent.iterdir()) == ["job.key"]  # no temp file left
    assert job_keys(tmp_path / "out", recovered=True).job_key == keys.job_key
