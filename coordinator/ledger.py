"""The step ledger: workers' step reports become one record per step, in metrics.jsonl and to watchers.

A step completes when every worker reported it; its record weighs each worker's loss by its
samples and times the step from the previous completion (step 0: from the start of training, or
the slowest worker's own step time if that is longer). Steps complete in order: a report for a
step past the next one is refused, a retried report of a recorded step is ignored, and a second
report of a pending step replaces the first. With ``lookahead`` n, a worker that reported every
step up to one may report up to n steps past the next one (a worker that overlaps its pull with
the next step reports step t + 1 before a slower peer's report of t arrives); they wait, pending.

The workers a step waits for are all of them until ``set_workers(from_step, ids)`` changes the set
(``cluster.min_workers``: a failed worker dropped, issue 11); each record says how many workers it had.

A step that some worker reported ``nonfinite`` (it saw a NaN/Inf loss or gradient and asked the
PS to skip the step, ``fault.on_nonfinite: skip``) is recorded as skipped: its loss is NaN in the
record and ``null`` in metrics.jsonl (NaN is not JSON), ``"skipped": true``. Under ``stop`` such a
report never gets here: the Job fails first.

Locking: the ledger shares the ``Job``'s condition (one lock for the whole job, so there is no
lock order to get wrong). ``add`` and ``start`` expect the caller to hold it; ``watch`` takes it
itself while it waits.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pstrain.coordinator.errors import WrongState
from pstrain.runtime.atomic_io import atomic_write

if TYPE_CHECKING:
    from pstrain.coordinator.job import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """One worker's share of one step."""

    worker_id: int
    step: int
    loss: float  # mean over the worker's samples of this step
    samples: int
    step_s: float  # wall time of the step on this worker
    nonfinite: bool = False  # the worker's loss or gradient was NaN/Inf: it did not push this step


@dataclass(frozen=True)
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    loss: float
    lr: float
    global_batch: int
    samples_per_s: float
    step_s: float
    skipped: bool = False  # a worker saw a non-finite loss or gradient: no update; ``loss`` is NaN
    workers: int = field(default=0, compare=False)  # the step's workers (cluster.min_workers); 0: not recorded

    def to_json(self) -> str:
        """The metrics.jsonl line: strict JSON, so a NaN loss (a skipped step) is written as null."""
        fields = asdict(self)
        if not math.isfinite(self.loss):
            fields["loss"] = None
        return json.dumps(fields)

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        """A metrics.jsonl line back into a record (``to_json``'s inverse: null loss -> NaN)."""
        fields = json.loads(line)
        if fields.get("loss") is None:
            fields["loss"] = math.nan
        return cls(**fields)


@dataclass(frozen=True)
class Progress:
    """What ``watch`` yields: a completed step's record, or (``record`` None) the job's final state."""

    record: StepRecord | None
    completed: int  # steps completed when this was sent
    state: JobState
    message: str


class StepLedger:
    def __init__(
        self,
        workers: int,
        lr_at: Callable[[int], float],
        metrics_path: Path | None,
        clock: Callable[[], float],
        cond: threading.Condition,
        start_step: int = 0,
        lookahead: int = 0,
    ) -> None:
        self.workers = workers
        self._sets: list[tuple[int, tuple[int, ...]]] = [(0, tuple(range(workers)))]  # (from step, worker ids)
        self.lookahead = lookahead
        self._lr_at = lr_at
        self._clock = clock
        self._cond = cond
        self._reports: dict[int, dict[int, StepReport]] = {}
        self._records: list[StepRecord] = []
        self._offset = start_step  # steps completed before this ledger (a resumed job); not in _records
        self._last_completion: float | None = None
        self._metrics = None
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = self._open_metrics(metrics_path, start_step)
        self._skipped = sum(record.skipped for record in self._records)  # kept as records come: status asks often

    def _open_metrics(self, path: Path, start_step: int) -> IO[str]:
        """A fresh metrics.jsonl, or (resuming at ``start_step``) its records of the steps before ``start_step``.

        Records of later steps belong to steps that will be trained again, so they are dropped (atomically) and
        come back as the steps complete anew. Kept by the step they record, not by line: a file that was short at
        an earlier resume (a host crash lost its unsynced tail) no longer has line ``i`` for step ``i``. The file
        keeps one record per earlier step (a step recorded twice: its later record), in step order; a line a crash
        tore is skipped. The ledger's own records are the unbroken run of them that ends at ``start_step - 1`` (its
        records are one per step from ``_offset`` on); with a gap just before the resume, none.
        """
        if start_step == 0 or not path.exists():
            return open(path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        by_step: dict[int, str] = {}
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                record = StepRecord.from_json(line)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("%s line %d is not a step record (a crash tore it?): skipped (%s)", path, number, exc)
                continue
            if record.step < start_step:
                by_step[record.step] = line
        first = start_step
        while first - 1 in by_step:
            first -= 1
        self._records = [StepRecord.from_json(by_step[step]) for step in range(first, start_step)]
        self._offset = first
        kept = [by_step[step] for step in sorted(by_step)]
        atomic_write(path, lambda fh: fh.write("".join(line + "\n" for line in kept).encode()))
        return open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    @property
    def completed(self) -> int:
        return self._offset + len(self._records)

    @property
    def skipped_steps(self) -> int:
        """Recorded steps that completed without an update (a non-finite loss or gradient)."""
        return self._skipped

    @property
    def records(self) -> list[StepRecord]:
        with self._cond:
            return list(self._records)

    def recent(self, count: int) -> list[StepRecord]:
        """The last ``count`` records: what status and the metrics read at every call, without copying every
        record of a long job (a million steps is a million-entry copy per scrape)."""
        with self._cond:
            return self._records[-count:] if count > 0 else []

    def start(self) -> None:
        """Training begins now: step 0 is timed from here."""
        self._last_completion = self._clock()

    def add(self, report: StepReport) -> StepRecord | None:
        """Take one worker's report; returns the step's record when it was the last one missing."""
        completed = self.completed
        if report.step < completed:
            return None  # a retried report of a step already recorded
        ahead = report.step > completed + self.lookahead or report.step > self.first_unreported(report.worker_id)
        if report.step > completed and ahead:
            raise WrongState(f"worker {report.worker_id} reported step {report.step} before step {completed} completed")
        if report.worker_id not in self.workers_at(report.step):
            raise WrongState(f"worker {report.worker_id} is not among step {report.step}'s workers")
        self._reports.setdefault(report.step, {})[report.worker_id] = report
        return self._complete_ready()

    def _complete_ready(self) -> StepRecord | None:
        record = None
        while set(self.workers_at(self.completed)) <= self._reports.get(self.completed, {}).keys():
            record = self._complete(self.completed)
        return record

    def workers_at(self, step: int) -> tuple[int, ...]:
        """The workers step ``step`` waits for."""
        return next(ids for start, ids in reversed(self._sets) if start <= step)

    def set_workers(self, from_step: int, ids: list[int] | tuple[int, ...]) -> StepRecord | None:
        """From ``from_step`` on, steps wait for ``ids`` only; a pending step they all reported completes now
        (returns its record). Reports of dropped workers for those steps are discarded."""
        if from_step < self.completed:
            raise WrongState(f"step {from_step} is recorded already; the workers change from step {self.completed}")
        wanted = self.note_workers(from_step, ids)
        for step, reports in self._reports.items():
            if step >= from_step:
                for worker_id in [w for w in reports if w not in wanted]:
                    del reports[worker_id]
        return self._complete_ready()

    def note_workers(self, from_step: int, ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        """Record the change only (a journal replayed: the reports come after it)."""
        wanted = tuple(sorted(set(ids)))
        self._sets = [(start, old) for start, old in self._sets if start < from_step] + [(from_step, wanted)]
        return wanted

    def worker_sets(self) -> list[list[Any]]:
        """The changes of the worker set as plain JSON (the journal's snapshot)."""
        return [[start, list(ids)] for start, ids in self._sets]

    def restore_worker_sets(self, sets: list[list[Any]]) -> None:
        self._sets = [(int(start), tuple(int(i) for i in ids)) for start, ids in sets]

    def first_unreported(self, worker_id: int) -> int:
        """The first step ``worker_id`` has not reported (the held step, or the one after if it reported it)."""
        step = self.completed
        while worker_id in self._reports.get(step, {}):
            step += 1
        return step

    def missing(self, step: int) -> list[int]:
        """The workers whose report of ``step`` (not recorded yet) has not arrived."""
        return [w for w in self.workers_at(step) if w not in self._reports.get(step, {})]

    def pending_reports(self) -> list[StepReport]:
        """Reports of steps not recorded yet, by step (the journal's snapshot: a restarted coordinator keeps them)."""
        return [report for step in sorted(self._reports) for report in self._reports[step].values()]

    def stand_in(self, worker_id: int, step: int, samples: int) -> StepRecord | None:
        """Report ``step`` for a failed worker that pushed it but died before reporting (S2.5); its loss is
        taken as the mean of the others' (the model is exact, only this record's loss is estimated)."""
        return self.add(self.stand_in_report(worker_id, step, samples))

    def stand_in_report(self, worker_id: int, step: int, samples: int) -> StepReport:
        """The report ``stand_in`` adds (the Job journals it, so a restarted coordinator has it too)."""
        pending = self._reports.get(step, {})
        others = [r for w, r in pending.items() if w != worker_id]
        loss = sum(r.loss for r in others) / len(others) if others else math.nan
        return StepReport(worker_id=worker_id, step=step, loss=loss, samples=samples, step_s=0.0)

    def _complete(self, step: int) -> StepRecord:
        reports = list(self._reports.pop(step).values())
        samples = sum(r.samples for r in reports)
        skipped = any(r.nonfinite for r in reports)
        loss = math.nan if skipped else sum(r.loss * r.samples for r in reports) / max(samples, 1)
        now = self._clock()
        interval = now - self._last_completion if self._last_completion is not None else 0.0
        step_s = max(interval, max(r.step_s for r in reports)) if step == 0 else interval
        self._last_completion = now
        record = StepRecord(
            step=step,
            loss=loss,
            lr=self._lr_at(step),
            global_batch=samples,
            samples_per_s=samples / step_s if step_s > 0 else 0.0,
            step_s=step_s,
            skipped=skipped,
            workers=len(self.workers_at(step)),
        )
        self._records.append(record)
        self._skipped += record.skipped
        if self._metrics is not None:
            self._metrics.write(record.to_json() + "\n")
        self._cond.notify_all()
        return record

    def watch(
        self, from_step: int, active: Callable[[], bool], phase: Callable[[], tuple[JobState, str]]
    ) -> Iterator[Progress]:
        """Yield records from ``from_step`` as they complete, then the final state once ``phase`` is over.

        ``phase`` reads the job's state and message; it is called with the condition held, so
        records and state are one snapshot. ``active`` false (the watcher left) ends the stream.
        """
        sent = max(0, from_step)

        sent = max(sent, self._offset)  # steps before a resume without metrics lines are not replayed

        def news() -> bool:
            return self.completed > sent or phase()[0].over

        while active():
            with self._cond:
                self._cond.wait_for(news, timeout=1.0)
                fresh = self._records[sent - self._offset :]
                state, message = phase()
                completed = self.completed
            for record in fresh:
                yield Progress(record, completed, state, message)
            sent += len(fresh)
            if state.over and sent >= completed:
                yield Progress(None, completed, state, message)
                return

    def close(self) -> None:
        with self._cond:
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None
