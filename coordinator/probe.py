"""The probe session (S2.1-S2.3): judge the master worker's measured iteration, one report at a time.

Worker 0 runs one real iteration and reports its peak memory; each report gets one judgement:

* the peak overflows the device budget (and ran under no limit): shrink the batch in proportion,
  re-plan, and probe again at the smaller batch, at most ``max_rounds`` times (then fail);
* iterative estimation (S2.2c): run trials under a raised limit until utilisation is at most the
  target;
* else accept: every worker is sized from the peak by the estimate policy (S2.2).

Plain and not thread-safe: the ``Job`` calls it only with its lock held, and applies the
judgement (a new plan and spec, the state change) itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pstrain.coordinator.errors import ProbeFailed
from pstrain.coordinator.plan import Plan
from pstrain.planner.memory_estimate import (
    EstimateMode,
    EstimatePolicy,
    IterativeEstimate,
    Probe,
    estimate,
    shrunk_batch,
)
from pstrain.protos import pstrain_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeSetup:
    """What the coordinator needs to judge the master's probe (S2.1-S2.3)."""

    device_bytes: int | None  # None: no budget known, any peak is accepted
    margin: float
    policy: EstimatePolicy
    replan: Callable[[int], tuple[Plan, pb.JobSpec]]  # a smaller batch -> its plan and spec
    max_rounds: int = 4


@dataclass(frozen=True)
class ProbeReport:
    """One probe iteration as a worker measured it."""

    worker_id: int
    probe: Probe


@dataclass(frozen=True)
class Judgement:
    """What one probe report decides; ``replanned`` is set when the batch shrank."""

    done: bool
    limit_bytes: int  # run the next probe under this device-memory cap (0: none)
    message: str
    replanned: tuple[Plan, pb.JobSpec] | None = None


@dataclass(frozen=True)
class ProbeOutcome:
    """The job's answer to a probe report: train now, or probe again with ``spec``."""

    done: bool
    spec: pb.JobSpec
    limit_bytes: int
    message: str


class ProbeSession:
    def __init__(self, setup: ProbeSetup) -> None:
        self.setup = setup
        self.done = False
        self.rounds = 0  # probes that overflowed the device
        self.worker_device_bytes = 0  # S2.2 estimates, once accepted
        self.worker_host_bytes = 0
        self._iterative: IterativeEstimate | None = None

    def judge(self, probe: Probe) -> Judgement:
        """Shrink and re-plan, run an iterative trial, or accept; raise ``ProbeFailed`` after too many rounds."""
        if self.done:
            raise ProbeFailed("the probe was already accepted")
        setup = self.setup
        log.info(
            "probe at batch %d: device peak %d B, host peak %d B",
            probe.batch,
            probe.device_peak_bytes,
            probe.host_peak_bytes,
        )
        if probe.limit_bytes == 0 and setup.device_bytes and probe.device_peak_bytes > setup.device_bytes:
            self.rounds += 1
            if self.rounds >= setup.max_rounds:
                raise ProbeFailed(
                    f"batch {probe.batch} still needs {probe.device_peak_bytes} B of {setup.device_bytes} "
                    f"after {self.rounds} probes; lower batch.per_device"
                )
            batch = shrunk_batch(probe.batch, probe.device_peak_bytes, setup.device_bytes, setup.margin)
            message = f"peak {probe.device_peak_bytes} B exceeds {setup.device_bytes} B: probing again at batch {batch}"
            log.warning("%s", message)
            return Judgement(False, 0, message, replanned=setup.replan(batch))
        if setup.policy.mode == EstimateMode.ITERATIVE:
            if self._iterative is None:
                self._iterative = IterativeEstimate(setup.policy, probe.device_peak_bytes)
                self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
                return Judgement(False, self._iterative.limit, "trial under a limit")
            following = self._iterative.next_limit(probe)
            if following is not None:
                return Judgement(False, following, f"utilisation {probe.utilization:.0%}: raise")
            self.worker_device_bytes = self._iterative.limit
        else:
            self.worker_device_bytes = estimate(setup.policy, probe.device_peak_bytes)
            self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
        self.done = True
        return Judgement(True, 0, "accepted")
