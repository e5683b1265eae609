"""The step ledger: workers' step reports become one record per step, in metrics.jsonl and to watchers.

A step completes when every worker reported it; its record weighs each worker's loss by its
samples and times the step from the previous completion (step 0: from the start of training, or
the slowest worker's own step time if that is longer). Steps complete in order: a report for a
step past the next one is refused, a retried report of a recorded step is ignored, and a second
report of a pending step replaces the first.

Locking: the ledger shares the ``Job``'s condition (one lock for the whole job, so there is no
lock order to get wrong). ``add`` and ``start`` expect the caller to hold it; ``watch`` takes it
itself while it waits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pstrain.coordinator.errors import WrongState

if TYPE_CHECKING:
    from pstrain.coordinator.job import JobState


@dataclass(frozen=True)
class StepReport:
    """One worker's share of one step."""

    worker_id: int
    step: int
    loss: float  # mean over the worker's samples of this step
    samples: int
    step_s: float  # wall time of the step on this worker


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
    ) -> None:
        self.workers = workers
        self._lr_at = lr_at
        self._clock = clock
        self._cond = cond
        self._reports: dict[int, dict[int, StepReport]] = {}
        self._records: list[StepRecord] = []
        self._last_completion: float | None = None
        self._metrics = None
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open(metrics_path, "w", buffering=1)  # noqa: SIM115 - closed in close()

    @property
    def completed(self) -> int:
        return len(self._records)

    @property
    def records(self) -> list[StepRecord]:
        with self._cond:
            return list(self._records)

    def start(self) -> None:
        """Training begins now: step 0 is timed from here."""
        self._last_completion = self._clock()

    def add(self, report: StepReport) -> StepRecord | None:
        """Take one worker's report; returns the step's record when it was the last one missing."""
        completed = len(self._records)
        if report.step < completed:
            return None  # a retried report of a step already recorded
        if report.step > completed:
            raise WrongState(f"worker {report.worker_id} reported step {report.step} before step {completed} completed")
        pending = self._reports.setdefault(report.step, {})
        pending[report.worker_id] = report
        if len(pending) < self.workers:
            return None
        return self._complete(report.step)

    def _complete(self, step: int) -> StepRecord:
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
            lr=self._lr_at(step),
            global_batch=samples,
            samples_per_s=samples / step_s if step_s > 0 else 0.0,
            step_s=step_s,
        )
        self._records.append(record)
        if self._metrics is not None:
            self._metrics.write(json.dumps(asdict(record)) + "\n")
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

        def news() -> bool:
            return len(self._records) > sent or phase()[0].over

        while active():
            with self._cond:
                self._cond.wait_for(news, timeout=1.0)
                fresh = self._records[sent:]
                state, message = phase()
                completed = len(self._records)
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
