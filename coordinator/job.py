"""The job: who is in it, where training stands, and when it is over.

States (``JobState``)::

    WAITING --every PS shard ready and worker 0 registered, probe on--> PROBING
    PROBING --the probe fits (batch shrunk and re-planned until it does)--> WAITING
    WAITING --every PS shard ready, every worker registered, probe done or off--> RUNNING
    RUNNING --every worker reported the last step--> EXPORTING
    EXPORTING --model.pt written--> FINISHED
    any --a member silent past the heartbeat timeout, or the export failed--> FAILED

A worker that fails while RUNNING does not fail the job (S2.5): its slot is vacated (silent past
the heartbeat timeout, restarted at its address, or found unreachable when a newcomer finds every
slot taken), the step is held, and the next worker to register replaces it with the slot's
devices and memory estimate; it tells ``rejoin_at`` which version it pulled, and the slot's data
is positioned there, so the result equals the fault-free run. A slot left vacant past
``replace_timeout_s`` fails the job retryably: the cluster restarts from the last checkpoint.
Without ``replace_timeout_s`` (None; ``fault.replace_timeout_s: 0``) any failed worker does that at once.

Unless ``min_workers`` (``cluster.min_workers``) live workers remain without it: then the slot is
dropped (``_drop``) and the job goes on with fewer workers from the step the failed one did not
report. The PS shards (``set_ps_workers``: SetWorkers), the step ledger (``workers_at``) and the
LR and global batch (``_plan_at``, S1.6) change at that step together; a live worker adopts the
slot's data (every data shard is still dispatched once); the journal's ``workers_changed`` says so,
each metrics.jsonl line carries its step's ``workers``. A worker that registers later takes a
dropped slot back (``_joined``/``_grow``) from a step no PS shard can have begun. A committed checkpoint
records the workers of its step and the data-shard tracker's state there (``_resume_state``); a rollback to
it resumes with that set (``resume_workers``: the dropped slots stay dropped, each PS shard is told the set
before it is ready, the global batch and LR follow it) and that data assignment, so every sample is still
trained once; a worker that registers once the live slots are held takes a dropped one back as above.

A coordinator that dies does not end the job either: restarted, it takes the job back from the
journal (``journal.py``: the last compaction's snapshot and every event since) instead of rolling
back, and comes up RUNNING with every member as it was. Members keep training through the outage
(their heartbeats and calls retry, bounded by ``fault.coordinator_timeout_s``) and go on with
their credentials; one that does not reattach within the heartbeat timeout is a silent member as
any other. Every change the journal must replay (membership, credentials, data shards, step
reports) is made and journaled under the job's lock, so the journal's order is the state's.

A stop at a non-finite step ``t`` (``fault.on_nonfinite: stop``) records steps ``0..t-1`` first, whatever
order the reports come in (``_settle_before``), then fails the job. A coordinator stopped by SIGTERM
does not fail the job (``main.py``): its journal stays usable for the next start.

Once FINISHED or FAILED, every heartbeat and step report answers "stop". ``Job`` is the state
machine, a façade over the parts that do the work:

* ``Membership`` (membership.py): PS shards and workers by role, registration, heartbeats, liveness;
* ``ProbeSession`` (probe.py): judges the master worker's probe (S2.1-S2.3);
* ``StepLedger`` (ledger.py): step reports, one record per step, metrics.jsonl, ``watch``;
* ``ModelExport`` (export.py): waits for the buffers, pulls the final parameters, writes model.pt;
* ``DataShardTracker`` (data_shards.py): which samples each worker trains on;
* ``BufferStore`` (buffer_store.py): every worker slot's model buffers at checkpoint steps (issue 11);
  a checkpoint commits only with them, and a resumed or replacement slot fetches its own back.

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pstrain.coordinator.buffer_store import BufferStore, SlotBuffers
from pstrain.coordinator.checkpoints import CheckpointLedger
from pstrain.coordinator.data_shards import DataShardAssignment, DataShardCounts, DataShardTracker
from pstrain.coordinator.errors import InvalidRequest, NoFreeSlot, ProbeFailed, UnknownMember, WrongState
from pstrain.coordinator.export import ModelExport, PullFinal
from pstrain.coordinator.journal import COMPACT_BYTES, JOURNAL_NAME, Journal, JournalUnusable, Recovery
from pstrain.coordinator.ledger import Progress, StepLedger, StepRecord, StepReport
from pstrain.coordinator.membership import Member, Membership, MemberView
from pstrain.coordinator.memory_forecast import RECENT_STEPS, PsMemoryForecast, expected_end_s
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import Plan
from pstrain.coordinator.probe import ProbeOutcome, ProbeReport, ProbeSession, ProbeSetup
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.model_refusal import MAX_REASON_CHARS
from pstrain.runtime.shard_map import ShardRange, shard_ranges

log = logging.getLogger(__name__)

GROW_AHEAD_STEPS = 4
"""A worker that takes a dropped slot back contributes from this many steps past the last recorded one. While
the PS shards are told, step reports are answered only afterwards (``_hold_reports``); a worker reports each
step before it starts the next, so no PS piece gets past 3 steps beyond the last recorded one meanwhile (one
of lookahead, one pushed before its report, one in flight): every shard takes the change before that step."""
HOLD_REPORTS_S = 20.0  # the longest a step report's answer waits for the PS shards to take a returning worker

NONFINITE_SETTLE_S = 10.0
"""How long a stop at a non-finite step waits for the reports of the steps before it (``_settle_before``)."""


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
class WorkerSlot:
    """A worker's slot as its registration reply serves it (S2.5: a replacement gets the failed one's)."""

    replacement: bool
    devices: list[str]
    device_memory_bytes: int
    host_memory_bytes: int
    start_step: int  # the first step this slot has not reported


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


SetPsWorkers = Callable[[list[str], int, list[int], float], list[tuple[bool, bool]]]
"""(PS addresses, from step, worker ids, scaled LR) -> per shard (every piece, some piece) kept a dropped
worker's contribution to that step: ``ParameterShard.set_workers`` on every shard (cluster.min_workers)."""


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
        replace_timeout_s: float | None = None,
        reachable: Callable[[str], bool] | None = None,
        recovery: Recovery | None = None,
        min_workers: int | None = None,
        set_ps_workers: SetPsWorkers | None = None,
        resume_workers: list[int] | None = None,
        job_hash: str = "",
        resumed_estimate: tuple[int, int] = (0, 0),
    ) -> None:
        if not 0 <= start_step < plan.steps:
            raise ValueError(f"start step {start_step} is outside the job's steps 0..{plan.steps - 1}")
        self.job_id = job_id
        self.job_hash = job_hash  # the job file's (JobIdentity.digest): a restart takes the journal back only with it
        self.failure_retryable = True  # meaningful once FAILED: would a restart help?
        self.resume_step = start_step  # > 0: PS shards load this committed checkpoint instead of the initial weights
        self._checkpoints = checkpoints
        self.replace_timeout_s = replace_timeout_s
        self._reachable = reachable  # whether a worker's address still answers (a newcomer finds the slots full)
        self.min_workers = plan.workers if min_workers is None else min_workers  # cluster.min_workers (issue 11)
        self._joining: dict[int, int] = {}  # a worker that took a dropped slot back -> the step it starts at
        self._holding = 0  # returns whose PS change is in flight: step reports are answered once the shards know
        self._reshaping = False  # _drop is telling the PS shards a smaller set: no worker takes a slot back meanwhile
        self._set_ps_workers = set_ps_workers  # tells every PS shard the contributors from a step on
        self.replacements = 0  # workers replaced in place (S2.5)
        self._incarnations: dict[tuple[str, int], int] = dict(recovery.incarnations) if recovery is not None else {}
        self._confirmations: dict[int, set[int]] = {}  # step -> shards that confirmed it, not committed: journaled
        self.journal = Journal(out_dir / JOURNAL_NAME) if out_dir is not None else None  # the decisions, fsynced
        if self.journal is not None and recovery is None:
            self.journal.reset()  # a new job (or a rollback): the journal starts with it
        self.journal_compact_bytes = COMPACT_BYTES  # compacted past this without a commit (``_bound_journal``)
        self._compact_retry_at = 0  # after a failed compaction: the appended bytes at which to try again
        self._start_step = start_step
        self.recovered = recovery is not None
        self._awaiting: set[tuple[str, int]] = set()  # a recovered job: members not heard from since the restart
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
        self._stopping = False  # the process is stopping (``stop_waits``): waiting handlers return at once
        self.membership = Membership(
            job_id, len(self.shard_ranges), plan.workers, plan.devices_per_worker, heartbeat_timeout_s, clock
        )
        self._probe = ProbeSession(probe) if probe is not None else None
        # The probe's estimate of a job that runs none: taken back from the journal, or resumed from a checkpoint
        # (its manifest's); later manifests carry it on.
        self._recovered_estimate = (
            (recovery.worker_device_bytes, recovery.worker_host_bytes) if recovery is not None else resumed_estimate
        )
        if checkpoints is not None and probe is None and any(self._recovered_estimate):
            checkpoints.estimate(*self._recovered_estimate)
        self.ledger = StepLedger(
            plan.workers,
            lambda step: self._plan_at(step).lr_at(step),
            out_dir / "metrics.jsonl" if out_dir is not None else None,
            clock,
            self._cond,
            recovery.completed if recovery is not None else start_step,
            lookahead=1,  # a worker that overlaps its next pull reports ahead of a slower peer
        )
        self._resumed_workers: tuple[int, ...] | None = None  # a checkpoint's smaller set: PS shards told at ready
        if resume_workers is not None and set(resume_workers) != set(range(plan.workers)):
            if set_ps_workers is None:
                raise ValueError("resuming with fewer workers needs set_ps_workers")
            self._resumed_workers = self.ledger.note_workers(start_step, resume_workers)
            for slot in sorted(set(range(plan.workers)) - set(resume_workers)):
                self.membership.drop_slot(slot)
        self.export = ModelExport(model, out_dir, pull_final, heartbeat_timeout_s, self._cond)
        self.buffers = BufferStore(  # issue 11 (buffer_store.py): checkpoint t needs the slots that trained step t-1
            model.model, plan.workers, plan.devices_per_worker, lambda t: self.ledger.workers_at(max(t - 1, 0))
        )
        if checkpoints is not None:
            checkpoints.buffers = self.buffers  # a checkpoint commits with every slot's buffers
            checkpoints.resume_state = self._resume_state  # and with the workers and data assignment of its step
            self.buffers.load(checkpoints.directory, checkpoints.last_committed if recovery else start_step)
            # uploads not yet committed are kept on disk: a job taken back from its journal still has them
            self.buffers.spool(checkpoints.directory, checkpoints.last_committed if recovery is not None else None)
        if recovery is not None:
            self._recover(recovery)

    # ------------------------------------------------------------------ the journal

    def _recover(self, recovery: Recovery) -> None:
        """Take the job back where the journal left it (a restarted coordinator): members, the data
        shards, the step reports; RUNNING at once. Raises ``JournalUnusable`` if the replay disagrees."""
        if recovery.completed >= self.plan.steps:
            raise JournalUnusable("every step was recorded: the export is redone from the last checkpoint")
        try:
            self._take_back(recovery)
            if self._checkpoints is not None:  # a shard confirms a step once: those before the restart count
                for shard_id, step in recovery.confirmations:
                    self._checkpoints.confirm(shard_id, step)
        except (UnknownMember, InvalidRequest, WrongState, KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise JournalUnusable(f"replaying the journal failed: {exc}") from exc
        if self._checkpoints is not None:
            self._commit(self.ledger.completed)  # the coordinator died between the last confirmation and the commit
        for worker_id in sorted(self._joining):  # a return in progress: the shards may not have heard (idempotent)
            with self._cond:
                self._holding += 1
            self._grow(worker_id)
        log.warning(
            "recovered job %s from its journal at step %d (checkpoint %d): %d members may reattach within %.0fs",
            self.job_id,
            self.ledger.completed,
            self.checkpoint_step,
            len(recovery.members),
            self.membership.heartbeat_timeout_s,
        )

    def _take_back(self, recovery: Recovery) -> None:
        with self._cond:
            self.membership.restore(recovery.members)
            self.replacements = recovery.replacements
            if recovery.worker_sets:
                self.ledger.restore_worker_sets(recovery.worker_sets)
            self._joining = dict(recovery.joining)
            if recovery.tracker is not None:
                self.data_shards.restore(recovery.tracker)
            elif recovery.start_step and self.data_shards.pristine:  # else restored from the checkpoint already
                self.data_shards.resume(recovery.start_step, self._samples_per_worker)
            for op in recovery.tracker_ops:
                self._replay(op)
            self.state = JobState.RUNNING
            self.message = "recovering: waiting for the members to reattach"
            self._awaiting = {(m.role, m.id) for m in self.membership.members() if not m.failed and not m.done}
            self.ledger.start()
            for fields in recovery.reports:
                report = StepReport(**fields)
                self._after_record(self.ledger.add(report))
                if report.step == self.plan.steps - 1:
                    self.membership.worker(report.worker_id).done = True
            for shard_id, step in recovery.confirmations:
                if step > self.checkpoint_step:
                    self._confirmations.setdefault(step, set()).add(shard_id)
            if self._checkpoints is None:
                self._fold_data()  # as the job was before the restart, compacted or not
            self._compact()  # the journal is whole again from here

    def _replay(self, op: dict[str, object]) -> None:
        """One data-shard event again, on the tracker (deterministic: the same call gives the same shard)."""
        worker = int(op["worker"])  # type: ignore[call-overload]
        kind = op["event"]
        if kind == "data_shard_dispatched":
            got = self.data_shards.dispatch(worker, int(op.get("seq", 0))).data_shard_id  # type: ignore[call-overload]
            if got != op["data_shard"]:
                raise JournalUnusable(f"replaying the journal dispatched data shard {got}, it says {op['data_shard']}")
        elif kind == "data_shard_completed":
            self.data_shards.complete(worker, int(op["data_shard"]))  # type: ignore[call-overload]
        elif kind == "worker_failed":
            self.data_shards.requeue(worker)
        elif kind == "workers_changed":
            start = int(op["from_step"])  # type: ignore[call-overload]
            self.ledger.note_workers(start, list(op["ids"]))  # type: ignore[call-overload]
            for later, ids in op.get("later", []):  # type: ignore[attr-defined]
                self.ledger.note_workers(int(later), list(ids))  # a return pending past the drop, without it
            if op.get("joined"):
                self.data_shards.release(worker, start)
                self._joining[worker] = start  # its first step; a restarted coordinator tells the shards again
            else:
                self._joining.pop(worker, None)
                adopter = int(op["adopter"])  # type: ignore[call-overload]
                self.data_shards.adopt(worker, start, self._samples_per_worker, adopter, self._consumed(start))
        elif kind == "worker_rejoined":
            step = int(op["step"])  # type: ignore[call-overload]
            self.data_shards.reposition(worker, step, self._samples_per_worker, self._consumed(step))
        elif kind == "worker_returned":
            self._joining.pop(worker, None)

    def _consumed(self, step: int) -> Callable[[int, int], int]:
        """(worker, the step its data stream began at) -> the samples it consumed before ``step``: a worker's
        batch for every step it trained (the lock held while it is called)."""

        def consumed(worker_id: int, start: int) -> int:
            steps = sum(worker_id in self.ledger.workers_at(k) for k in range(start, step))
            return steps * self._samples_per_worker

        return consumed

    def _resume_state(self, step: int) -> dict[str, Any] | None:
        """What checkpoint ``step``'s manifest records beyond the step: its workers and, once a slot's data
        moved (``cluster.min_workers``), the tracker's state there; None while it cannot be told.

        A positional tracker is positioned from the step alone: no state is computed. The step is committed
        then, so the tracker's streams forget what was consumed before it (``fold``): a commit's cost and the
        tracker's size stay bounded however long the job runs."""
        with self._cond:
            workers = self.ledger.workers_at(step)
            consumed = self._consumed(step)
            tracker = None if self.data_shards.positional else self.data_shards.state_at(step, consumed, workers)
            if tracker is None and not self.data_shards.positional:
                return None
            self.data_shards.fold(step, consumed)
            return {"worker_ids": list(workers), "tracker": tracker}

    def serving(self) -> None:
        """The coordinator answers from now: a recovered job's members get their whole reattach window."""
        with self._cond:
            if self._awaiting:
                self.membership.restart_clocks()

    def _reattached(self, role: str, member_id: int) -> None:
        """A member of a recovered job was heard from (the lock held); the last one ends the recovery."""
        self._awaiting.discard((role, member_id))
        log.info("%s %d reattached to the restarted coordinator", role, member_id)
        if not self._awaiting and self.state == JobState.RUNNING:
            self.message = "training"
            self._journal("recovered", step=self.ledger.completed)
            log.info(
                "every member reattached: job %s goes on at step %d, no rollback", self.job_id, self.ledger.completed
            )

    def _snapshot(self) -> dict[str, object]:
        """The job's state for the journal's compaction (the lock held)."""
        return {
            **self._job_fields(),
            "members": self.membership.snapshot(),
            "incarnations": [[role, mid, n] for (role, mid), n in sorted(self._incarnations.items())],
            "tracker": self.data_shards.snapshot(),
            "reports": [asdict(r) for r in self.ledger.pending_reports()],
            "replacements": self.replacements,
            "worker_sets": self.ledger.worker_sets(),
            "joining": [[worker, step] for worker, step in sorted(self._joining.items())],
            "confirmations": [
                [shard_id, step]
                for step, shards in sorted(self._confirmations.items())
                if step > self.checkpoint_step
                for shard_id in sorted(shards)
            ],
        }

    def _job_fields(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "job_hash": self.job_hash,
            "per_device_batch": self.plan.per_device_batch,
            "start_step": self._start_step,
            "completed": self.ledger.completed,
            "worker_device_bytes": self.worker_device_bytes,  # the probe's estimate: a restart has no probe
            "worker_host_bytes": self.worker_host_bytes,
        }

    def _compact(self) -> None:
        if self.journal is not None:
            with self._cond:
                self.journal.compact(self.checkpoint_step, self._snapshot())

    def _bound_journal(self) -> None:
        """After a recorded step (the lock held): keep the journal and the tracker bounded when nothing commits.

        Without checkpoints nothing ever compacts the journal or folds the tracker's streams (``_resume_state``
        does at a commit): the journal grows by every step, a restart reads all of it, and the streams keep every
        data shard's sample list (some 40 KB a step with two workers and 512-sample data shards). No rewind goes
        before the recorded steps (a rejoin, a drop or a return starts at one not recorded), so they are folded at
        every step; the journal is compacted once it grew by ``journal_compact_bytes`` since its last compaction,
        whether checkpoints are off or not committing.
        """
        if self._checkpoints is None:
            self._fold_data()
        due = self._compact_retry_at or self.journal_compact_bytes
        if self.journal is None or self.state.over or self.journal.appended_bytes < due:
            return  # over: its ``job_over`` line must stay (``_commit`` does not compact then either)
        try:
            self._compact()
            self._compact_retry_at = 0
        except OSError as exc:  # the step is recorded: its report must not fail (the worker would exit and retry)
            self._compact_retry_at = self.journal.appended_bytes + self.journal_compact_bytes
            log.warning("could not compact the journal (%s); it stays whole and grows until the next try", exc)

    def _fold_data(self) -> None:
        """Forget what the tracker's streams consumed before the recorded steps (no checkpoint asks for a state)."""
        step = self.ledger.completed
        self.data_shards.fold(step, self._consumed(step))

    def _journal_members(self) -> None:
        self._journal("members", members=self.membership.snapshot())

    def credential_issued(self, role: str, member_id: int, incarnation: int) -> None:
        """The servicer issued a member's credential (issue 8): a restarted coordinator accepts it again."""
        with self._cond:
            self._incarnations[(role, member_id)] = incarnation
            self._journal("credential", role=role, id=member_id, incarnation=incarnation)

    @property
    def incarnations(self) -> dict[tuple[str, int], int]:
        with self._cond:
            return dict(self._incarnations)

    # ------------------------------------------------------------------ membership

    def register_ps(self, shard_id: int, address: str, metrics_address: str = "", proven: bool = False) -> ShardRange:
        """A PS shard joins; ``proven``: the call carries the shard's current credential (``check_takeover``). A
        registration that may not take the shard is refused before anything changes: the job is not rolled back
        for a live shard's address named by someone else."""
        with self._cond:
            self._check_not_over()
            self.membership.check_ps_claim(shard_id, address, proven)
            if self.state != JobState.WAITING and self.membership.restarted_ps(shard_id, address):
                self._roll_back(f"PS shard {shard_id} restarted at {address} and lost its state")
            self.membership.register_ps(shard_id, address, metrics_address, proven)
            self._journal_members()
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
            if step > self.checkpoint_step:  # under the lock: in a compaction's snapshot, or journaled after it
                self._confirmations.setdefault(step, set()).add(shard_id)
                self._journal("checkpoint_confirmed", False, shard=shard_id, step=step)
        self._checkpoints.confirm(shard_id, step)
        if self._commit(self.ledger.completed):  # file I/O: outside the job's lock
            with self._cond:
                self._cond.notify_all()

    def _commit(self, completed: int) -> bool:
        """Commit the newest checkpoint that is ready; the journal then starts again from it."""
        assert self._checkpoints is not None
        manifest = self._checkpoints.commit(completed)
        if manifest is not None:
            self._journal("checkpoint_committed", step=manifest.step)
            with self._cond:
                for step in [s for s in self._confirmations if s <= manifest.step]:
                    del self._confirmations[step]
                if not self.state.over:
                    self._compact()
        return manifest is not None

    def _journal(self, event: str, durable: bool = True, **fields: object) -> None:
        if self.journal is not None:
            self.journal.append(event, durable, **fields)

    @property
    def checkpoint_step(self) -> int:
        """The newest committed checkpoint, -1 if none."""
        return self._checkpoints.last_committed if self._checkpoints is not None else -1

    def ps_ready(self, shard_id: int) -> None:
        with self._cond:
            address = self.membership.ps(shard_id).address
            told = self._resumed_workers is not None and self.state == JobState.WAITING and not self.recovered
            lr = self._plan_at(self._start_step).scaled_lr
        if told:  # before any worker may push: a worker waits for every shard to be ready
            assert self._resumed_workers is not None and self._set_ps_workers is not None
            try:
                self._set_ps_workers([address], self._start_step, list(self._resumed_workers), lr)
            except Exception as exc:  # noqa: BLE001 - a shard that waits for a dropped worker would hang the job
                log.exception("telling PS shard %d the resumed checkpoint's workers failed", shard_id)
                self.fail(f"could not tell PS shard {shard_id} the workers {list(self._resumed_workers)}: {exc}")
                raise WrongState(self.message) from exc
            log.info(
                "PS shard %d goes on with workers %s from step %d (lr %g), as the checkpoint it resumed from",
                shard_id,
                list(self._resumed_workers),
                self._start_step,
                lr,
            )
        with self._cond:
            self.membership.ps_ready(shard_id)
            self._journal_members()
            self._maybe_start()

    def register_worker(
        self, address: str, devices: list[str], hostname: str, metrics_address: str = "", proven: int | None = None
    ) -> int:
        """A worker joins: a free slot, or (RUNNING) the slot of a failed worker it replaces (S2.5). ``proven``: the
        worker id whose current credential the call carries; only with it may a registration at a live worker's
        address take that worker's slot at once (``check_takeover``)."""
        try:
            return self._register_worker(address, devices, hostname, metrics_address, proven=proven).id
        except NoFreeSlot:
            if self._vacate_unreachable():
                return self._register_worker(address, devices, hostname, metrics_address, proven=proven).id
            member = self._register_worker(address, devices, hostname, metrics_address, True, proven)
            self._grow(member.id)
            return member.id

    def worker_slot(self, worker_id: int) -> WorkerSlot:
        """What a worker is served on registration: a replacement is configured like the failed worker."""
        with self._cond:
            member = self.membership.worker(worker_id)
            return WorkerSlot(
                replacement=member.replacement,
                devices=list(member.devices),
                device_memory_bytes=self.worker_device_bytes,
                host_memory_bytes=self.worker_host_bytes,
                start_step=self._joining.get(worker_id, self.ledger.first_unreported(worker_id)),
            )

    @property
    def replaces_workers(self) -> bool:
        return self.replace_timeout_s is not None

    def _register_worker(
        self,
        address: str,
        devices: list[str],
        hostname: str,
        metrics_address: str,
        take_dropped: bool = False,
        proven: int | None = None,
    ) -> Member:
        with self._cond:
            self._check_not_over()
            if take_dropped:
                self._check_may_grow()
            again = self.membership.registered_at(address, hostname) if self.state == JobState.WAITING else None
            if again is not None and not take_dropped:  # not started yet: nothing to roll back, its slot is its own
                member = self.membership.register_again(
                    again.id, devices, hostname, metrics_address, proven=proven == again.id
                )
                self._journal("worker_registered", worker=member.id, address=address, host=hostname, replacement=False)
                self._journal_members()
                self._maybe_start()
                return member
            restarted = self.membership.restarted_worker(address, hostname) if self.state != JobState.WAITING else None
            if restarted is not None:  # a live holder's slot only with its credential: refused before any rollback
                self.membership.check_takeover(self.membership.worker(restarted), proven == restarted)
                if self.state != JobState.RUNNING or not self.replaces_workers:
                    self._roll_back(f"worker {restarted} on host {hostname} restarted")
                self._vacate(restarted, f"it restarted on host {hostname}")
            member = self.membership.register_worker(address, devices, hostname, metrics_address, take_dropped)
            if take_dropped:
                self._joined(member.id)
            elif member.replacement:
                self.replacements += 1
            self._journal(
                "worker_registered", worker=member.id, address=address, host=hostname, replacement=member.replacement
            )
            self._journal_members()
            self._maybe_start()
            return member

    def _vacate_unreachable(self) -> bool:
        """Every slot is taken: vacate those whose worker no longer answers at its address (a crashed
        process refuses the connection at once); network I/O, so outside the lock. True if any."""
        with self._cond:
            if self.state != JobState.RUNNING or self._reachable is None or not self.replaces_workers:
                return False
            occupied = self.membership.occupied_workers()
        dead = [(wid, address) for wid, address in occupied if not self._reachable(address)]
        with self._cond:
            vacated = False
            for wid, address in dead:
                member = self.membership.worker(wid)
                if member.address == address and not member.failed and not member.done:
                    self._vacate(wid, f"it does not answer at {address}")
                    vacated = True
            return vacated

    def _vacate(self, worker_id: int, why: str) -> None:
        """Declare a worker failed (the lock held): hold the step, requeue its data, wait for a replacement."""
        member = self.membership.vacate(worker_id)
        requeued = self.data_shards.requeue(worker_id)  # the tracker's lock is a leaf: safe under ours
        self._journal("worker_failed", worker=worker_id, why=why, held_step=self.ledger.completed, requeued=requeued)
        self._journal_members()
        log.warning(
            "worker %d at %s failed (%s): step %d is held for its replacement (data shards %s requeued; "
            "a replacement has %.0fs)",
            worker_id,
            member.address,
            why,
            self.ledger.completed,
            requeued,
            self.replace_timeout_s,
        )
        self._cond.notify_all()

    def rejoin_at(self, worker_id: int, step: int, inconsistent: str = "") -> Directive:
        """A replacement pulled version ``step`` and trains from there: position its slot's data (S2.5).

        ``step`` is the held step, or the one after it when the failed worker had pushed the held step
        everywhere before it died (its push stays counted); then its missing report is stood in for. A
        push that reached some pieces only is redone by the replacement (``PullAt`` reads the held version
        there). What the replacement reports ``inconsistent`` (a sparse job's tables, a shard it cannot
        read) cannot be mended in place: the cluster rolls back to the last committed checkpoint.
        """
        with self._cond:
            member = self.membership.worker(worker_id)
            if self.state.over:
                return self._directive()
            if worker_id in self._joining:
                return self._returned(worker_id, step, inconsistent)
            completed = self.ledger.completed
            unreported = self.ledger.first_unreported(worker_id)
            if inconsistent or not completed <= step <= unreported + 1:
                why = inconsistent or f"it pulled version {step} while step {completed} is held"
                self.fail(f"replacement worker {worker_id} cannot redo the step ({why}); rolling back")
                return self._directive()
            for pushed in range(unreported, step):  # pushed by the failed worker, never reported
                stand_in = self.ledger.stand_in_report(worker_id, pushed, self._samples_per_worker)
                record = self.ledger.add(stand_in)
                self._journal("report", False, report=asdict(stand_in))
                self._after_record(record)
            member.last_seen = self._clock()
            if step >= self.plan.steps:  # its predecessor pushed the last step everywhere: it trains none and exits,
                member.done = True  # so its silence during the export is not a failure
            done = self.data_shards.reposition(worker_id, step, self._samples_per_worker, self._consumed(step))
            self._journal("worker_rejoined", worker=worker_id, step=step, data_shards_done=done)
        log.info("worker %d resumes its slot at step %d (data shards %s counted done)", worker_id, step, done)
        return self._directive()

    @property
    def _samples_per_worker(self) -> int:
        return self.plan.per_device_batch * self.plan.devices_per_worker

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
            self._journal("job_started", **self._job_fields(), members=self.membership.snapshot())
            log.info("all members ready: %s", self.plan.describe())
        self._cond.notify_all()

    def wait_for_cluster(
        self, timeout_s: float, worker_id: int = -1, active: Callable[[], bool] = lambda: True
    ) -> ClusterView:
        """Block until every PS shard serves and the spec is final (the probe is done).

        Worker 0 is let through while the job is PROBING: it must probe first (``probe``).
        Ends early (``WrongState``) once the caller is gone (``active()`` false: it cancelled, or the server
        cancelled the call at the end of its grace period) or the process stops (``stop_waits``): a handler
        left waiting for the caller's deadline (ten minutes) would hold the coordinator's exit that long.
        """
        deadline = time.monotonic() + timeout_s  # a real wait: the injected clock is for liveness
        with self._cond:
            while True:
                self._check_not_over()
                if self._stopping:
                    raise WrongState("the coordinator is stopping")
                if not active():
                    raise WrongState("the caller is gone")
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
                if self._checkpoints is not None:
                    self._checkpoints.rebatch(self.plan.per_device_batch * self.plan.devices_per_worker)
            if judgement.done:
                self.state = JobState.WAITING
                self.message = "waiting for members"
                if self._checkpoints is not None:
                    self._checkpoints.estimate(self._probe.worker_device_bytes, self._probe.worker_host_bytes)
                log.info(
                    "probe accepted at batch %d: each worker needs about %d B of device and %d B of host memory",
                    self.plan.per_device_batch,
                    self._probe.worker_device_bytes,
                    self._probe.worker_host_bytes,
                )
                self._maybe_start()
            return ProbeOutcome(judgement.done, self.spec, judgement.limit_bytes, judgement.message)

    @property
    def global_batch(self) -> int:
        """The step in progress's global batch, as ``status`` reports it: it follows a probe's re-plan and a
        ``cluster.min_workers`` drop or return."""
        with self._cond:
            return self._plan_at(self.ledger.completed).global_batch

    @property
    def worker_device_bytes(self) -> int:
        """S2.2's estimate of the device memory each worker needs; 0 before (or without) the probe. A job taken
        back from its journal has the estimate its probe made before the restart."""
        if self._probe is not None:
            return self._probe.worker_device_bytes
        return self._recovered_estimate[0]

    @property
    def worker_host_bytes(self) -> int:
        if self._probe is not None:
            return self._probe.worker_host_bytes
        return self._recovered_estimate[1]

    # ------------------------------------------------------------------ data shards

    def request_data_shard(self, worker_id: int, seq: int = 0) -> DataShardAssignment:
        """The worker's next data shard; ``seq`` > 0 numbers the request, so a retry gets the same one."""
        with self._cond:
            self.membership.worker(worker_id)
            self._check_not_over()
            data_shard = self.data_shards.dispatch(worker_id, seq)
            self._journal(
                "data_shard_dispatched",
                False,
                worker=worker_id,
                seq=seq,
                data_shard=data_shard.data_shard_id,
                epoch=data_shard.epoch,
                samples=len(data_shard.indices),
            )
            return data_shard

    def complete_data_shard(self, worker_id: int, data_shard_id: int) -> None:
        with self._cond:
            self.membership.worker(worker_id)
            self.data_shards.complete(worker_id, data_shard_id)
            self._journal("data_shard_completed", False, worker=worker_id, data_shard=data_shard_id)

    # ------------------------------------------------------------------ steps and export

    def report_step(self, report: StepReport) -> Directive:
        directive, completed = self._record_step(report)
        self._hold_reports()
        if self._checkpoints is not None and completed is not None:
            self._commit(completed)  # a checkpoint waiting for this step's record; outside the lock
        return directive

    def _record_step(self, report: StepReport) -> tuple[Directive, int | None]:
        """Take the report; returns the directive and, when the report completed a step, the step count."""
        with self._cond:
            worker = self.membership.worker(report.worker_id)
            if worker.failed:
                return self._replaced_directive(report.worker_id), None
            worker.last_seen = self._clock()
            if not 0 <= report.step < self.plan.steps:
                raise InvalidRequest(f"step {report.step} is outside this job's steps 0..{self.plan.steps - 1}")
            if self.state.over:
                return self._directive(), None
            if self.state != JobState.RUNNING:
                raise WrongState(f"job is {self.state.name}; step reports are accepted while RUNNING")
            if report.nonfinite and self.spec.on_nonfinite != "skip":
                if report.step <= self.ledger.first_unreported(report.worker_id):  # it reported every step before
                    self._settle_before(report.step)
                if self.state.over:
                    return self._directive(), None
                self.fail(
                    f"worker {report.worker_id} computed a non-finite loss or gradient at step {report.step}; "
                    "fault.on_nonfinite: stop",
                    retryable=False,
                )
                return self._directive(), None
            record = self.ledger.add(report)
            self._journal("report", False, report=asdict(report))
            self._after_record(record)
            if report.step == self.plan.steps - 1:
                worker.done = True
            if record is not None:
                self._bound_journal()
            return self._directive(), (self.ledger.completed if record is not None else None)

    def _settle_before(self, step: int) -> None:
        """A stop at non-finite ``step`` (the lock held) records every step before it first.

        The worker computed ``step`` on version ``step``, so every worker pushed each earlier step;
        a slower peer's report of ``step - 1`` may still be on its way (a worker reports one step
        ahead). Wait for it, bounded; a report that does not come is stood in for (the model is
        exact, only that record's loss is estimated). So the steps recorded are always 0..step-1.
        """
        deadline = time.monotonic() + min(self.membership.heartbeat_timeout_s, NONFINITE_SETTLE_S)
        while self.ledger.completed < step and not self.state.over:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        while self.ledger.completed < step and not self.state.over:
            pending = self.ledger.completed
            if not self.ledger.missing(pending):
                break
            for worker_id in self.ledger.missing(pending):
                stand_in = self.ledger.stand_in_report(worker_id, pending, self._samples_per_worker)
                log.warning(
                    "worker %d did not report step %d before the stop: its report is stood in", worker_id, pending
                )
                self._journal("report", False, report=asdict(stand_in))
                self._after_record(self.ledger.add(stand_in))

    def refuse_model(self, worker_id: int, reason: str) -> Directive:
        """A worker cannot train the model, and every member would fail the same way after a restart: fail the
        job, not retryable, so the units and ``pstrain local`` restart nobody into the same error."""
        reason = reason.strip()
        if not reason:
            raise InvalidRequest("a model refusal must say why the worker cannot train the model (reason is empty)")
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidRequest(f"a model refusal's reason has {len(reason)} characters; at most {MAX_REASON_CHARS}")
        with self._cond:
            if self.membership.worker(worker_id).failed:
                return self._replaced_directive(worker_id)
            self.fail(f"worker {worker_id} cannot train this model: {reason}", retryable=False)
            return self._directive()

    def _after_record(self, record: StepRecord | None) -> None:
        """With the lock held: journal a completed step; the last step's record starts the export."""
        if record is not None:
            self._journal("step", step=record.step, global_batch=record.global_batch, lr=record.lr)
        if record is not None and record.step == self.plan.steps - 1:
            self.state = JobState.EXPORTING
            self.message = "exporting the trained model"
            addresses = self.membership.ps_addresses()
            threading.Thread(target=self._run_export, args=(addresses,), name="export", daemon=True).start()
            self._cond.notify_all()

    @property
    def records(self) -> list[StepRecord]:
        return self.ledger.records

    def buffers_wanted(self, worker_id: int, step: int) -> bool:
        """Issue 11: whether slot ``worker_id``'s buffers of ``step`` are to be taken (False: committed already);
        raises when they may not be sent at all. Asked before an upload's payload is read, and again with it."""
        every = self.spec.checkpoint_every_steps
        with self._cond:
            if self.membership.worker(worker_id).failed:
                raise WrongState(f"worker {worker_id} was declared failed; its buffers are not taken")
            if self._checkpoints is None or every <= 0:
                raise WrongState(f"job {self.job_id} takes no checkpoints (checkpoint.every_steps is 0 or no dir)")
            if not 0 < step <= self.plan.steps or (step % every and step != self.plan.steps):
                raise InvalidRequest(
                    f"step {step} is not a checkpoint step of this job (every {every}, last {self.plan.steps})"
                )
            return step > self.checkpoint_step  # else committed already (a replacement redid it): the same buffers

    def checkpoint_buffers(self, worker_id: int, step: int, buffers: SlotBuffers) -> None:
        """Issue 11: slot ``worker_id``'s buffers after the update to checkpoint ``step``; the last slot's
        (with every shard's confirmation and the step recorded) commits it."""
        if not self.buffers_wanted(worker_id, step):
            return
        self.buffers.put(worker_id, step, buffers)
        if self._commit(self.ledger.completed):  # file I/O: outside the job's lock
            with self._cond:
                self._cond.notify_all()

    def slot_buffers(self, worker_id: int, step: int) -> tuple[int, SlotBuffers] | None:
        """Slot ``worker_id``'s newest buffers at or before ``step`` (the version it trains from), and their step."""
        with self._cond:
            self.membership.worker(worker_id)
        return self.buffers.newest(worker_id, step)

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
            if self.state.over:  # failed while the export ran (a member lost): the members were told so already
                log.warning("the trained model was written, but the job had failed meanwhile: %s", self.message)
                return
            self.state = JobState.FINISHED
            self.message = "finished"
            self._journal("job_over", state=self.state.name, message=self.message)
            self._cond.notify_all()
        log.info("job finished after %d steps", self.plan.steps)

    def watch(self, from_step: int, active: Callable[[], bool]) -> Iterator[Progress]:
        """Records from ``from_step`` as they complete, then one ``Progress`` without a record: the final state."""
        return self.ledger.watch(from_step, active, lambda: (self.state, self.message))

    # ------------------------------------------------------------------ liveness and the end

    def heartbeat(self, role: str, member_id: int, rss_bytes: int = 0) -> Directive:
        with self._cond:
            member = self.membership.heard_from(role, member_id, rss_bytes)
            if member.failed:
                return self._replaced_directive(member_id)
            if (role, member_id) in self._awaiting:
                self._reattached(role, member_id)
            directive = self._directive()
            if directive.stop:
                member.done = True
                self._cond.notify_all()
            return directive

    def check_liveness(self) -> None:
        """A silent worker while RUNNING is vacated for a replacement (S2.5); a slot vacant past
        ``replace_timeout_s`` is dropped while ``min_workers`` allows (``_drop``), else it fails the job
        (retryably: rollback), as any other silent member does."""
        dropping: list[int] = []
        self._check_liveness(dropping)
        for worker_id in dropping:  # network I/O to the PS shards: outside the lock
            self._drop(worker_id)

    def _check_liveness(self, dropping: list[int]) -> None:
        with self._cond:
            if self.state.over:
                return
            if self.state == JobState.RUNNING and self.replace_timeout_s is not None:
                for worker_id in self.membership.silent_workers():
                    self._vacate(worker_id, f"silent for over {self.membership.heartbeat_timeout_s:.0f}s")
                now = self._clock()
                for worker_id in self.membership.vacant_slots():
                    waited = now - self.membership.worker(worker_id).failed_at
                    if waited > self.replace_timeout_s and self._may_drop(worker_id):
                        dropping.append(worker_id)
                    elif waited > self.replace_timeout_s:
                        self.fail(f"no replacement for failed worker {worker_id} within {self.replace_timeout_s:.0f}s")
                        return
            reason = self.membership.silent()
            if reason is not None:
                self.fail(reason)

    def alive_count(self, role: str) -> int:
        with self._cond:
            return self.membership.alive_count(role)

    # ------------------------------------------------------------------ fewer workers (cluster.min_workers)

    def _plan_at(self, step: int) -> Plan:
        """The plan of step ``step``: its workers' global batch and LR (S1.6), after a slot was dropped."""
        workers = len(self.ledger.workers_at(step))
        return self.plan if workers == self.plan.workers else replace(self.plan, workers=workers)

    def _check_may_grow(self) -> None:
        """NoFreeSlot unless a worker may take a dropped slot back now (the lock held); WrongState (the
        member's join retries it) while that may change soon: a drop telling the PS shards, or a job resumed
        with a dropped slot that waits for its members."""
        if self._set_ps_workers is not None and self.membership.dropped_slots():
            if self._reshaping or self._holding:  # one change at a time: each sends the ledger's set it read
                raise WrongState(f"job {self.job_id} is changing its worker set; retry")
            if self.state == JobState.WAITING:
                raise WrongState(f"job {self.job_id} waits for its members before a dropped slot is taken back; retry")
        if self.state != JobState.RUNNING or self._set_ps_workers is None or not self.membership.dropped_slots():
            raise NoFreeSlot(f"all {self.plan.workers} worker slots of job {self.job_id} are taken")
        if self.membership.vacant_slots():
            raise NoFreeSlot("a failed worker's slot waits for its replacement")
        if self.ledger.completed + GROW_AHEAD_STEPS >= self.plan.steps:
            raise NoFreeSlot(f"job {self.job_id} ends before a worker could join it (step {self.ledger.completed})")

    def _joined(self, worker_id: int) -> None:
        """A worker took dropped slot ``worker_id`` back (the lock held): it contributes from ``GROW_AHEAD_STEPS``
        steps on, a step no PS shard can have begun; the slot's data is its own again from where it stands."""
        start = self.ledger.completed + GROW_AHEAD_STEPS
        live = sorted(wid for wid, _ in self.membership.occupied_workers())
        self._joining[worker_id] = start
        self._holding += 1  # until _grow has told every PS shard
        self.ledger.set_workers(start, live)
        self.data_shards.release(worker_id, start)
        plan = self._plan_at(start)
        self._journal(
            "workers_changed",
            from_step=start,
            ids=live,
            worker=worker_id,  # the one back
            joined=True,
            global_batch=plan.global_batch,
            scaled_lr=plan.scaled_lr,
            data_shards_done=[],
        )
        log.warning(
            "worker %d takes its dropped slot back: the job goes on with %d workers %s from step %d (global batch %d, "
            "lr %g)",
            worker_id,
            len(live),
            live,
            start,
            plan.global_batch,
            plan.scaled_lr,
        )

    def _grow(self, worker_id: int) -> None:
        """Tell every PS shard the workers from the returning worker's first step on (outside the lock);
        ``_joined`` started holding the answers to step reports until they know."""
        try:
            with self._cond:
                start = self._joining.get(worker_id)
                if start is None or self.state != JobState.RUNNING:
                    return
                ids, addresses = list(self.ledger.workers_at(start)), self.membership.ps_addresses()
                lr = self._plan_at(start).scaled_lr
            assert self._set_ps_workers is not None
            self._set_ps_workers(addresses, start, ids, lr)
        except Exception as exc:  # noqa: BLE001 - a shard that did not take the change would wait forever
            log.exception("telling the PS shards that worker %d is back failed", worker_id)
            self.fail(f"could not take worker {worker_id} back at step {start}: {exc}")
        finally:
            with self._cond:
                self._holding -= 1
                self._cond.notify_all()

    def _hold_reports(self) -> None:
        """Answer a step report only once the PS shards know about a returning worker (bounded)."""
        with self._cond:
            if self._holding:
                self._cond.wait_for(lambda: not self._holding, HOLD_REPORTS_S)

    def _returned(self, worker_id: int, step: int, inconsistent: str) -> Directive:
        """A worker that took a dropped slot back pulled ``step`` (the lock held): it must be its first step."""
        start = self._joining.pop(worker_id)
        if inconsistent or step != start:
            self.fail(f"worker {worker_id} cannot join at step {start}: {inconsistent or f'it pulled version {step}'}")
            return self._directive()
        self.membership.worker(worker_id).last_seen = self._clock()
        self._journal("worker_returned", worker=worker_id, step=step)
        log.info("worker %d trains from step %d in its slot again", worker_id, step)
        return self._directive()

    def _may_drop(self, worker_id: int) -> bool:
        """Whether failed ``worker_id``'s slot can be dropped (the lock held): ``min_workers`` workers stay."""
        live = [wid for wid, _ in self.membership.occupied_workers()]
        return self._set_ps_workers is not None and len(live) >= max(self.min_workers, 1)

    def _drop(self, worker_id: int) -> None:
        """Go on without failed ``worker_id`` from the step it did not report (``cluster.min_workers``).

        Every PS shard is told the workers of that step ``F`` less this one (a slot still waiting for its
        replacement stays in) and their LR from ``F`` on, then every later change (a worker's return pending
        at a later step), less this one, in step order; a shard keeps the failed worker's contribution to
        ``F`` if it arrived. If every piece kept it, ``F`` had the worker (its report is stood in) and the
        change counts from ``F + 1``; if no piece did, from ``F``; if some did and some not, the model would
        mix, so the job rolls back. The slot is positioned there and a live worker adopts its data, so every
        data shard is still dispatched once. No worker takes a slot back meanwhile (``_reshaping``), and a
        drop waits (the next liveness check) while a return's change is in flight.
        """
        with self._cond:
            member = self.membership.worker(worker_id)
            if self.state != JobState.RUNNING or not member.failed or member.dropped:
                return
            if self._reshaping or self._holding:
                return  # the next liveness check drops it
            first = self.ledger.first_unreported(worker_id)
            live = [w for w in self.ledger.workers_at(first) if w != worker_id]
            if not live:  # the only live worker is back in a dropped slot from a later step
                self.fail(f"no replacement for failed worker {worker_id} and no other worker trains step {first}")
                return
            member.dropped = True  # no replacement is waited for from here on
            self._reshaping = True
            self._joining.pop(worker_id, None)  # a worker back in a dropped slot failed before it began
            later = [
                (int(step), [int(w) for w in ids if w != worker_id])
                for step, ids in self.ledger.worker_sets()
                if step > first
            ]
            changes = [(first, live), *later]
            lrs = [replace(self.plan, workers=len(ids)).scaled_lr for _, ids in changes]
            addresses = self.membership.ps_addresses()
        try:
            self._shrink(worker_id, first, changes, lrs, addresses)
        finally:
            with self._cond:
                self._reshaping = False
                self._cond.notify_all()

    def _shrink(
        self, worker_id: int, first: int, changes: list[tuple[int, list[int]]], lrs: list[float], addresses: list[str]
    ) -> None:
        """``_drop``'s PS changes (outside the lock) and the ledger's, the data's and the journal's after them."""
        assert self._set_ps_workers is not None
        live = changes[0][1]
        try:
            kept = self._set_ps_workers(addresses, first, live, lrs[0])
            for (step, ids), lr in zip(changes[1:], lrs[1:], strict=True):
                self._set_ps_workers(addresses, step, ids, lr)
        except Exception as exc:  # noqa: BLE001 - any failure to tell a shard leaves the shards disagreeing
            log.exception("telling the PS shards to go on without worker %d failed", worker_id)
            self.fail(f"could not drop failed worker {worker_id}: {exc}")
            return
        every, some = all(k[0] for k in kept), any(k[1] for k in kept)
        if some and not every:
            self.fail(
                f"failed worker {worker_id} had pushed part of step {first} before it died: some pieces have its "
                f"gradient and others not, so the model cannot go on without it; rolling back"
            )
            return
        with self._cond:
            if self.state != JobState.RUNNING:
                return
            start = first + 1 if every else first
            if every:  # it pushed step F everywhere before it died: F had it
                stand_in = self.ledger.stand_in_report(worker_id, first, self._samples_per_worker)
                self._journal("report", False, report=asdict(stand_in))
                self._after_record(self.ledger.add(stand_in))
            occupied = {wid for wid, _ in self.membership.occupied_workers()}
            adopter = min((w for w in live if w in occupied), default=min(live))  # not a slot awaiting its replacement
            done = self.data_shards.adopt(worker_id, start, self._samples_per_worker, adopter, self._consumed(start))
            pending = [(step, ids) for step, ids in changes[1:] if step >= start]  # at start: a return wins
            self.ledger.note_workers(start, live)
            for step, ids in pending:
                self.ledger.note_workers(step, ids)
            last_step, last_ids = pending[-1] if pending else (start, live)
            record = self.ledger.set_workers(last_step, last_ids)  # completes a step they all reported
            plan = self._plan_at(start)
            self._journal(
                "workers_changed",
                from_step=start,
                ids=live,
                worker=worker_id,  # the one dropped
                adopter=adopter,
                later=[[step, ids] for step, ids in pending],
                global_batch=plan.global_batch,
                scaled_lr=plan.scaled_lr,
                data_shards_done=done,
            )
            self._journal_members()
            self._after_record(record)
            log.warning(
                "no replacement for worker %d within %.0fs: the job goes on with %d workers %s from step %d "
                "(global batch %d, lr %g; worker %d adopts its data; cluster.min_workers %d)",
                worker_id,
                self.replace_timeout_s,
                len(live),
                live,
                start,
                plan.global_batch,
                plan.scaled_lr,
                adopter,
                self.min_workers,
            )
            self._cond.notify_all()
            completed = self.ledger.completed
        if self._checkpoints is not None and record is not None:
            self._commit(completed)

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
            self._journal("job_over", state=self.state.name, message=reason)
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
            recent = [r.step_s for r in self.ledger.recent(RECENT_STEPS)]
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
                global_batch=self._plan_at(step).global_batch,
                lr=self._plan_at(step).lr_at(min(step, self.plan.steps - 1)),
                global_lr=self._plan_at(step).scaled_lr,
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

    def stop_waits(self) -> None:
        """The process is stopping: calls that wait for the cluster return now instead of at their deadline."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self) -> None:
        self.stop_waits()
        self.ledger.close()
        if self.journal is not None:
            self.journal.close()

    # ------------------------------------------------------------------ helpers

    def _check_not_over(self) -> None:
        if self.state.over:
            raise WrongState(f"job {self.job_id} is {self.state.name}: {self.message}")

    def _replaced_directive(self, worker_id: int) -> Directive:
        """To a worker declared failed that still talks (it was cut off): exit 1 and rejoin as its replacement."""
        return Directive(
            stop=True,
            state=JobState.FAILED,
            reason=f"worker {worker_id} was declared failed; restart to rejoin as its replacement",
            retryable=True,
        )

    def _directive(self) -> Directive:
        retryable = self.state == JobState.FAILED and self.failure_retryable
        return Directive(stop=self.state.over, state=self.state, reason=self.message, retryable=retryable)
