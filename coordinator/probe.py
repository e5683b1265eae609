"""The probe session (S2.1-S2.3): judge the master worker's measured iteration, one report at a time.

Worker 0 runs one real iteration and reports its peak memory; each report gets one judgement:

* the first report carries the master's per-layer profile measured on its device (issue 10): the
  plan is re-made from it (``adopt``); if that changes the batch or a layer's policy, the iteration
  just measured ran under the old plan, so the master probes again under the new one;
* the peak overflows the device budget (and ran under no limit): shrink the batch in proportion,
  re-plan, and probe again at the smaller batch, at most ``max_rounds`` times (the next overflow
  fails the job, as does one at batch 1, which cannot shrink);
* iterative estimation (S2.2c): run trials under a raised limit until utilisation is at most the
  target, the limit never past the device's memory;
* else accept: every worker is sized from the peak by the estimate policy (S2.2).

A report is first checked against what the session asked for: the batch the last verdict's spec
named (``ProbeSetup.batch`` for the first report), the limit the last verdict set (0 at first and
after every re-plan), non-negative peaks. A report that does not match measured something else
(a stale or foreign worker, a bug), so it is refused with ``InvalidRequest`` before anything
changes: the next correct report is judged as if the refused one had never come.

Plain and not thread-safe: the ``Job`` calls it only with its lock held, and applies the
judgement (a new plan and spec, the state change) itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pstrain.coordinator.errors import InvalidRequest, ProbeFailed
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
    max_rounds: int = 4  # memory.max_probe_rounds: how often the batch may shrink before the job fails
    # issue 10: the master's device profile -> its plan, spec and device budget (None: nothing to plan with)
    adopt: Callable[[ModelProfile, int], tuple[Plan, pb.JobSpec, int | None] | None] | None = None
    policies: dict[str, str] = field(default_factory=dict)  # the initial plan's layer policies
    batch: int = 0  # the initial plan's per-device batch, the first probe's (0: not known, any batch >= 1)


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
        self.rounds = 0  # probes that overflowed the device (each shrank the batch, but the last)
        self.worker_device_bytes = 0  # S2.2 estimates, once accepted
        self.worker_host_bytes = 0
        self._iterative: IterativeEstimate | None = None
        self.device_bytes = setup.device_bytes
        self.policies = dict(setup.policies)
        self.profile_source = ""  # where the plan's profile was measured, once the master's is adopted
        self.reported_device_bytes = 0  # the master's device's memory, from its profile (0: not reported)
        self.expected_batch = setup.batch  # the batch the next report must have run at (0: any)
        self.expected_limit = 0  # the limit the next report must have run under (0: none)

    def check(self, probe: Probe) -> None:
        """Refuse a report that is not the iteration the session asked for, before it changes anything.

        Raises ``InvalidRequest`` naming the field, what it holds and what was expected.
        """
        if probe.batch < 1:
            raise InvalidRequest(f"probe report: per_device_batch must be at least 1, got {probe.batch}")
        if self.expected_batch and probe.batch != self.expected_batch:
            raise InvalidRequest(
                f"probe report: per_device_batch {probe.batch} is not {self.expected_batch}, the batch the "
                "coordinator asked the master to probe; run the probe at the last verdict's job.per_device_batch"
            )
        for name, value in (("device_peak_bytes", probe.device_peak_bytes), ("host_peak_bytes", probe.host_peak_bytes)):
            if value < 0:
                raise InvalidRequest(f"probe report: {name} must be non-negative, got {value}")
        if probe.limit_bytes < 0:
            raise InvalidRequest(f"probe report: limit_bytes must be non-negative, got {probe.limit_bytes}")
        if probe.limit_bytes != self.expected_limit:
            raise InvalidRequest(
                f"probe report: limit_bytes {probe.limit_bytes} is not {self.expected_limit}, the limit the last "
                "verdict set (0: none); run the probe under the last verdict's limit_bytes"
            )

    def judge(self, probe: Probe) -> Judgement:
        """Re-plan from the master's profile, shrink and re-plan, run an iterative trial, or accept.

        Raises ``InvalidRequest`` for a report that is not the one asked for (``check``) or carries a
        malformed profile, changing nothing; ``ProbeFailed`` after too many rounds.
        """
        if self.done:
            raise ProbeFailed("the probe was already accepted")
        self.check(probe)
        judgement = self._judge(probe)
        self.expected_batch = judgement.replanned[1].per_device_batch if judgement.replanned else probe.batch
        self.expected_limit = judgement.limit_bytes
        return judgement

    def _judge(self, probe: Probe) -> Judgement:
        adopted = self._adopt(probe)  # a malformed profile raises here, before anything changed
        if probe.profile is not None and probe.profile.device_total_bytes > 0:
            self.reported_device_bytes = probe.profile.device_total_bytes
        if adopted is not None:
            spec = adopted[1]
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

    def _adopt(self, probe: Probe) -> tuple[Plan, pb.JobSpec] | None:
        """The plan re-made from the master's first device profile (issue 10); None when there is none."""
        if probe.profile is None or self.setup.adopt is None or self.profile_source:
            return None
        made = self.setup.adopt(probe.profile, 0)
        if made is None:
            return None
        plan, spec, self.device_bytes = made
        self.profile_source = spec.memory_profile
        return plan, spec

    def _judge_peak(self, probe: Probe) -> Judgement:
        setup = replace(self.setup, device_bytes=self.device_bytes)
        log.info(
            "probe at batch %d: device peak %d B, host peak %d B",
            probe.batch,
            probe.device_peak_bytes,
            probe.host_peak_bytes,
        )
        if probe.limit_bytes == 0 and setup.device_bytes and probe.device_peak_bytes > setup.device_bytes:
            return self._shrink(probe, setup.device_bytes)
        if setup.policy.mode == EstimateMode.ITERATIVE:
            if self._iterative is None:
                self._iterative = IterativeEstimate(setup.policy, probe.device_peak_bytes, self._device_cap())
                self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
                if not self._iterative.capped:
                    return Judgement(False, self._iterative.limit, "trial under a limit")
                self._iterative.warn_capped(probe.device_peak_bytes)  # the first probe ran on the whole device
                return self._accept(self._iterative.limit)
            following = self._iterative.next_limit(probe)
            if following is not None:
                return Judgement(False, following, f"utilisation {probe.utilization:.0%}: raise")
            return self._accept(self._iterative.limit)
        self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
        return self._accept(estimate(setup.policy, probe.device_peak_bytes))

    def _accept(self, worker_device_bytes: int) -> Judgement:
        self.worker_device_bytes = worker_device_bytes
        self.done = True
        return Judgement(True, 0, "accepted")

    def _shrink(self, probe: Probe, device_bytes: int) -> Judgement:
        """The peak overflowed the device: re-plan at a smaller batch, or fail once no shrink is left.

        ``max_rounds`` shrinks are allowed (README: the master probes again at most that often), so the
        job fails at the overflow after the last of them; at batch 1 there is nothing to shrink and probing
        again would only repeat the same iteration.
        """
        setup = self.setup
        self.rounds += 1
        needs = f"batch {probe.batch} still needs {probe.device_peak_bytes} B of {device_bytes} B"
        if probe.batch <= 1:
            raise ProbeFailed(
                f"{needs} after {self.rounds} probes: not even one sample per device fits; use a device with "
                "more memory, memory.policy: auto (swap/recompute) or memory.offload_params: true"
            )
        if self.rounds > setup.max_rounds:
            raise ProbeFailed(
                f"{needs} after {self.rounds} probes, the batch shrunk {setup.max_rounds} time(s) "
                f"(memory.max_probe_rounds: {setup.max_rounds}); "
                "lower batch.per_device or raise memory.max_probe_rounds"
            )
        batch = shrunk_batch(probe.batch, probe.device_peak_bytes, device_bytes, setup.margin)
        message = f"peak {probe.device_peak_bytes} B exceeds {device_bytes} B: probing again at batch {batch}"
        log.warning("%s", message)
        return Judgement(False, 0, message, replanned=setup.replan(batch))

    def _device_cap(self) -> int | None:
        """The device's memory, the most an iterative limit may be: the smaller of the budget's and the
        master's reported device (a budget set larger than the real GPU would let the limit pass it)."""
        known = [b for b in (self.device_bytes, self.reported_device_bytes) if b]
        return min(known) if known else None
