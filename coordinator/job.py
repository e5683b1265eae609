"""The job: who is in it, where training stands, and when it is over.

States (``JobState``)::

    WAITING --every PS shard ready and worker 0 registered, probe on--> PROBING
    PROBING --the probe fits (batch shrunk and re-planned until it does)--> WAITING
    WAITING --every PS shard ready, every worker registered, probe done or off--> RUNNING
    RUNNING --every worker reported the last step--> EXPORTING
    EXPORTING --model.pt written--> FINISHED
    any --a member silent past the heartbeat timeout, or the export failed--> FAILED

Once FINISHED or FAILED, every heartbeat and step report answers "stop". The object is
plain Python (no gRPC) so the protocol is tested without a network; the clock is injected.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pstrain.coordinator.data_shards import DataShardAssignment, DataShardTracker
from pstrain.coordinator.errors import AlreadyRegistered, InvalidRequest, NoFreeSlot, UnknownMember, WrongState
from pstrain.planner.memory_estimate import (
    EstimateMode,
    EstimatePolicy,
    IterativeEstimate,
    Probe,
    estimate,
    shrunk_batch,
)
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import Plan
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.shard_map import ShardRange, shard_ranges

log = logging.getLogger(__name__)

Exporter = Callable[[list[str], int], torch.Tensor]
"""Pull the final parameters: (PS addresses, version) -> flat vector."""


class JobState(enum.IntEnum):
    WAITING = pb.WAITING
    PROBING = pb.PROBING
    RUNNING = pb.RUNNING
    EXPORTING = pb.EXPORTING
    FINISHED = pb.FINISHED
    FAILED = pb.FAILED

    @property
    def over(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED)


@dataclass
class Member:
    role: str  # "ps" | "worker"
    id: int
    address: str
    last_seen: float
    ready: bool = False
    done: bool = False  # a worker past its last step, a PS told to stop
    hostname: str = ""
    metrics_address: str = ""


@dataclass(frozen=True)
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    loss: float
    lr: float
    global_batch: int
    samples_per_s: float
    step_s: float


@dataclass(frozen=True)
class ProbeSetup:
    """What the coordinator needs to judge the master's probe (S2.1-S2.3)."""

    device_bytes: int | None  # None: no budget known, any peak is accepted
    margin: float
    policy: EstimatePolicy
    replan: Callable[[int], tuple[Plan, pb.JobSpec]]  # a smaller batch -> its plan and spec
    max_rounds: int = 4


@dataclass(frozen=True)
class ProbeOutcome:
    done: bool
    spec: pb.JobSpec
    limit_bytes: int
    message: str


@dataclass(frozen=True)
class Directive:
    stop: bool
    state: JobState
    reason: str


class Job:
    def __init__(
        self,
        job_id: str,
        plan: Plan,
        spec: pb.JobSpec,
        model: ModelState,
        shards: DataShardTracker,
        out_dir: Path | None,
        exporter: Exporter,
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        probe: ProbeSetup | None = None,
    ) -> None:
        self.job_id = job_id
        self.plan = plan
        self.spec = spec
        self.model = model
        self.shards = shards
        self.out_dir = out_dir
        self._exporter = exporter
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self.ranges: list[ShardRange] = shard_ranges(spec.total_params, spec.ps_shards)
        self.state = JobState.WAITING
        self.message = "waiting for members"
        self.metrics_address = ""  # set by the process that serves the job
        self._probe = probe
        self._probe_done = probe is None
        self._probe_rounds = 0
        self._iterative: IterativeEstimate | None = None
        self.worker_device_bytes = 0  # S2.2 estimates, once the probe is accepted
        self.worker_host_bytes = 0
        self._ps: dict[int, Member] = {}
        self._workers: dict[int, Member] = {}
        self._reports: dict[int, dict[int, pb.StepReport]] = {}
        self.records: list[StepRecord] = []
        self._last_completion: float | None = None
        self._buffers: dict[str, torch.Tensor] | None = None
        self._cond = threading.Condition()
        self._metrics = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(out_dir / "metrics.jsonl", "w", buffering=1)  # noqa: SIM115 - closed in close()

    # ------------------------------------------------------------------ membership

    def register_ps(self, shard_id: int, address: str, metrics_address: str = "") -> ShardRange:
        with self._cond:
            self._check_not_over()
            if not 0 <= shard_id < len(self.ranges):
                raise InvalidRequest(f"shard id {shard_id} out of range: this job has shards 0..{len(self.ranges) - 1}")
            existing = self._ps.get(shard_id)
            if existing and existing.address != address and self._alive(existing):
                raise AlreadyRegistered(f"shard {shard_id} is already served by {existing.address}")
            self._ps[shard_id] = Member("ps", shard_id, address, self._clock(), metrics_address=metrics_address)
            log.info("PS shard %d registered at %s", shard_id, address)
            return self.ranges[shard_id]

    def initial_parameters(self, shard_id: int) -> torch.Tensor:
        with self._cond:
            if shard_id not in self._ps:
                raise UnknownMember(f"shard {shard_id} must register before fetching its parameters")
            r = self.ranges[shard_id]
        return self.model.initial_range(r.start, r.end)

    def ps_ready(self, shard_id: int) -> None:
        with self._cond:
            member = self._ps.get(shard_id)
            if member is None:
                raise UnknownMember(f"shard {shard_id} never registered")
            member.ready = True
            member.last_seen = self._clock()
            self._maybe_start()

    def register_worker(self, address: str, devices: list[str], hostname: str, metrics_address: str = "") -> int:
        with self._cond:
            self._check_not_over()
            if devices and len(devices) != self.plan.devices_per_worker:
                raise InvalidRequest(
                    f"worker offers {len(devices)} devices but the plan needs {self.plan.devices_per_worker} "
                    f"per worker (cluster.devices_per_worker)"
                )
            if len(self._workers) >= self.plan.workers:
                raise NoFreeSlot(f"all {self.plan.workers} worker slots of job {self.job_id} are taken")
            worker_id = len(self._workers)
            self._workers[worker_id] = Member(
                "worker",
                worker_id,
                address,
                self._clock(),
                ready=True,
                hostname=hostname,
                metrics_address=metrics_address,
            )
            log.info("worker %d registered from %s (%s)", worker_id, hostname, address)
            self._maybe_start()
            return worker_id

    def _ps_ready(self) -> bool:
        return len(self._ps) == len(self.ranges) and all(m.ready for m in self._ps.values())

    def _maybe_start(self) -> None:
        ps_ready = self._ps_ready()
        if self.state == JobState.WAITING and ps_ready and not self._probe_done and 0 in self._workers:
            self.state = JobState.PROBING
            self.message = "worker 0 is probing one iteration"
            log.info("PS ready: worker 0 probes one iteration at batch %d", self.plan.per_device_batch)
        if self.state == JobState.WAITING and ps_ready and self._probe_done and len(self._workers) == self.plan.workers:
            self.state = JobState.RUNNING
            self.message = "training"
            self._last_completion = self._clock()
            log.info("all members ready: %s", self.plan.describe())
        self._cond.notify_all()

    def wait_for_cluster(self, timeout_s: float, worker_id: int = -1) -> tuple[list[str], pb.JobSpec, bool]:
        """Block until every PS shard serves and the spec is final (the probe is done).

        Returns the PS addresses in shard order, the spec, and whether this worker must probe
        first (worker 0 while the job is PROBING).
        """
        deadline = time.monotonic() + timeout_s  # a real wait: the injected clock is for liveness
        with self._cond:
            while True:
                self._check_not_over()
                probing_master = worker_id == 0 and self.state == JobState.PROBING
                if self._ps_ready() and (self._probe_done or probing_master):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [i for i in range(len(self.ranges)) if not (i in self._ps and self._ps[i].ready)]
                    raise WrongState(f"PS shards {missing} are not ready yet" if missing else "the probe is not done")
                self._cond.wait(min(remaining, 1.0))
            addresses = [self._ps[i].address for i in range(len(self.ranges))]
            return addresses, self.spec, probing_master

    def report_probe(self, report: pb.ProbeReport) -> ProbeOutcome:
        """Judge the master's probe: shrink and re-plan, run an iterative trial, or accept."""
        with self._cond:
            if report.worker_id != 0 or self.state != JobState.PROBING or self._probe is None:
                raise WrongState(f"no probe expected from worker {report.worker_id} while the job is {self.state.name}")
            setup = self._probe
            probe = Probe(report.per_device_batch, report.device_peak_bytes, report.host_peak_bytes, report.limit_bytes)
            log.info(
                "probe at batch %d: device peak %d B, host peak %d B",
                probe.batch,
                probe.device_peak_bytes,
                probe.host_peak_bytes,
            )
            if probe.limit_bytes == 0 and setup.device_bytes and probe.device_peak_bytes > setup.device_bytes:
                self._probe_rounds += 1
                if self._probe_rounds >= setup.max_rounds:
                    self.fail(
                        f"batch {probe.batch} still needs {probe.device_peak_bytes} B of {setup.device_bytes} "
                        f"after {self._probe_rounds} probes; lower batch.per_device"
                    )
                    raise WrongState(self.message)
                batch = shrunk_batch(probe.batch, probe.device_peak_bytes, setup.device_bytes, setup.margin)
                self.plan, self.spec = setup.replan(batch)
                message = (
                    f"peak {probe.device_peak_bytes} B exceeds {setup.device_bytes} B: probing again at batch {batch}"
                )
                log.warning("%s", message)
                return ProbeOutcome(False, self.spec, 0, message)
            if setup.policy.mode == EstimateMode.ITERATIVE:
                if self._iterative is None:
                    self._iterative = IterativeEstimate(setup.policy, probe.device_peak_bytes)
                    self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
                    return ProbeOutcome(False, self.spec, self._iterative.limit, "trial under a limit")
                following = self._iterative.next_limit(probe)
                if following is not None:
                    return ProbeOutcome(False, self.spec, following, f"utilisation {probe.utilization:.0%}: raise")
                self.worker_device_bytes = self._iterative.limit
            else:
                self.worker_device_bytes = estimate(setup.policy, probe.device_peak_bytes)
                self.worker_host_bytes = estimate(setup.policy, probe.host_peak_bytes)
            self._probe_done = True
            self.state = JobState.WAITING
            self.message = "waiting for members"
            log.info(
                "probe accepted at batch %d: each worker needs about %d B of device and %d B of host memory",
                self.plan.per_device_batch,
                self.worker_device_bytes,
                self.worker_host_bytes,
            )
            self._maybe_start()
            return ProbeOutcome(True, self.spec, 0, "accepted")

    # ------------------------------------------------------------------ data

    def request_data_shard(self, worker_id: int) -> DataShardAssignment:
        with self._cond:
            self._worker(worker_id)
            self._check_not_over()
        return self.shards.dispatch(worker_id)

    def complete_data_shard(self, worker_id: int, shard_id: int) -> None:
        with self._cond:
            self._worker(worker_id)
        self.shards.complete(worker_id, shard_id)

    # ------------------------------------------------------------------ steps

    def report_step(self, report: pb.StepReport) -> Directive:
        with self._cond:
            worker = self._worker(report.worker_id)
            worker.last_seen = self._clock()
            if not 0 <= report.step < self.plan.steps:
                raise InvalidRequest(f"step {report.step} is outside this job's steps 0..{self.plan.steps - 1}")
            if self.state.over:
                return self._directive()
            if self.state != JobState.RUNNING:
                raise WrongState(f"job is {self.state.name}; step reports are accepted while RUNNING")
            completed = len(self.records)
            if report.step < completed:
                return self._directive()  # a retried report of a step already recorded
            if report.step > completed:
                raise WrongState(
                    f"worker {report.worker_id} reported step {report.step} before step {completed} completed"
                )
            self._reports.setdefault(report.step, {})[report.worker_id] = report
            if len(self._reports[report.step]) == self.plan.workers:
                self._complete_step(report.step)
            if report.step == self.plan.steps - 1:
                worker.done = True
            return self._directive()

    def _complete_step(self, step: int) -> None:
        reports = list(self._reports.pop(step).values())
        samples = sum(r.samples for r in reports)
        loss = sum(r.loss * r.samples for r in reports) / max(samples, 1)
        now = self._clock()
        interval = now - self._last_completion if self._last_completion is not None else 0.0
        step_s = max(interval, max(r.step_s for r in reports)) if step == 0 else interval
        self._last_completion = now
        record = StepRecord(
            step=step,
            loss=loss,
            lr=self.plan.lr_at(step),
            global_batch=samples,
            samples_per_s=samples / step_s if step_s > 0 else 0.0,
            step_s=step_s,
        )
        self.records.append(record)
        if self._metrics is not None:
            self._metrics.write(json.dumps(asdict(record)) + "\n")
        if step == self.plan.steps - 1:
            self.state = JobState.EXPORTING
            self.message = "exporting the trained model"
            threading.Thread(target=self._export, name="export", daemon=True).start()
        self._cond.notify_all()

    def upload_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        own = dict(self.model.model.named_buffers())
        for name, value in buffers.items():
            if name not in own:
                raise InvalidRequest(f"the model has no buffer {name!r}")
            if own[name].shape != value.shape or own[name].dtype != value.dtype:
                raise InvalidRequest(
                    f"buffer {name!r} is {value.dtype} {tuple(value.shape)}, the model's is "
                    f"{own[name].dtype} {tuple(own[name].shape)}"
                )
        with self._cond:
            self._buffers = buffers
            self._cond.notify_all()

    def _export(self) -> None:
        try:
            with self._cond:
                addresses = [self._ps[i].address for i in range(len(self.ranges))]
                if any(True for _ in self.model.model.buffers()):
                    deadline = time.monotonic() + self._heartbeat_timeout_s
                    while self._buffers is None and time.monotonic() < deadline:
                        self._cond.wait(1.0)
                buffers = self._buffers or {}
            flat = self._exporter(addresses, self.plan.steps)
            if self.out_dir is not None:
                self.model.save(self.out_dir / "model.pt", flat, buffers)
            with self._cond:
                self.state = JobState.FINISHED
                self.message = "finished"
                self._cond.notify_all()
            log.info("job finished after %d steps", self.plan.steps)
        except Exception as exc:  # noqa: BLE001 - any export failure fails the job, with its reason
            log.exception("export failed")
            self.fail(f"export of the trained model failed: {exc}")

    # ------------------------------------------------------------------ liveness

    def heartbeat(self, role: str, member_id: int) -> Directive:
        with self._cond:
            members = self._ps if role == "ps" else self._workers if role == "worker" else None
            if members is None:
                raise InvalidRequest(f"unknown role {role!r}; use 'ps' or 'worker'")
            member = members.get(member_id)
            if member is None:
                raise UnknownMember(f"{role} {member_id} is not registered")
            member.last_seen = self._clock()
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
            now = self._clock()
            for member in (*self._ps.values(), *self._workers.values()):
                if not member.done and now - member.last_seen > self._heartbeat_timeout_s:
                    self.fail(f"{member.role} {member.id} at {member.address} silent for {now - member.last_seen:.0f}s")
                    return

    def alive_count(self, role: str) -> int:
        with self._cond:
            members = self._ps if role == "ps" else self._workers
            return sum(1 for m in members.values() if self._alive(m))

    def fail(self, reason: str) -> None:
        with self._cond:
            if self.state.over:
                return
            self.state = JobState.FAILED
            self.message = reason
            log.error("job failed: %s", reason)
            self._cond.notify_all()

    def wait_over(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.state.over, timeout_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(m.done for m in self._ps.values()), timeout_s)

    # ------------------------------------------------------------------ progress

    def watch(self, from_step: int, active: Callable[[], bool]) -> Iterator[tuple[StepRecord | None, JobState, str]]:
        """Yield step records from ``from_step`` as they complete, then a final (None, state, message)."""
        sent = max(0, from_step)

        def news() -> bool:
            return len(self.records) > sent or self.state.over

        while active():
            with self._cond:
                self._cond.wait_for(news, timeout=1.0)
                fresh = self.records[sent:]
                state, message = self.state, self.message
            for record in fresh:
                yield record, state, message
            sent += len(fresh)
            if state.over and sent >= len(self.records):
                yield None, state, message
                return

    def status(self) -> pb.JobStatus:
        counts = self.shards.counts()
        with self._cond:
            now = self._clock()
            members = [
                pb.MemberStatus(
                    role=m.role,
                    id=m.id,
                    address=m.address,
                    alive=now - m.last_seen <= self._heartbeat_timeout_s,
                    last_seen_s_ago=now - m.last_seen,
                    metrics_address=m.metrics_address,
                )
                for m in (*self._ps.values(), *self._workers.values())
            ]
            step = len(self.records)
            return pb.JobStatus(
                job_id=self.job_id,
                state=self.state.name,
                step=step,
                steps=self.plan.steps,
                per_device_batch=self.plan.per_device_batch,
                global_batch=self.plan.global_batch,
                lr=self.plan.lr_at(min(step, self.plan.steps - 1)),
                members=members,
                data_shards_todo=counts.todo,
                data_shards_doing=counts.doing,
                data_shards_done=counts.done,
                message=self.message,
                metrics_address=self.metrics_address,
                global_lr=self.plan.scaled_lr,
                worker_device_memory_bytes=self.worker_device_bytes,
                worker_host_memory_bytes=self.worker_host_bytes,
            )

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # ------------------------------------------------------------------ helpers

    def _worker(self, worker_id: int) -> Member:
        member = self._workers.get(worker_id)
        if member is None:
            raise UnknownMember(f"worker {worker_id} is not registered in job {self.job_id}")
        return member

    def _check_not_over(self) -> None:
        if self.state.over:
            raise WrongState(f"job {self.job_id} is {self.state.name}: {self.message}")

    def _directive(self) -> Directive:
        return Directive(stop=self.state.over, state=self.state, reason=self.message)

    def _alive(self, member: Member) -> bool:
        return self._clock() - member.last_seen <= self._heartbeat_timeout_s
