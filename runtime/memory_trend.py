"""Memory against time: a least-squares line over recent samples, read as a plateau or as growth (SPEC S2.4).

Two users share it. The coordinator fits each PS shard's RSS, which the shard's heartbeats
carry, and forecasts the shard's memory at the job's end (``coordinator.memory_forecast``).
Every member also fits its own RSS and warns when the trend will pass the limit it lives
under — its cgroup's ``memory.max``, or what the host still has available — because only the
member can see that limit: the coordinator runs on another host.

The reading of a fit: over the window, the fitted line rising by less than ``plateau_growth``
of the level means memory has stopped growing (a noisy plateau fits a near-flat line); the
plateau's size is the window's highest sample, since the process needs its peak, not its
mean. Otherwise it grows, and its size at a later time is the line extrapolated to it. Too
few samples, or samples all at one instant, say nothing: ``UNKNOWN``.

Everything is a pure function of samples and an injected time, so it is tested with
synthetic curves; only the ``*_bytes()`` readers at the bottom touch ``/proc`` and ``/sys``.
"""

from __future__ import annotations

import enum
import logging
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-aligned number (2^63 - 4096)


@dataclass(frozen=True)
class MemorySample:
    t_s: float  # on the sampler's clock
    rss_bytes: int


class Trend(enum.Enum):
    UNKNOWN = "unknown"  # too few samples in the window to say
    PLATEAU = "plateau"  # stopped growing: sized by the window's peak
    GROWING = "growing"  # still growing: sized by the line at a later time


@dataclass(frozen=True)
class TrendSettings:
    window_s: float = 120.0
    """Fit only the samples of the last ``window_s``: memory that grew at startup and then
    settled is judged by how it behaves now."""
    min_samples: int = 5
    """Fewer samples in the window than this: ``UNKNOWN``."""
    plateau_growth: float = 0.02
    """The line's rise over the window, as a fraction of the level, below which memory has stopped growing."""

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be at least 2 to fit a line, got {self.min_samples}")
        if self.plateau_growth < 0:
            raise ValueError(f"plateau_growth must be non-negative, got {self.plateau_growth}")


DEFAULT_SETTINGS = TrendSettings()


@dataclass(frozen=True)
class MemoryTrend:
    """A fit at ``now_s``: the line (``fitted_now_bytes`` + ``slope_bytes_per_s`` · (t − now)) and its reading."""

    trend: Trend
    now_s: float
    peak_bytes: int  # highest sample in the window
    fitted_now_bytes: float
    slope_bytes_per_s: float
    samples: int  # in the window

    def bytes_at(self, t_s: float | None) -> int:
        """The memory needed up to ``t_s``: the plateau's peak, or the line at ``t_s`` (never below the peak).

        A growing trend with no ``t_s`` (the end is not known yet) answers the peak so far: a lower bound.
        """
        if self.trend is Trend.UNKNOWN:
            return 0
        if self.trend is Trend.PLATEAU or t_s is None:
            return self.peak_bytes
        return max(self.peak_bytes, round(self.fitted_now_bytes + self.slope_bytes_per_s * (t_s - self.now_s)))


def _unknown(now_s: float, samples: int = 0) -> MemoryTrend:
    return MemoryTrend(Trend.UNKNOWN, now_s, 0, 0.0, 0.0, samples)


def fit_trend(samples: Sequence[MemorySample], now_s: float, settings: TrendSettings = DEFAULT_SETTINGS) -> MemoryTrend:
    """Least squares of RSS against time over the samples of the last ``settings.window_s`` before ``now_s``."""
    window = [s for s in samples if now_s - settings.window_s <= s.t_s <= now_s]
    if len(window) < settings.min_samples:
        return _unknown(now_s, len(window))
    n = len(window)
    mean_t = sum(s.t_s for s in window) / n
    mean_y = sum(s.rss_bytes for s in window) / n
    var_t = sum((s.t_s - mean_t) ** 2 for s in window)
    span_s = max(s.t_s for s in window) - min(s.t_s for s in window)
    if var_t <= 0 or span_s <= 0:
        return _unknown(now_s, n)
    slope = sum((s.t_s - mean_t) * (s.rss_bytes - mean_y) for s in window) / var_t
    peak = max(s.rss_bytes for s in window)
    fitted_now = mean_y + slope * (now_s - mean_t)
    grows = slope * span_s > settings.plateau_growth * max(mean_y, 1.0)
    return MemoryTrend(Trend.GROWING if grows else Trend.PLATEAU, now_s, peak, fitted_now, slope, n)


# ---------------------------------------------------------------------- a member's own limit


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # "cgroup memory.max" | "host MemAvailable"


class MemoryGuard:
    """A member's check of its own RSS trend against its own limit; warns at most every ``warn_every_s``.

    The limit is the lower of the cgroup's ``memory.max`` and this RSS plus the host's
    ``MemAvailable`` (what the process could still grow into). It warns when the RSS, at a plateau,
    or extrapolated ``horizon_s`` ahead while growing, passes ``headroom`` of that limit: early,
    while there is time to act (a larger ``MemoryMax``, fewer shards per host), not at the OOM kill.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        limit: Callable[[int], MemoryLimit | None],
        settings: TrendSettings = DEFAULT_SETTINGS,
        horizon_s: float = 3600.0,
        headroom: float = 0.9,
        warn_every_s: float = 600.0,
        keep: int = 512,
    ) -> None:
        self._clock = clock
        self._limit = limit
        self._settings = settings
        self._horizon_s = horizon_s
        self._headroom = headroom
        self._warn_every_s = warn_every_s
        self._keep = keep
        self._samples: list[MemorySample] = []
        self._warned_at: float | None = None

    def observe(self, rss_bytes: int) -> str | None:
        """Take one sample; returns the warning it logged, if any."""
        if rss_bytes <= 0:
            return None
        now = self._clock()
        self._samples.append(MemorySample(now, rss_bytes))
        del self._samples[: -self._keep]
        if self._warned_at is not None and now - self._warned_at < self._warn_every_s:
            return None
        fit = fit_trend(self._samples, now, self._settings)
        if fit.trend is Trend.UNKNOWN:
            return None
        limit = self._limit(rss_bytes)
        if limit is None:
            return None
        warning = self._judge(fit, limit)
        if warning is not None:
            self._warned_at = now
            log.warning("%s", warning)
        return warning

    def _judge(self, fit: MemoryTrend, limit: MemoryLimit) -> str | None:
        threshold = self._headroom * limit.bytes
        if fit.trend is Trend.PLATEAU:
            if fit.peak_bytes <= threshold:
                return None
            return (
                f"memory: RSS plateaus at {fit.peak_bytes} B, above {self._headroom:.0%} of the {limit.source} "
                f"limit {limit.bytes} B"
            )
        ahead = fit.bytes_at(fit.now_s + self._horizon_s)
        if ahead <= threshold:
            return None
        to_limit_s = max(0.0, (limit.bytes - fit.fitted_now_bytes) / fit.slope_bytes_per_s)
        return (
            f"memory: RSS {fit.fitted_now_bytes:.0f} B grows {fit.slope_bytes_per_s:.0f} B/s and reaches the "
            f"{limit.source} limit {limit.bytes} B in about {to_limit_s:.0f} s"
        )


# ---------------------------------------------------------------------- readers of this process and host


def rss_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    """This process's resident memory now; 0 where /proc is not there."""
    try:
        return int(statm.read_text().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def cgroup_memory_max(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None when unlimited.

    The cgroup's own directory is tried first, then the mount's root, which is what a process in a
    cgroup namespace (a container) sees as its own.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            for base in (root, root / "unified"):
                candidates += [base / relative / "memory.max", base / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates += [
                root / "memory" / relative / "memory.limit_in_bytes",
                root / "memory" / "memory.limit_in_bytes",
            ]
    for candidate in candidates:
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _UNLIMITED else value
    return None


def host_memory_for_offload() -> int | None:
    """This host's memory for the workers' offload: the cgroup's memory.max when set, else MemAvailable. The
    coordinator plans with its own (right when the workers run on its host, ``pstrain local``); a probing master
    reports its host's with its profile."""
    limit = cgroup_memory_max()
    return limit if limit is not None else mem_available_bytes()


def host_memory_limit(rss: int) -> MemoryLimit | None:
    """What this process may grow to: the lower of its cgroup's limit and its RSS plus the host's MemAvailable."""
    limits = []
    cgroup = cgroup_memory_max()
    if cgroup is not None:
        limits.append(MemoryLimit(cgroup, "cgroup memory.max"))
    available = mem_available_bytes()
    if available is not None:
        limits.append(MemoryLimit(rss + available, "host MemAvailable"))
    return min(limits, key=lambda limit: limit.bytes, default=None)
