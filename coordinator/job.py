"""The job: who is in it, where training stands, and when it is over.

States (``JobState``)::

    WAITING --every PS shard ready and worker 0 registered, probe on--> PROBING
    PROBING --the probe fits (batch shrunk and re-planned until it does)--> WAITING
    WAITING --every PS shard ready, every worker registered, probe done or off--> RUNNING
    RUNNING --every worker reported the last step--> EXPORTING
    EXPORTING --model.pt written--> FINISHED
    any --a member silent past the heartbeat timeout, or the export failed--> FAILED

Once FINISHED or FAILED, every heartbeat and step report answers "stop". ``Job`` is the state
machine, a façade over the parts that do the work:

* ``Membership`` (membership.py): PS shards and workers by role, registration, heartbeats, liveness;
* ``ProbeSession`` (probe.py): judges the master worker's probe (S2.1-S2.3);
* ``StepLedger`` (ledger.py): step reports, one record per step, metrics.jsonl, ``watch``;
* ``ModelExport`` (export.py): waits for the buffers, pulls the final parameters, writes model.pt;
* ``DataShardTracker`` (data_shards.py): which samples each worker trains on.

Locking: one condition, ``Job._cond`` (over a re-entrant lock), guards the state and every part.
``Membership`` and ``ProbeSession`` are plain objects the Job calls with it held; ``StepLedger``
and ``ModelExport`` share the same condition to wait on it. With one lock there is no lock
order. The ``DataShardTracker`` keeps its own leaf lock and is called with the condition
released. Everything here is plain Python (no gRPC, no protobuf messages in or out: the
servicer converts), so the protocol is tested without a network; the clock is injected.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pstrain.coordinator.checkpoints import CheckpointLedger
from pstrain.coordinator.data_shards import DataShardAssignment, DataShardCounts, DataShardTracker
from pstrain.coordinator.errors import InvalidRequest, ProbeFailed, WrongState
from pstrain.coordinator.export import ModelExport, PullFinal
from pstrain.coordinator.ledger import Progress, StepLedger, StepRecord, StepReport
from pstrain.coordinator.membership import Membership, MemberView
from pstrain.coordinator.memory_forecast import RECENT_STEPS, PsMemoryForecast, expected_end_s
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import Plan
from pstrain.coordinator.probe import ProbeOutcome, ProbeReport, ProbeSession, ProbeSetup
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.shard_map import ShardRange, shard_ranges

log = logging.getLogger(__name__)


class JobState(enum.IntEnum):
    """The job's states; the values are the wire enum's, so ``int(state)`` is what clients see."""

    WAITING = pb.WAITING
    PROBING = pb.PROBING
    RUNNING = pb.RUNNING
    EXPORTING = pb.EXPORTING
    FINISHED = pb.FINISHED
    FAILED = pb.FAILED

    @property
    def over(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED)


@dataclass(frozen=True)
class Directive:
    """The answer to a heartbeat or step report: go on, or stop (and why)."""

    stop: bool
    state: JobState
    reason: str
    retryable: bool = False  # FAILED, and restarting the cluster from the last checkpoint may succeed


@dataclass(frozen=True)
class ClusterView:
    """What a member waits for before it trains: the PS shards' addresses and the final spec."""

    ps_addresses: list[str]  # in PS shard order
    spec: pb.JobSpec  # the opaque payload every member trains by
    state: JobState
    probe: bool  # this worker (worker 0) must probe one iteration first


@dataclass(frozen=True)
class JobStatusView:
    job_id: str
    state: JobState
    step: int  # steps completed by every worker
    steps: int
    per_device_batch: int
    global_batch: int
    lr: float
    global_lr: float  # scaled learning rate of the plan (after warmup)
    members: list[MemberView]
    data_shards: DataShardCounts
    message: str
    metrics_address: str
    worker_device_memory_bytes: int  # S2.2 estimates, 0 before the probe is accepted
    worker_host_memory_bytes: int
    skipped_steps: int = 0  # steps completed without an update (a non-finite loss or gradient, on_nonfinite: skip)
    ps_memory_forecast_bytes: int = 0  # S2.4: the largest PS shard's memory at the job's end, 0 while unknown
    ps_memory_trend: str = "unknown"  # plateau | growing | unknown
    checkpoint_step: int = -1  # the newest committed checkpoint, -1 if none


class Job:
    def __init__(
        self,
        job_id: str,
        plan: Plan,
        spec: pb.JobSpec,
        model: ModelState,
        data_shards: DataShardTracker,
        out_dir: Path | None,
        pull_final: PullFinal,
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        probe: ProbeSetup | None = None,
        start_step: int = 0,
        checkpoints: CheckpointLedger | None = None,
    ) -> None:
        if not 0 <= start_step < plan.steps:
            raise ValueError(f"start step {start_step} is outside the job's steps 0..{plan.steps - 1}")
        self.job_id = job_id
        self.failure_retryable = True  # meaningful once FAILED: would a restart help?
        self.resume_step = start_step  # > 0: PS shards load this committed checkpoint instead of the initial weights
        self._checkpoints = checkpoints
        self.plan = plan
        self.spec = spec
        self.model = model
        self.data_shards = data_shards
        self.out_dir = out_dir
        self.shard_ranges: list[ShardRange] = shard_ranges(spec.total_params, spec.ps_shards)
        self.state = JobState.WAITING
        self.message = "waiting for members"
        self.metrics_address = ""  # set by the process that serves the job
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self.membership = Membership(
            job_id, len(self.shard_ranges), plan.workers, plan.devices_per_worker, heartbeat_timeout_s, clock
        )
        self._probe = ProbeSession(probe) if probe is not None else None
        self.ledger = StepLedger(
            plan.workers,
            lambda step: self.plan.lr_at(step),
            out_dir / "metrics.jsonl" if out_dir is not None else None,
            clock,
            self._cond,
            start_step,
        )
        self.export = ModelExport(model, out_dir, pull_final, heartbeat_timeout_s, self._cond)

    # ------------------------------------------------------------------ membership

    def register_ps(self, shard_id: int, address: str, metrics_address: str = "") -> ShardRange:
        with self._cond:
            self._check_not_over()
            if self.state != JobState.WAITING and self.membership.restarted_ps(shard_id, address):
                self._roll_back(f"PS shard {shard_id} restarted at {address} and lost its state")
            self.membership.register_ps(shard_id, address, metrics_address)
            return self.shard_ranges[shard_id]

    def initial_parameters(self, shard_id: int) -> torch.Tensor:
        with self._cond:
            self.membership.ps(shard_id)
            r = self.shard_ranges[shard_id]
        return self.model.initial_range(r.start, r.end)

    def checkpoint_written(self, shard_id: int, step: int) -> None:
        """A shard's checkpoint of ``step`` is durable; the last shard to confirm commits it."""
        with self._cond:
            self.membership.ps(shard_id)
            if self._checkpoints is None:
                raise WrongState(f"job {self.job_id} takes no checkpoints (checkpoint.every_steps is 0 or no dir)")
            if not 0 < step <= self.plan.steps:
                raise InvalidRequest(f"checkpoint step {step} is outside this job's steps 1..{self.plan.steps}")
        self._checkpoints.confirm(shard_id, step)
        if self._checkpoints.commit(self.ledger.completed) is not None:  # file I/O: outside the job's lock
            with self._cond:
                self._cond.notify_all()

    @property
    def checkpoint_step(self) -> int:
        """The newest committed checkpoint, -1 if none."""
        return self._checkpoints.last_committed if self._checkpoints is not None else -1

    def ps_ready(self, shard_id: int) -> None:
        with self._cond:
            self.membership.ps_ready(shard_id)
            self._maybe_start()

    def register_worker(self, address: str, devices: list[str], hostname: str, metrics_address: str = "") -> int:
        with self._cond:
            self._check_not_over()
            restarted = self.membership.restarted_worker(address, hostname) if self.state != JobState.WAITING else None
            if restarted is not None:
                self._roll_back(f"worker {restarted} on host {hostname} restarted")
            member = self.membership.register_worker(address, devices, hostname, metrics_address)
            self._maybe_start()
            return member.id

    @property
    def probe_done(self) -> bool:
        return self._probe is None or self._probe.done

    def _maybe_start(self) -> None:
        ps_ready = self.membership.all_ps_ready()
        if self.state == JobState.WAITING and ps_ready and not self.probe_done and self.membership.has_worker(0):
            self.state = JobState.PROBING
            self.message = "worker 0 is probing one iteration"
            log.info("PS ready: worker 0 probes one iteration at batch %d", self.plan.per_device_batch)
        if (
            self.state == JobState.WAITING
            and ps_ready
            and self.probe_done
            and self.membership.worker_count == self.plan.workers
        ):
            self.state = JobState.RUNNING
            self.message = "training"
            self.ledger.start()
            log.info("all members ready: %s", self.plan.describe())
        self._cond.notify_all()

    def wait_for_cluster(self, timeout_s: float, worker_id: int = -1) -> ClusterView:
        """Block until every PS shard serves and the spec is final (the probe is done).

        Worker 0 is let through while the job is PROBING: it must probe first (``probe``).
        """
        deadline = time.monotonic() + timeout_s  # a real wait: the injected clock is for liveness
        with self._cond:
            while True:
                self._check_not_over()
                probing_master = worker_id == 0 and self.state == JobState.PROBING
                if self.membership.all_ps_ready() and (self.probe_done or probing_master):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = self.membership.missing_ps()
                    raise WrongState(f"PS shards {missing} are not ready yet" if missing else "the probe is not done")
                self._cond.wait(min(remaining, 1.0))
            return ClusterView(self.membership.ps_addresses(), self.spec, self.state, probing_master)

    # ------------------------------------------------------------------ the probe (S2.1-S2.3)

    def report_probe(self, report: ProbeReport) -> ProbeOutcome:
        """Judge the master's probe: shrink and re-plan, run an iterative trial, or accept."""
        with self._cond:
            if report.worker_id != 0 or self.state != JobState.PROBING or self._probe is None:
                raise WrongState(f"no probe expected from worker {report.worker_id} while the job is {self.state.name}")
            try:
                judgement = self._probe.judge(report.probe)
            except ProbeFailed as exc:
                self.fail(str(exc), retryable=False)
                raise
            if judgement.replanned is not None:
                self.plan, self.spec = judgement.replanned
            if judgement.done:
                self.state = JobState.WAITING
                self.message = "waiting for members"
                log.info(
                    "probe accepted at batch %d: each worker needs about %d B of device and %d B of host memory",
                    self.plan.per_device_batch,
                    self._probe.worker_device_bytes,
                    self._probe.worker_host_bytes,
                )
                self._maybe_start()
            return ProbeOutcome(judgement.done, self.spec, judgement.limit_bytes, judgement.message)

    @property
    def worker_device_bytes(self) -> int:
        """S2.2's estimate of the device memory each worker needs; 0 before (or without) the probe."""
        return self._probe.worker_device_bytes if self._probe is not None else 0

    @property
    def worker_host_bytes(self) -> int:
        return self._probe.worker_host_bytes if self._probe is not None else 0

    # ------------------------------------------------------------------ data shards

    def request_data_shard(self, worker_id: int) -> DataShardAssignment:
        with self._cond:
            self.membership.worker(worker_id)
            self._check_not_over()
        return self.data_shards.dispatch(worker_id)

    def complete_data_shard(self, worker_id: int, data_shard_id: int) -> None:
        with self._cond:
            self.membership.worker(worker_id)
        self.data_shards.complete(worker_id, data_shard_id)

    # ------------------------------------------------------------------ steps and export

    def report_step(self, report: StepReport) -> Directive:
        directive, completed = self._record_step(report)
        if self._checkpoints is not None and completed is not None:
            self._checkpoints.commit(completed)  # a checkpoint waiting for this step's record; outside the lock
        return directive

    def _record_step(self, report: StepReport) -> tuple[Directive, int | None]:
        """Take the report; returns the directive and, when the report completed a step, the step count."""
        with self._cond:
            worker = self.membership.worker(report.worker_id)
            worker.last_seen = self._clock()
            if not 0 <= report.step < self.plan.steps:
                raise InvalidRequest(f"step {report.step} is outside this job's steps 0..{self.plan.steps - 1}")
            if self.state.over:
                return self._directive(), None
            if self.state != JobState.RUNNING:
                raise WrongState(f"job is {self.state.name}; step reports are accepted while RUNNING")
            if report.nonfinite and self.spec.on_nonfinite != "skip":
                self.fail(
                    f"worker {report.worker_id} computed a non-finite loss or gradient at step {report.step}; "
                    "fault.on_nonfinite: stop",
                    retryable=False,
                )
                return self._directive(), None
            record = self.ledger.add(report)
            if record is not None and record.step == self.plan.steps - 1:
                self.state = JobState.EXPORTING
                self.message = "exporting the trained model"
                addresses = self.membership.ps_addresses()
                threading.Thread(target=self._run_export, args=(addresses,), name="export", daemon=True).start()
                self._cond.notify_all()
            if report.step == self.plan.steps - 1:
                worker.done = True
            return self._directive(), (self.ledger.completed if record is not None else None)

    @property
    def records(self) -> list[StepRecord]:
        return self.ledger.records

    def upload_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        self.export.upload_buffers(buffers)

    def _run_export(self, addresses: list[str]) -> None:
        try:
            self.export.run(addresses, self.plan.steps)
        except Exception as exc:  # noqa: BLE001 - any export failure fails the job, with its reason
            log.exception("export failed")
            self.fail(f"export of the trained model failed: {exc}")
            return
        with self._cond:
            self.state = JobState.FINISHED
            self.message = "finished"
            self._cond.notify_all()
        log.info("job finished after %d steps", self.plan.steps)

    def watch(self, from_step: int, active: Callable[[], bool]) -> Iterator[Progress]:
        """Records from ``from_step`` as they complete, then one ``Progress`` without a record: the final state."""
        return self.ledger.watch(from_step, active, lambda: (self.state, self.message))

    # ------------------------------------------------------------------ liveness and the end

    def heartbeat(self, role: str, member_id: int, rss_bytes: int = 0) -> Directive:
        with self._cond:
            member = self.membership.heard_from(role, member_id, rss_bytes)
            directive = self._directive()
            if directive.stop:
                member.done = True
                self._cond.notify_all()
            return directive

    def check_liveness(self) -> None:
        """Fail the job when a member that still has work went silent (recovery comes later)."""
        with self._cond:
            if self.state.over:
                return
            reason = self.membership.silent()
            if reason is not None:
                self.fail(reason)

    def alive_count(self, role: str) -> int:
        with self._cond:
            return self.membership.alive_count(role)

    def _roll_back(self, reason: str) -> None:
        """A member restarted mid-job: fail the job retryably, so every member exits 1 and the
        service manager restarts the cluster, which resumes from the last committed checkpoint."""
        self.fail(f"{reason}; the cluster restarts from the last committed checkpoint")
        raise WrongState(self.message)

    def fail(self, reason: str, retryable: bool = True) -> None:
        """End the job as FAILED; ``retryable`` False when a restart would fail the same way."""
        with self._cond:
            if self.state.over:
                return
            self.state = JobState.FAILED
            self.message = reason
            self.failure_retryable = retryable
            log.error("job failed: %s", reason)
            self._cond.notify_all()

    def wait_over(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.state.over, timeout_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait until every PS shard was told to stop (it heartbeat after the job ended) and, after a
        finished job, its final checkpoint is committed (so running the job again starts anew)."""

        def stopped() -> bool:
            final = self._checkpoints is None or self.state != JobState.FINISHED
            return self.membership.all_ps_done() and (final or self.checkpoint_step >= self.plan.steps)

        with self._cond:
            return self._cond.wait_for(stopped, timeout_s)

    def ps_memory_forecast(self) -> PsMemoryForecast:
        """S2.4: the PS shards' memory at the job's end, from their heartbeats' RSS and the recent step rate."""
        with self._cond:
            recent = [r.step_s for r in self.ledger.records[-RECENT_STEPS:]]
            end_s = expected_end_s(self._clock(), self.ledger.completed, self.plan.steps, recent)
            return self.membership.ps_memory(end_s)

    def status(self) -> JobStatusView:
        counts = self.data_shards.counts()
        with self._cond:
            step = self.ledger.completed
            memory = self.ps_memory_forecast()
            return JobStatusView(
                job_id=self.job_id,
                state=self.state,
                step=step,
                steps=self.plan.steps,
                per_device_batch=self.plan.per_device_batch,
                global_batch=self.plan.global_batch,
                lr=self.plan.lr_at(min(step, self.plan.steps - 1)),
                global_lr=self.plan.scaled_lr,
                members=self.membership.views(),
                data_shards=counts,
                message=self.message,
                metrics_address=self.metrics_address,
                worker_device_memory_bytes=self.worker_device_bytes,
                worker_host_memory_bytes=self.worker_host_bytes,
                skipped_steps=self.ledger.skipped_steps,
                ps_memory_forecast_bytes=memory.bytes,
                ps_memory_trend=memory.trend.value,
                checkpoint_step=self.checkpoint_step,
            )

    def close(self) -> None:
        self.ledger.close()

    # ------------------------------------------------------------------ helpers

    def _check_not_over(self) -> None:
        if self.state.over:
            raise WrongState(f"job {self.job_id} is {self.state.name}: {self.message}")

    def _directive(self) -> Directive:
        retryable = self.state == JobState.FAILED and self.failure_retryable
        return Directive(stop=self.state.over, state=self.state, reason=self.message, retryable=retryable)
