"""The worker's Prometheus metrics (base units, ``_total`` counters)."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

STEP = Gauge("pstrain_worker_step", "Steps this worker has completed")
STEP_SECONDS = Histogram("pstrain_worker_step_seconds", "Wall time of one step", buckets=LATENCY_BUCKETS)
COMPUTE_SECONDS = Histogram(
    "pstrain_worker_compute_seconds", "Forward/backward on every device plus the host sum", buckets=LATENCY_BUCKETS
)
PUSH_SECONDS = Histogram("pstrain_worker_push_seconds", "Push to every shard", buckets=LATENCY_BUCKETS)
PULL_SECONDS = Histogram(
    "pstrain_worker_pull_seconds",
    "Pull from every shard, including the wait for slower workers",
    buckets=LATENCY_BUCKETS,
)
BYTES_PUSHED = Counter("pstrain_worker_pushed_bytes_total", "Gradient bytes pushed to the parameter server")
BYTES_PULLED = Counter("pstrain_worker_pulled_bytes_total", "Parameter bytes pulled from the parameter server")
SAMPLES = Counter("pstrain_worker_samples_total", "Training samples processed")
LOSS = Gauge("pstrain_worker_loss", "Mean loss of the last step")
SKIPPED_STEPS = Counter(
    "pstrain_worker_skipped_steps_total",
    "Steps this worker skipped for a non-finite loss or gradient (fault.on_nonfinite: skip)",
)
