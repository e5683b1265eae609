"""Sizing workers from a measured probe (SPEC S2.1-S2.3) and shrinking a batch that did not fit.

The master worker runs one real iteration and reports its peak memory. From the actual
figure the coordinator estimates what every worker needs by one of S2.2's modes:

* factor:    actual x factor
* increment: actual + increment
* iterative: limit = actual + increment; run one iteration under that limit and watch the
             utilisation (peak / limit); accept once it is at most the target utilisation,
             else raise the limit by the increment and try again; never past the device's
             memory (accepted, with a warning, once the limit reaches it).

If the probe's real peak exceeds the device memory, the plan was wrong: the batch shrinks in
proportion (with the margin) and is re-planned and probed again.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

from pstrain.planner.profiler import ModelProfile

log = logging.getLogger(__name__)


class EstimateMode(str, enum.Enum):
    FACTOR = "factor"
    INCREMENT = "increment"
    ITERATIVE = "iterative"


@dataclass(frozen=True)
class EstimatePolicy:
    mode: EstimateMode = EstimateMode.FACTOR
    factor: float = 1.25
    increment_bytes: int = 1 << 30
    target_utilization: float = 0.85
    max_trials: int = 8


@dataclass(frozen=True)
class Probe:
    batch: int
    device_peak_bytes: int
    host_peak_bytes: int
    limit_bytes: int = 0  # the cap of an iterative trial
    profile: ModelProfile | None = None  # issue 10: the master's per-layer profile on its device (first probe)

    @property
    def utilization(self) -> float:
        return self.device_peak_bytes / self.limit_bytes if self.limit_bytes else 0.0


class IterativeEstimate:
    """The S2.2(c) loop as a state machine the coordinator drives one probe at a time.

    ``cap_bytes`` is the device's memory. A limit past it means nothing: the worker clamps
    ``set_per_process_memory_fraction`` at 1 (CUDA refuses more), so such a trial only repeats the first
    probe, which ran on the whole device, and the estimate handed to the operator would exceed the GPU.
    So the limit never grows past the cap; once it reaches it the loop stops and accepts it, with a warning.
    """

    def __init__(self, policy: EstimatePolicy, actual_bytes: int, cap_bytes: int | None = None) -> None:
        self.policy = policy
        self.cap_bytes = cap_bytes if cap_bytes is not None and cap_bytes > 0 else None
        self.limit = self._capped(actual_bytes + policy.increment_bytes)
        self.trials = 0

    @property
    def capped(self) -> bool:
        """Whether the limit has reached the device's memory: no trial can raise it further."""
        return self.cap_bytes is not None and self.limit >= self.cap_bytes

    def _capped(self, limit: int) -> int:
        return limit if self.cap_bytes is None else min(limit, self.cap_bytes)

    def warn_capped(self, peak_bytes: int) -> None:
        """Say that the estimate stopped at the device's memory, and what the operator can do about it."""
        log.warning(
            "iterative memory estimate: the limit reached the device's memory (%d B) after %d trial(s); the peak "
            "%d B uses %.0f%% of it, target %.0f%%; accepting %d B (lower batch.per_device for headroom, or raise "
            "memory.target_utilization)",
            self.limit,
            self.trials,
            peak_bytes,
            100 * peak_bytes / self.limit if self.limit else 0.0,
            100 * self.policy.target_utilization,
            self.limit,
        )

    def next_limit(self, trial: Probe) -> int | None:
        """None: ``self.limit`` is accepted; else the next limit to try."""
        self.trials += 1
        if trial.limit_bytes and trial.utilization <= self.policy.target_utilization:
            return None
        if self.trials >= self.policy.max_trials:
            log.warning(
                "iterative memory estimate: %d trials ran out at utilisation %.0f%% of %d B, over the target "
                "%.0f%%; accepting %d B (raise memory.increment or lower memory.target_utilization)",
                self.trials,
                100 * trial.utilization,
                trial.limit_bytes,
                100 * self.policy.target_utilization,
                self.limit,
            )
            return None  # accept the last limit rather than loop forever
        self.limit = self._capped(self.limit + self.policy.increment_bytes)
        if self.capped:
            self.warn_capped(trial.device_peak_bytes)
            return None
        return self.limit


def estimate(policy: EstimatePolicy, actual_bytes: int) -> int:
    """Factor and increment modes; the iterative mode starts from ``actual + increment``."""
    if policy.mode == EstimateMode.FACTOR:
        return math.ceil(actual_bytes * policy.factor)
    return actual_bytes + policy.increment_bytes


def shrunk_batch(batch: int, peak_bytes: int, device_bytes: int, margin: float) -> int:
    """The batch the measured peak says would fit, a little under it."""
    if peak_bytes <= device_bytes:
        return batch
    fitted = math.floor(batch * device_bytes * (1 - margin) / peak_bytes)
    return max(1, min(batch - 1, fitted))
