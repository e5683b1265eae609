"""The coordinator's gauges against the plain Job: they follow the job after it changes shape."""

import threading
import time

from prometheus_client import CollectorRegistry

from pstrain.coordinator.metrics import register_job_metrics
from tests.test_min_workers import fail_worker_1, make_job, start, train_step


def test_the_global_batch_gauge_follows_a_min_workers_drop_like_the_status(tmp_path):
    job, clock, _ = make_job(tmp_path, min_workers=2)
    registry = CollectorRegistry()
    register_job_metrics(job, registry)
    start(job)
    assert registry.get_sample_value("pstrain_coordinator_global_batch") == job.status().global_batch == 12
    fail_worker_1(job, clock)  # worker 1 is dropped: 2 workers × 4 samples from step 1 on
    train_step(job, [0, 2], 2)
    assert job.status().global_batch == 8 and job.records[-1].global_batch == 8
    assert registry.get_sample_value("pstrain_coordinator_global_batch") == 8
    assert registry.get_sample_value("pstrain_coordinator_workers_alive") == 2
    assert registry.get_sample_value("pstrain_coordinator_step") == 3


def test_the_loss_gauge_and_the_skipped_count_read_the_last_records_after_a_resume(tmp_path):
    """Both read only the last records now (a scrape copied every record of the job); a ledger resumed from
    metrics.jsonl counts the skipped steps it read back, then the ones it records."""
    import math

    from pstrain.coordinator.ledger import StepLedger, StepRecord
    from tests.test_job import make_job as make_plain_job
    from tests.test_job import report
    from tests.test_job import start as start_plain

    job, _, _, _ = make_plain_job(tmp_path)
    registry = CollectorRegistry()
    register_job_metrics(job, registry)
    assert math.isnan(registry.get_sample_value("pstrain_coordinator_loss"))
    start_plain(job)
    for worker, loss in ((0, 1.0), (1, 3.0)):
        job.report_step(report(worker, 0, loss))
    assert registry.get_sample_value("pstrain_coordinator_loss") == 2.0
    ledger = job.ledger
    skipped = StepRecord(**{**vars(ledger.recent(1)[0]), "step": 1, "skipped": True})
    metrics = tmp_path / "metrics.jsonl"
    job.close()
    metrics.write_text(metrics.read_text() + skipped.to_json() + "\n")
    resumed = StepLedger(2, lambda step: 0.1, metrics, time.monotonic, threading.Condition(), start_step=2)
    try:
        assert resumed.skipped_steps == 1 and [r.step for r in resumed.recent(5)] == [0, 1]
    finally:
        resumed.close()
