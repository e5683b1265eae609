"""PS memory forecast (SPEC S2.4): each shard's RSS over time, fitted, read at the job's end.

Every heartbeat carries the member's RSS; ``Membership`` keeps a bounded ``MemoryHistory`` per
member. The forecast fits each PS shard's recent samples (``runtime.memory_trend``): a shard
whose memory stopped growing is sized at its plateau; a shard still growing is sized by its
line extrapolated to the job's expected end, which ``expected_end_s`` estimates from the
steps left and the recent step times. The job reports the largest shard's forecast, since
the shards get one memory size (one ``MemoryMax`` for every PS unit), and ``growing`` when
any shard still grows. Until every registered shard has enough samples it says ``unknown`` and 0.

The coordinator cannot compare the forecast with the PS host's memory (it runs elsewhere):
each member checks its own trend against its own limit (``runtime.memory_trend.MemoryGuard``).

Pure functions of samples and an injected time; the ``Job`` calls them with its lock held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pstrain.runtime.memory_trend import DEFAULT_SETTINGS, MemorySample, MemoryTrend, Trend, TrendSettings, fit_trend

RECENT_STEPS = 20  # the step rate for the end time: the mean of the last steps' times


class MemoryHistory:
    """A member's RSS samples, the newest ``keep``: enough for the fit window at any heartbeat rate in use."""

    def __init__(self, keep: int = 512) -> None:
        self._samples: deque[MemorySample] = deque(maxlen=keep)

    def add(self, t_s: float, rss_bytes: int) -> None:
        """Record one sample; a heartbeat without RSS (0: a member that does not measure it) is not one."""
        if rss_bytes > 0:
            self._samples.append(MemorySample(t_s, rss_bytes))

    @property
    def samples(self) -> list[MemorySample]:
        return list(self._samples)

    def __len__(self) -> int:
        return len(self._samples)


def expected_end_s(now_s: float, steps_done: int, steps: int, recent_step_s: Sequence[float]) -> float | None:
    """When the job should end, on the same clock as ``now_s``: the steps left at the recent mean step time.

    None before a step completed (no rate yet). A job with every step done ends now.
    """
    if steps_done >= steps:
        return now_s
    if steps_done <= 0 or not recent_step_s:
        return None
    mean_step_s = sum(recent_step_s) / len(recent_step_s)
    return now_s + (steps - steps_done) * max(mean_step_s, 0.0)


@dataclass(frozen=True)
class ShardForecast:
    shard_id: int
    fit: MemoryTrend
    bytes: int  # memory the shard needs up to the job's end, 0 when unknown


@dataclass(frozen=True)
class PsMemoryForecast:
    trend: Trend
    bytes: int  # the largest shard's forecast; 0 while unknown
    end_s: float | None  # the end time it extrapolates to (None: not known yet)
    shards: tuple[ShardForecast, ...]


def forecast_ps_memory(
    histories: Mapping[int, Sequence[MemorySample]],
    now_s: float,
    end_s: float | None,
    settings: TrendSettings = DEFAULT_SETTINGS,
) -> PsMemoryForecast:
    """Fit every shard's samples at ``now_s`` and read each at ``end_s``; combine as the module docstring says."""
    shards = tuple(
        ShardForecast(shard_id, fit, fit.bytes_at(end_s))
        for shard_id, fit in ((i, fit_trend(histories[i], now_s, settings)) for i in sorted(histories))
    )
    if not shards or any(s.fit.trend is Trend.UNKNOWN for s in shards):
        return PsMemoryForecast(Trend.UNKNOWN, 0, end_s, shards)
    trend = Trend.GROWING if any(s.fit.trend is Trend.GROWING for s in shards) else Trend.PLATEAU
    return PsMemoryForecast(trend, max(s.bytes for s in shards), end_s, shards)
