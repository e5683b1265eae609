"""The coordinator's gauges against the plain Job: they follow the job after it changes shape."""

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
