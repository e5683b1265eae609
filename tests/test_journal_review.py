"""The journal and the committed manifests under damage: torn and corrupt lines, a full disk, lost directory entries.

"Killed mid-write" is a real file truncated at every offset; "disk full" is a real write past ``RLIMIT_FSIZE`` in a
child process (``EFBIG``, the same partial write and error as ``ENOSPC``), so the test process keeps its own limits.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pstrain.coordinator.checkpoints import (
    CheckpointLedger,
    JobIdentity,
    Manifest,
    committed_steps,
    manifest_path,
    newest_manifest,
    resume_point,
)
from pstrain.coordinator.config import parse_config
from pstrain.coordinator.journal import Journal, JournalUnusable, read_journal, recovery
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.main import build_job
from tests.helpers import REPO_ROOT, write_job
from tests.test_metrics_status import started

MEMBERS = [{"role": "ps", "id": 0, "address": "127.0.0.1:5000"}]


def write_journal(path: Path, job_hash: str = "") -> list[bytes]:
    """A small real journal: a job started, credentials, data shards and steps; its lines as written."""
    journal = Journal(path)
    extra = {"job_hash": job_hash} if job_hash else {}
    journal.append("members", members=MEMBERS)
    journal.append("job_started", job_id="j", per_device_batch=4, start_step=0, completed=0, members=MEMBERS, **extra)
    for step in range(3):
        journal.append("credential", role="worker", id=step, incarnation=step + 1)
        journal.append("data_shard_completed", False, worker=0, data_shard=step)
        journal.append("step", step=step)
    journal.close()
    return path.read_bytes().splitlines(keepends=True)


def test_a_damaged_line_before_the_last_is_refused_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    lines = write_journal(path)
    whole = b"".join(lines)
    for offset in range(len(whole) + 1):  # killed mid-write anywhere: a prefix of the events, never an error
        path.write_bytes(whole[:offset])
        kept = read_journal(path)
        assert kept == [json.loads(line) for line in lines[: len(kept)]]
    for damage in (b"{torn\n", b'{"t":1,"ev\x00\x00\n', b"\xff\xfe\n", b"[1, 2]\n", b"\n"):
        path.write_bytes(b"".join([*lines[:4], damage, *lines[5:]]))
        with pytest.raises(JournalUnusable, match=f"line 5 of {len(lines)} is not a complete event"):
            recovery(path)
    path.write_bytes(b"")
    with pytest.raises(JournalUnusable, match="no running job"):
        recovery(path)


def run_at_file_size_limit(script: str, tmp_path: Path) -> dict:
    """Run ``script`` in a child with SIGXFSZ ignored, so a write past the limit fails like a full disk."""
    prelude = "import json, resource, signal, sys\nfrom pathlib import Path\n"
    prelude += "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_append_that_failed_on_a_full_disk_is_not_completed_by_the_next(tmp_path: Path) -> None:
    result = run_at_file_size_limit(
        """
        from pstrain.coordinator.journal import Journal, read_journal
        path = Path(sys.argv[1]) / "journal.jsonl"
        journal = Journal(path)
        journal.append("job_started", job_id="j")
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 30, resource.RLIM_INFINITY))
        try:
            journal.append("credential", role="worker", id=0, incarnation=1, pad="x" * 80)
            failed = False
        except OSError:
            failed = True
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        journal.append("step", step=0)
        journal.close()
        print(json.dumps({"failed": failed, "events": [e["event"] for e in read_journal(path)]}))
        """,
        tmp_path,
    )
    # The caller was told the credential was not journaled: it must not appear later, nor leave half a line.
    assert result == {"failed": True, "events": ["job_started", "step"]}


def test_a_compaction_that_failed_on_a_full_disk_keeps_the_old_journal_and_later_events(tmp_path: Path) -> None:
    result = run_at_file_size_limit(
        """
        from pstrain.coordinator.journal import Journal, read_journal
        path = Path(sys.argv[1]) / "journal.jsonl"
        journal = Journal(path)
        journal.append("job_started", job_id="j")
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))
        try:
            journal.compact(5, {"job_id": "j", "pad": "x" * 500})
            failed = False
        except OSError:
            failed = True
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        journal.append("credential", role="worker", id=0, incarnation=3)
        journal.close()
        print(json.dumps({
            "failed": failed,
            "events": [e["event"] for e in read_journal(path)],
            "files": sorted(p.name for p in path.parent.iterdir()),
        }))
        """,
        tmp_path,
    )
    # Before: every event after the failed compaction was silently dropped (the journal stayed closed).
    assert result == {"failed": True, "events": ["job_started", "credential"], "files": ["journal.jsonl"]}


def test_a_new_journal_and_a_reset_one_are_durable_in_their_directory(tmp_path: Path, monkeypatch) -> None:
    synced: list[os.stat_result] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.fstat(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    folder = tmp_path / "out"
    journal = Journal(folder / "journal.jsonl")
    try:
        assert any(stat.S_ISDIR(s.st_mode) and s.st_ino == folder.stat().st_ino for s in synced)
        journal.append("job_started", job_id="old")
        synced.clear()
        journal.reset()  # the old job's events must not come back after a power loss
        inode = (folder / "journal.jsonl").stat().st_ino
        assert any(stat.S_ISREG(s.st_mode) and s.st_ino == inode and s.st_size == 0 for s in synced)
    finally:
        journal.close()


def test_a_journal_of_another_job_file_is_not_taken_back(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    write_journal(path, job_hash="aaaa")
    assert recovery(path, job_hash="aaaa").completed == 3
    with pytest.raises(JournalUnusable, match="another job file \\(hash aaaa, this one bbbb\\)"):
        recovery(path, job_hash="bbbb")
    write_journal(path)  # an older journal records no hash: taken back as before
    assert recovery(path, job_hash="bbbb").completed == 3


def committed(directory: Path, steps: tuple[int, ...]) -> None:
    template = Manifest(
        step=-1, job_hash="abc", ps_shards=1, total_params=10, workers=2, per_worker_batch=8, committed_unix_s=0.0
    )
    ledger = CheckpointLedger(directory, template, keep=3)
    for step in steps:
        ledger.confirm(0, step)
        assert ledger.commit(step) is not None


@pytest.mark.parametrize("cut", [0, 1, 0.5, -3])
def test_a_damaged_manifest_is_set_aside_and_the_previous_checkpoint_resumes(tmp_path: Path, cut: float) -> None:
    committed(tmp_path, (4, 8))
    data = manifest_path(tmp_path, 8).read_bytes()
    manifest_path(tmp_path, 8).write_bytes(data[: int(cut * len(data)) if isinstance(cut, float) else cut])
    resumed = resume_point(tmp_path, JobIdentity("abc"), steps=12, fresh=False)
    assert resumed is not None and resumed.step == 4
    assert committed_steps(tmp_path) == [4]  # no ledger or prune counts the damaged one as committed
    assert (tmp_path / "manifest-000000008.json.damaged").exists()  # kept for the operator, not deleted
    assert CheckpointLedger(tmp_path, resumed, keep=3).last_committed == 4


def test_a_damaged_manifest_of_the_tail_of_an_unexported_run_falls_back_too(tmp_path: Path) -> None:
    committed(tmp_path, (4, 8, 10))
    manifest_path(tmp_path, 8).write_text(json.dumps({"step": 8}))  # parses, but not a manifest
    resumed = resume_point(tmp_path, JobIdentity("abc"), steps=10, fresh=False)
    assert resumed is not None and resumed.step == 4 and committed_steps(tmp_path) == [4]
    assert newest_manifest(tmp_path, JobIdentity("abc")).step == 4  # type: ignore[union-attr]


def test_a_restarted_coordinator_takes_the_journal_back_only_for_the_job_file_that_started_it(tmp_path: Path) -> None:
    """End to end through ``build_job``: the coordinator writes its job file's hash into the journal and passes it
    back on a restart. Before, an edited job file (here another learning rate) took the old job back as it was."""
    path = write_job(tmp_path / "job.yaml", cluster={"ps_shards": 1, "workers": 2, "devices_per_worker": 1})
    raw = yaml.safe_load(path.read_text())
    cfg = parse_config(raw)
    out = tmp_path / "out"
    job = started(cfg, out)
    for worker in range(2):
        job.report_step(StepReport(worker_id=worker, step=0, loss=1.0, samples=job.plan.per_device_batch, step_s=0.1))
    job.close()

    again = build_job(cfg, out, recover=True)
    again.close()
    assert again.recovered and again.job_id == job.job_id
    edited = parse_config({**raw, "optimizer": {**raw["optimizer"], "lr": 0.5}})
    other = build_job(edited, out, recover=True)
    other.close()
    assert not other.recovered and other.job_id != job.job_id


def test_a_manifest_with_fields_of_a_newer_version_is_read_not_set_aside(tmp_path: Path) -> None:
    """Unknown keys made a manifest 'damaged' (set aside, the previous checkpoint resumed): a manifest a newer pstrain
    wrote, with a field this one does not know, is read for what this one knows."""
    committed(tmp_path, (4, 8))
    data = json.loads(manifest_path(tmp_path, 8).read_text())
    manifest_path(tmp_path, 8).write_text(json.dumps({**data, "a_field_of_tomorrow": 1}))
    resumed = resume_point(tmp_path, JobIdentity("abc"), steps=12, fresh=False)
    assert resumed is not None and resumed.step == 8
    assert not list(tmp_path.glob("*.damaged"))
