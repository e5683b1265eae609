"""The coordinator's journal: durable appends, compaction on a committed checkpoint, torn lines skipped."""

from __future__ import annotations

from pstrain.coordinator.journal import Journal, read_journal


def test_events_are_appended_compacted_on_commit_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "out" / "journal.jsonl"
    journal = Journal(path)
    journal.append("worker_failed", worker=1, held_step=4)
    journal.append("data_shard_completed", worker=0, data_shard=7)
    assert [(e["event"], e.get("worker")) for e in read_journal(path)] == [
        ("worker_failed", 1),
        ("data_shard_completed", 0),
    ]
    journal.compact(10)
    journal.append("step", step=10)
    assert [(e["event"], e.get("step")) for e in read_journal(path)] == [("checkpoint", 10), ("step", 10)]
    journal.close()
    journal.append("after_close")  # a late event after the job closed is dropped, not an error
    with open(path, "a") as fh:
        fh.write('{"event": "step", "st')  # a crash mid-write
    assert [e["event"] for e in read_journal(path)] == ["checkpoint", "step"]
    reopened = Journal(path)  # a restarted coordinator appends after what is there
    reopened.append("worker_registered", worker=0)
    reopened.close()
    assert read_journal(path)[-1]["event"] == "worker_registered"


def test_a_compaction_keeps_the_snapshot_and_a_reset_starts_a_new_job(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.append("report", False, report={"worker_id": 0, "step": 3})  # flushed, not fsynced
    journal.compact(4, {"job_id": "j", "completed": 4})
    journal.append("step", step=4)
    assert [(e["event"], e.get("job_id")) for e in read_journal(path)] == [
        ("checkpoint", None),
        ("snapshot", "j"),
        ("step", None),
    ]
    journal.reset()
    journal.append("job_started", job_id="k")
    journal.close()
    assert [e["event"] for e in read_journal(path)] == ["job_started"]
