"""S2.4, the PS memory forecast: synthetic RSS curves through the fit, the job and the wire; a member's own guard."""

import random
import threading

import pytest
from prometheus_client import CollectorRegistry

from pstrain.coordinator.memory_forecast import MemoryHistory, expected_end_s, forecast_ps_memory
from pstrain.coordinator.metrics import register_ps_memory_metrics
from pstrain.coordinator.service import CoordinatorServicer
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.member import MemberProcess
from pstrain.runtime.memory_trend import (
    MemoryGuard,
    MemoryLimit,
    MemorySample,
    Trend,
    TrendSettings,
    cgroup_memory_max,
    fit_trend,
    mem_available_bytes,
    rss_bytes,
)
from pstrain.runtime.transport import open_channel, start_server
from tests.test_job import make_job, report, start
from tests.test_member import member_args

MB = 1 << 20
WAIT_S = 30.0


def curve(f, t0=0.0, n=60, dt=2.0):
    """Samples of ``f(t)`` every ``dt`` seconds, as 2 s heartbeats would take them."""
    return [MemorySample(t0 + i * dt, int(f(t0 + i * dt))) for i in range(n)]


# ---------------------------------------------------------------------- the fit


def test_a_plateau_is_sized_at_its_level():
    fit = fit_trend(curve(lambda t: 500 * MB), now_s=118.0)
    assert fit.trend is Trend.PLATEAU and fit.samples == 60
    assert fit.bytes_at(10_000.0) == 500 * MB, "a plateau does not extrapolate"
    assert fit.slope_bytes_per_s == pytest.approx(0.0)


@pytest.mark.parametrize("seed", range(20))
def test_a_noisy_plateau_is_still_a_plateau_sized_at_its_peak(seed):
    rng = random.Random(seed)
    samples = curve(lambda t: 500 * MB * (1 + rng.uniform(-0.01, 0.01)), n=30)  # ±1%, one minute
    fit = fit_trend(samples, now_s=58.0)
    assert fit.trend is Trend.PLATEAU, "noise tilts the line either way, by less than the plateau's 2%"
    assert fit.bytes_at(10_000.0) == max(s.rss_bytes for s in samples) > 500 * MB


def test_linear_growth_is_extrapolated_to_the_end():
    samples = curve(lambda t: 400 * MB + 1 * MB * t)  # 1 MiB/s from 400 MiB, t = 0..118
    fit = fit_trend(samples, now_s=118.0)
    assert fit.trend is Trend.GROWING
    assert fit.slope_bytes_per_s == pytest.approx(MB)
    assert fit.bytes_at(1118.0) == pytest.approx(400 * MB + 1118 * MB, rel=1e-9)
    assert fit.bytes_at(None) == samples[-1].rss_bytes, "no end yet: the peak so far, a lower bound"
    assert fit.bytes_at(0.0) == samples[-1].rss_bytes, "never below what it already took"


def test_startup_growth_outside_the_window_does_not_count():
    ramp = curve(lambda t: 10 * MB * t, n=30)  # 0..58 s: loading
    flat = curve(lambda t: 600 * MB, t0=60.0, n=90)  # 60..238 s: settled
    assert fit_trend(ramp + flat, now_s=238.0, settings=TrendSettings(window_s=120.0)).trend is Trend.PLATEAU
    assert fit_trend(ramp + flat, now_s=238.0, settings=TrendSettings(window_s=300.0)).trend is Trend.GROWING


def test_too_few_samples_say_nothing():
    assert fit_trend(curve(lambda t: 500 * MB, n=4), now_s=6.0).trend is Trend.UNKNOWN
    assert fit_trend([], now_s=0.0).bytes_at(100.0) == 0
    same_instant = [MemorySample(5.0, 500 * MB)] * 10
    assert fit_trend(same_instant, now_s=5.0).trend is Trend.UNKNOWN
    old = curve(lambda t: 500 * MB)  # t = 0..118, all older than the window at now = 1000
    assert fit_trend(old, now_s=1000.0).trend is Trend.UNKNOWN


def test_settings_are_checked():
    with pytest.raises(ValueError, match="min_samples"):
        TrendSettings(min_samples=1)
    with pytest.raises(ValueError, match="window_s"):
        TrendSettings(window_s=0)


# ---------------------------------------------------------------------- the end time and the shards


def test_the_end_is_estimated_from_the_recent_step_rate():
    assert expected_end_s(100.0, 0, 50, []) is None, "no step done: no rate"
    assert expected_end_s(100.0, 10, 50, [2.0, 2.0, 4.0]) == pytest.approx(100.0 + 40 * (8.0 / 3))
    assert expected_end_s(100.0, 50, 50, [2.0]) == 100.0, "all done: it ends now"


def test_shards_combine_to_the_largest_and_growing_wins():
    flat = curve(lambda t: 300 * MB)
    growing = curve(lambda t: 200 * MB + MB * t)
    both = forecast_ps_memory({0: flat, 1: growing}, now_s=118.0, end_s=418.0)
    assert both.trend is Trend.GROWING
    assert both.bytes == pytest.approx(200 * MB + 418 * MB, rel=1e-9) == max(s.bytes for s in both.shards)
    assert [s.bytes for s in both.shards][0] == 300 * MB
    plateaus = forecast_ps_memory({0: flat, 1: curve(lambda t: 100 * MB)}, now_s=118.0, end_s=None)
    assert (plateaus.trend, plateaus.bytes) == (Trend.PLATEAU, 300 * MB)
    waiting = forecast_ps_memory({0: flat, 1: curve(lambda t: 100 * MB, n=2)}, now_s=118.0, end_s=None)
    assert (waiting.trend, waiting.bytes) == (Trend.UNKNOWN, 0), "a shard without enough samples: unknown"
    assert forecast_ps_memory({}, now_s=0.0, end_s=None).trend is Trend.UNKNOWN


def test_a_history_keeps_the_newest_and_skips_heartbeats_without_rss():
    history = MemoryHistory(keep=3)
    for t in range(5):
        history.add(float(t), (t + 1) * MB)
    history.add(9.0, 0)
    assert [s.t_s for s in history.samples] == [2.0, 3.0, 4.0]


# ---------------------------------------------------------------------- the job, the status, the metrics


def beat_all(job, clock, seconds, rss_of):
    """Heartbeats of every PS shard every 2 s for ``seconds``; ``rss_of(shard, t)`` is the RSS each carries."""
    for _ in range(int(seconds // 2)):
        clock.now += 2.0
        for shard in range(3):
            assert not job.heartbeat("ps", shard, rss_of(shard, clock.now)).stop


def test_membership_records_heartbeat_rss_and_the_status_carries_the_forecast(tmp_path):
    job, clock, _, _ = make_job(tmp_path)  # 3 PS shards, 2 workers, 3 steps
    start(job)
    assert (job.status().ps_memory_trend, job.status().ps_memory_forecast_bytes) == ("unknown", 0)
    job.heartbeat("worker", 0)  # no RSS: alive, but not a sample
    assert len(job.membership.worker(0).memory) == 0
    beat_all(job, clock, 20, lambda shard, t: (100 + 10 * shard) * MB)
    assert [s.rss_bytes for s in job.membership.ps(2).memory.samples] == [120 * MB] * 10
    status = job.status()
    assert (status.ps_memory_trend, status.ps_memory_forecast_bytes) == ("plateau", 120 * MB)

    # Shard 1 grows at 1 MiB/s. Before a step completes the end is unknown: the peak so far.
    t0 = clock.now
    beat_all(job, clock, 120, lambda shard, t: (100 + 10 * shard) * MB + (MB * (t - t0) if shard == 1 else 0))
    status = job.status()
    assert status.ps_memory_trend == "growing"
    assert status.ps_memory_forecast_bytes == 110 * MB + 120 * MB
    # Step 0 completes (timed from the start of training); two are left: the line is read at the end.
    clock.now += 10.0
    job.report_step(report(0, 0))
    job.report_step(report(1, 0))
    forecast = job.ps_memory_forecast()
    assert forecast.end_s == pytest.approx(clock.now + 2 * job.records[-1].step_s) and forecast.end_s > clock.now
    assert job.status().ps_memory_forecast_bytes == pytest.approx(110 * MB + (forecast.end_s - t0) * MB, rel=1e-6)

    registry = CollectorRegistry()
    register_ps_memory_metrics(job, registry)
    assert registry.get_sample_value("pstrain_coordinator_ps_memory_forecast_bytes") == forecast.bytes
    assert registry.get_sample_value("pstrain_coordinator_ps_shard_memory_forecast_bytes", {"shard": "0"}) == 100 * MB
    assert registry.get_sample_value("pstrain_coordinator_ps_memory_trend", {"trend": "growing"}) == 1.0
    assert registry.get_sample_value("pstrain_coordinator_ps_memory_trend", {"trend": "plateau"}) == 0.0

    clock.now += 31  # shard 1's process died: silent past the heartbeat timeout (30 s)
    job.membership.register_ps(1, "127.0.0.1:5001")  # the same shard registers again (restarted): its curve starts anew
    assert len(job.membership.ps(1).memory) == 0
    assert job.status().ps_memory_trend == "unknown"


class SignallingServicer(CoordinatorServicer):
    """The real servicer; sets ``beat`` when a heartbeat carrying RSS arrived."""

    def __init__(self, job) -> None:
        super().__init__(job)
        self.beat = threading.Event()

    def Heartbeat(self, request, context):
        reply = super().Heartbeat(request, context)
        if request.rss_bytes > 0:
            self.beat.set()
        return reply


@pytest.fixture
def served_job(tmp_path):
    job, clock, _, _ = make_job(tmp_path)
    start(job)
    servicer = SignallingServicer(job)
    server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], ["Coordinator"])
    yield job, clock, servicer, f"127.0.0.1:{server.port}"
    server.stop(0)


def test_the_wire_carries_rss_in_and_the_forecast_out(served_job):
    job, clock, _, address = served_job
    with open_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for i in range(10):
            clock.now += 2.0
            for shard in range(3):
                stub.Heartbeat(pb.HeartbeatRequest(role="ps", id=shard, rss_bytes=(200 + i) * MB), timeout=10)
        status = stub.GetJobStatus(pb.JobStatusRequest(), timeout=10)
    assert status.ps_memory_trend == "growing"
    assert status.ps_memory_forecast_bytes == 209 * MB, "no step done yet: the peak so far"
    assert [s.rss_bytes for s in job.membership.ps(0).memory.samples][-1] == 209 * MB


def test_a_member_heartbeat_carries_its_rss(served_job, tmp_path, monkeypatch):
    job, _, servicer, address = served_job
    monkeypatch.delenv("PSTRAIN_TOKEN", raising=False)
    member = MemberProcess(member_args(address, tmp_path), "ps", [], [], signals=())
    observed: list[int] = []
    member.memory_guard.observe = observed.append  # type: ignore[method-assign]

    def body(m: MemberProcess) -> int:
        m.ready()
        m.start_heartbeat(1, 0.01, stop_when_job_ends=True)
        return 0 if servicer.beat.wait(WAIT_S) else 1

    assert member.run(body) == 0
    sample = job.membership.ps(1).memory.samples[0]
    assert 10 * MB < sample.rss_bytes == observed[0], "the beat's RSS is what the member's own guard saw"


# ---------------------------------------------------------------------- a member's own limit


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_guard_warns_early_and_rate_limits(caplog):
    clock = FakeClock()
    limit = MemoryLimit(2000 * MB, "cgroup memory.max")
    guard = MemoryGuard(clock, lambda rss: limit, horizon_s=3600.0, warn_every_s=600.0)
    warned_at = []
    for i in range(400):  # 1000 MiB growing 0.5 MiB/s: the limit is ~2000 s away, within the 1 h horizon
        clock.now = 2.0 * i
        warning = guard.observe(1000 * MB + int(0.5 * MB * clock.now))
        if warning is not None:
            assert "cgroup memory.max" in warning and "reaches" in warning and warning in caplog.text
            warned_at.append(clock.now)
    assert len(warned_at) == 2, "early (as soon as the growth shows), then once per warn_every_s"
    assert 8.0 < warned_at[0] < 120.0 and warned_at[1] - warned_at[0] >= 600.0


def test_the_guard_is_quiet_under_its_limit_and_warns_at_a_plateau_near_it():
    clock = FakeClock()
    roomy = MemoryGuard(clock, lambda rss: MemoryLimit(4000 * MB, "host MemAvailable"))
    crowded = MemoryGuard(clock, lambda rss: MemoryLimit(1050 * MB, "host MemAvailable"))  # 90%: 945 MiB
    unlimited = MemoryGuard(clock, lambda rss: None)
    heard, crowded_heard = [], []
    for i in range(10):
        clock.now = 2.0 * i
        heard += [roomy.observe(1000 * MB), unlimited.observe(1000 * MB)]
        crowded_heard.append(crowded.observe(1000 * MB))
    assert heard == [None] * 20
    assert crowded_heard[:4] == [None] * 4 and "plateaus at" in (crowded_heard[4] or "")
    assert crowded_heard[5:] == [None] * 5


# ---------------------------------------------------------------------- readers


def test_limit_readers(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "system.slice" / "ps.service").mkdir(parents=True)
    (v2 / "system.slice" / "ps.service" / "memory.max").write_text("1073741824\n")
    (tmp_path / "cgroup2").write_text("0::/system.slice/ps.service\n")
    assert cgroup_memory_max(tmp_path / "cgroup2", v2) == 1 << 30
    (v2 / "system.slice" / "ps.service" / "memory.max").write_text("max\n")
    assert cgroup_memory_max(tmp_path / "cgroup2", v2) is None

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("536870912\n")  # only the namespace root is visible
    (tmp_path / "cgroup1").write_text("5:cpu:/\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory_max(tmp_path / "cgroup1", v1) == 512 * MB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_max(tmp_path / "cgroup1", v1) is None, "v1's 'no limit'"
    assert cgroup_memory_max(tmp_path / "absent", v1) is None

    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available_bytes(tmp_path / "meminfo") == 2 * MB
    assert mem_available_bytes(tmp_path / "absent") is None
    assert rss_bytes() > 10 * MB
