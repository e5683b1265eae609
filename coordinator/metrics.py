"""The coordinator's Prometheus metrics; gauges read the job when scraped."""

from __future__ import annotations

from prometheus_client import Gauge

from pstrain.coordinator.job import Job


def register_job_metrics(job: Job) -> None:
    """Gauges computed from the job at scrape time, so they can never drift from it."""

    def last_loss() -> float:
        records = job.records
        return records[-1].loss if records else float("nan")

    Gauge("pstrain_coordinator_step", "Steps completed by every worker").set_function(lambda: job.ledger.completed)
    Gauge("pstrain_coordinator_steps", "Steps the job trains for").set(job.plan.steps)
    Gauge(
        "pstrain_coordinator_state",
        "Job state (1 waiting, 2 running, 3 exporting, 4 finished, 5 failed, 6 probing)",
    ).set_function(lambda: int(job.state))
    Gauge("pstrain_coordinator_workers_alive", "Workers heard from within the heartbeat timeout").set_function(
        lambda: job.alive_count("worker")
    )
    Gauge("pstrain_coordinator_ps_shards_alive", "PS shards heard from within the heartbeat timeout").set_function(
        lambda: job.alive_count("ps")
    )
    Gauge("pstrain_coordinator_loss", "Mean loss of the last completed step").set_function(last_loss)
    Gauge("pstrain_coordinator_global_batch", "Samples per step over all devices").set(job.plan.global_batch)
    data_shards = Gauge("pstrain_coordinator_data_shards", "Data shards by state", ["state"])
    data_shards.labels("todo").set_function(lambda: job.data_shards.counts().todo)
    data_shards.labels("doing").set_function(lambda: job.data_shards.counts().doing)
    data_shards.labels("done").set_function(lambda: job.data_shards.counts().done)
