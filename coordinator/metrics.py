"""The coordinator's Prometheus metrics; gauges read the job when scraped."""

from __future__ import annotations

import functools
import time

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from pstrain.coordinator.job import Job
from pstrain.coordinator.memory_forecast import PsMemoryForecast
from pstrain.runtime.memory_trend import Trend


def register_job_metrics(job: Job, registry: CollectorRegistry = REGISTRY) -> None:
    """Gauges computed from the job at scrape time, so they can never drift from it."""

    def last_loss() -> float:
        last = job.ledger.recent(1)
        return last[0].loss if last else float("nan")

    Gauge("pstrain_coordinator_step", "Steps completed by every worker", registry=registry).set_function(
        lambda: job.ledger.completed
    )
    Gauge("pstrain_coordinator_steps", "Steps the job trains for", registry=registry).set(job.plan.steps)
    Gauge(
        "pstrain_coordinator_state",
        "Job state (1 waiting, 2 running, 3 exporting, 4 finished, 5 failed, 6 probing)",
        registry=registry,
    ).set_function(lambda: int(job.state))
    Gauge(
        "pstrain_coordinator_workers_alive", "Workers heard from within the heartbeat timeout", registry=registry
    ).set_function(lambda: job.alive_count("worker"))
    Gauge(
        "pstrain_coordinator_ps_shards_alive", "PS shards heard from within the heartbeat timeout", registry=registry
    ).set_function(lambda: job.alive_count("ps"))
    Gauge("pstrain_coordinator_loss", "Mean loss of the last completed step", registry=registry).set_function(last_loss)
    Gauge(
        "pstrain_coordinator_global_batch", "Samples per step over all devices (the live workers')", registry=registry
    ).set_function(lambda: job.global_batch)  # not set once at start: a re-plan or a min_workers drop changes it
    data_shards = Gauge("pstrain_coordinator_data_shards", "Data shards by state", ["state"], registry=registry)
    data_shards.labels("todo").set_function(lambda: job.data_shards.counts().todo)
    data_shards.labels("doing").set_function(lambda: job.data_shards.counts().doing)
    data_shards.labels("done").set_function(lambda: job.data_shards.counts().done)
    register_ps_memory_metrics(job, registry)


FORECAST_MAX_AGE_S = 1.0


def register_ps_memory_metrics(job: Job, registry: CollectorRegistry = REGISTRY) -> None:
    """S2.4's forecast: the figure ``GetJobStatus`` reports, each shard's, and the trend as a state set.

    One scrape reads several of these gauges; they share one forecast at most ``FORECAST_MAX_AGE_S`` old
    instead of fitting every shard once per gauge.
    """
    cached: list[tuple[float, PsMemoryForecast]] = []

    def forecast() -> PsMemoryForecast:
        now = time.monotonic()
        if not cached or now - cached[0][0] > FORECAST_MAX_AGE_S:
            cached[:] = [(now, job.ps_memory_forecast())]
        return cached[0][1]

    def shard_bytes(shard_id: int) -> float:
        return next((s.bytes for s in forecast().shards if s.shard_id == shard_id), 0)

    Gauge(
        "pstrain_coordinator_ps_memory_forecast_bytes",
        "Largest PS shard's memory forecast at the job's end (plateau size, or growth extrapolated); 0 unknown",
        registry=registry,
    ).set_function(lambda: forecast().bytes)
    per_shard = Gauge(
        "pstrain_coordinator_ps_shard_memory_forecast_bytes",
        "Each PS shard's memory forecast at the job's end",
        ["shard"],
        registry=registry,
    )
    for shard_id in range(len(job.shard_ranges)):
        per_shard.labels(str(shard_id)).set_function(functools.partial(shard_bytes, shard_id))
    trend = Gauge(
        "pstrain_coordinator_ps_memory_trend",
        "1 for the PS memory trend now, 0 for the others",
        ["trend"],
        registry=registry,
    )

    def is_trend(value: Trend) -> float:
        return float(forecast().trend is value)

    for value in Trend:
        trend.labels(value.value).set_function(functools.partial(is_trend, value))
