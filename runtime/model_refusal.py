"""A model the worker cannot train, in a way that a restart would repeat.

Workers raise ``ModelUnsupported`` where they find such a model (a parameter read before its bucket was
loaded, one reused across reentrant checkpoints, weights tied under ``memory.offload_params``). The worker
then tells the coordinator (``RefuseModel``), which fails the job as not retryable. Every member then exits
``EXIT_JOB_FAILED`` (3), and neither systemd nor ``pstrain local`` restarts it: a restarted worker would fail
the same way, and a plain error would have had it restarted in a loop.
"""

from __future__ import annotations

MAX_REASON_CHARS = 4000
"""The longest reason a refusal may carry: it becomes the job's message, which ``pstrain status`` shows."""


class ModelUnsupported(RuntimeError):
    """The user's model does something pstrain cannot train; the message says what and what to change."""
