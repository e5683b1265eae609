"""Step reports whose figures cannot be true are refused before they reach the ledger (issue 8).

A worker reports the samples it trained on this step (at least one, at most its share of the
global batch), a finite loss unless it flags the step non-finite, and a finite, non-negative step
time. Anything else is ``InvalidRequest`` (INVALID_ARGUMENT) and leaves the job as it was; a step
the job has not reached is the ledger's to refuse (it knows the step being collected).
"""

from __future__ import annotations

import math

from pstrain.coordinator.errors import InvalidRequest
from pstrain.coordinator.ledger import StepReport


def check_step_report(report: StepReport, max_samples: int) -> None:
    """Raise ``InvalidRequest`` naming the first impossible figure of ``report``."""
    who = f"worker {report.worker_id}, step {report.step}"
    if not 1 <= report.samples <= max_samples:
        raise InvalidRequest(f"{who}: samples must be 1..{max_samples} (its share of the batch), got {report.samples}")
    if not report.nonfinite and not math.isfinite(report.loss):
        raise InvalidRequest(f"{who}: loss {report.loss} is not finite but the report is not flagged nonfinite")
    if not (math.isfinite(report.step_s) and report.step_s >= 0):
        raise InvalidRequest(f"{who}: step_s must be a finite duration >= 0, got {report.step_s}")
