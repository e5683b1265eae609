"""The probe session (S2.1-S2.3): judge the master worker's measured iteration, one report at a time.

Worker 0 runs one real iteration and reports its peak memory; each report gets one judgement:

* the first report carries the master's per-layer profile measured on its device (issue 10): the
  plan is re-made from it (``adopt``); if that changes the batch or a layer's policy, the iteration
  just measured ran under the old plan, so the master probes again under the new one;
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
from dataclasses import dataclass, field, replace

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
from pstrain.planner.profiler import ModelProfile
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
    # issue 10: the master's device profile -> its plan, spec and device budget (None: nothing to plan with)
    adopt: Callable[[ModelProfile, int], tuple[Plan, pb.JobSpec, int | None] | None] | None = None
    policies: dict[str, str] = field(default_factory=dict)  # the initial plan's layer policies


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
        self.device_bytes = setup.device_bytes
        self.policies = dict(setup.policies)
        self.profile_source = ""  # where the plan's profile was measured, once the master's is adopted

    def judge(self, probe: Probe) -> Judgement:
        """Re-plan from the master's profile, shrink and re-plan, run an iterative trial, or accept.

        Raises ``ProbeFailed`` after too many rounds.
        """
        if self.done:
            raise ProbeFailed("the probe was already accepted")
        adopted: tuple[Plan, pb.JobSpec] | None = None
        if probe.profile is not None and self.setup.adopt is not None and not self.profile_source:
            made = self.setup.adopt(probe.profile, 0)
            if made is not None:
                plan, spec, self.device_bytes = made
                self.profile_source = spec.memory_profile
                adopted = (plan, spec)
                policies = dict(spec.layer_policies)
                if (spec.per_device_batch, policies) != (probe.batch, self.policies):
                    self.policies = policies
                    message = (
                        f"re-planned from the {self.profile_source} profile: batch {spec.per_device_batch}, "
                        f"{len(policies)} layer(s) swapped or recomputed; probing again"
                    )
                    log.info("%s", message)
                    return Judgement(False, 0, message, replanned=adopted)
        judgement = self._judge_peak(probe)
        if adopted is not None and judgement.replanned is None:  # the spec now names the profile it came from
            judgement = replace(judgement, replanned=adopted)
        if judgement.replanned is not None:
            self.policies = dict(judgement.replanned[1].layer_policies)
        return judgement

    def _judge_peak(self, probe: Probe) -> Judgement:
        setup = replace(self.setup, device_bytes=self.device_bytes)
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
