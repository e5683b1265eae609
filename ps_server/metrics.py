"""The parameter server's Prometheus metrics (base units, ``_total`` counters)."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

BYTES_PUSHED = Counter("pstrain_ps_pushed_bytes_total", "Gradient payload bytes received by pushes")
BYTES_PULLED = Counter("pstrain_ps_pulled_bytes_total", "Parameter payload bytes sent by pulls")
PUSH_SECONDS = Histogram("pstrain_ps_push_seconds", "Push RPC duration (receive + accumulate)", buckets=LATENCY_BUCKETS)
PULL_SECONDS = Histogram(
    "pstrain_ps_pull_seconds", "Pull RPC duration, including waiting for the version", buckets=LATENCY_BUCKETS
)
UPDATE_SECONDS = Histogram("pstrain_ps_update_seconds", "Optimizer update of the shard", buckets=LATENCY_BUCKETS)
VERSION = Gauge("pstrain_ps_version", "Published parameter version (= steps applied)")
SHARD_BYTES = Gauge("pstrain_ps_shard_bytes", "Bytes held: parameters, accumulator and optimizer state")
PUSHES_WAITING = Gauge("pstrain_ps_pushes_waiting", "Contributions received for the step being collected")
PULLS_WAITING = Gauge("pstrain_ps_pulls_waiting", "Pulls waiting for a version this shard has not published yet")
