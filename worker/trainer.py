"""The worker's training loop: pull, compute on every device, sum on the host, push, report.

The trainer talks to the parameter server through ``ParameterServerClient`` only, so it runs
the same over gRPC and over in-memory shards (``tests/test_trainer.py``). It owns the retry of
a push or pull that found a shard ``Unavailable``: both calls are idempotent, and backing off
on the stop flag lets SIGTERM end a backoff at once.

A step whose loss or summed gradient is not finite is never pushed (``job.on_nonfinite``):
under ``skip`` the worker asks every shard to complete the step without an update
(``skip_step``), reports it ``nonfinite`` and trains on from the unchanged parameters; under
``stop`` it reports it ``nonfinite`` (the coordinator fails the job, naming step and worker)
and ends ``failed``.

``TrainerProgress.state``: starting -> training -> finished (the job's last step is done),
stopped (the stop flag, a coordinator directive, or a call cancelled by ``close(cancel=True)``
after a stop) or failed (a non-finite step under ``stop``, or a directive saying the job
FAILED). An error raised by ``run`` leaves the state as it was.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import LossFn
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.ps_api import Cancelled, ParameterServerClient, PsClientError, RetryPolicy, with_retries
from pstrain.worker import metrics
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import ReplicaSet

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RETRY = RetryPolicy()  # about 1.4 s of backoff over 3 repeats: a shard restarting


def step_is_finite(losses: list[float], grads: torch.Tensor) -> bool:
    """Whether the step's losses and summed gradient hold no NaN/Inf, by the shard's own test."""
    return all(math.isfinite(loss) for loss in losses) and all_finite(grads)


class StepReporter(Protocol):
    def report(self, report: pb.StepReport) -> pb.Directive: ...


@dataclass
class TrainerProgress:
    """What the Worker status RPC shows; written by the loop, read by the servicer."""

    step: int = 0
    last_step_s: float = 0.0
    state: str = "starting"


class Trainer:
    def __init__(
        self,
        worker_id: int,
        job: pb.JobSpec,
        replicas: ReplicaSet,
        ps: ParameterServerClient,
        feed: DataFeed,
        loss_fn: LossFn,
        reporter: StepReporter,
        stop: threading.Event,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self.worker_id = worker_id
        self.job = job
        self.replicas = replicas
        self.ps = ps
        self.feed = feed
        self.loss_fn = loss_fn
        self.reporter = reporter
        self.stop = stop
        self.retry = retry
        self.progress = TrainerProgress()
        self.restart_may_help = False  # the coordinator failed the job and says a cluster restart may mend it
        self.skip_nonfinite = job.on_nonfinite == "skip"  # else stop: the spec's default
        self._ran = 0  # steps this run() has completed

    def run(self) -> int:
        """Train until the job's last step or a stop; returns the number of steps this worker ran.

        To stop a trainer blocked in a pull, set ``stop``, then ``ps.close(cancel=True)``.
        """
        self._ran = 0
        try:
            self._train()
        except Cancelled:
            if not self.stop.is_set():
                raise  # the client was closed under a trainer nobody asked to stop
            self.progress.state = "stopped"
            log.info("worker %d stopped during a parameter-server call", self.worker_id)
        return self._ran

    def _train(self) -> None:
        version = self._retrying("pull", lambda: self.ps.pull(0, self.replicas.host_params))
        self.replicas.load_parameters()
        self.replicas.train()
        self.progress.state = "training"
        log.info("worker %d starts at step %d of %d", self.worker_id, version, self.job.steps)
        for step in range(version, self.job.steps):
            if self.stop.is_set():
                self.progress.state = "stopped"
                log.info("worker %d stopping before step %d", self.worker_id, step)
                return
            directive = self._step(step)
            if self.progress.state == "failed":
                return
            self._ran += 1
            if directive.stop and step + 1 < self.job.steps:
                log.warning("coordinator stopped the job at step %d: %s", step, directive.reason)
                self.progress.state = "failed" if directive.state == pb.FAILED else "stopped"
                self.restart_may_help = directive.retryable
                return
        self.progress.state = "finished"

    def _step(self, step: int) -> pb.Directive:
        started = time.perf_counter()
        devices = len(self.replicas)
        inputs, targets = self.feed.next_batch(self.job.per_device_batch * devices)
        losses = self.replicas.forward_backward(list(inputs.chunk(devices)), list(targets.chunk(devices)), self.loss_fn)
        grads = self.replicas.sum_gradients()
        computed = time.perf_counter()
        finite = step_is_finite(losses, grads)
        if not finite and not self.skip_nonfinite:
            return self._stop_nonfinite(step, losses, int(inputs.shape[0]), computed - started)
        if finite:
            self._retrying("push", lambda: self.ps.push(grads, self.worker_id, step, devices).wait())
        else:
            log.warning(
                "worker %d computed a non-finite loss or gradient at step %d; skipping the step "
                "(fault.on_nonfinite: skip)",
                self.worker_id,
                step,
            )
            self._retrying("skip", lambda: self.ps.skip_step(self.worker_id, step, devices).wait())
        pushed = time.perf_counter()
        self.feed.commit()
        self._retrying("pull", lambda: self.ps.pull(step + 1, self.replicas.host_params))
        pulled = time.perf_counter()
        self.replicas.load_parameters()
        elapsed = time.perf_counter() - started
        self.progress.step = step + 1
        self.progress.last_step_s = elapsed
        self._record(
            step,
            losses,
            int(inputs.shape[0]),
            computed - started,
            pushed - computed,
            pulled - pushed,
            elapsed,
            skipped=not finite,
        )
        return self.reporter.report(
            pb.StepReport(
                worker_id=self.worker_id,
                step=step,
                loss=sum(losses) / devices,
                samples=int(inputs.shape[0]),
                step_s=elapsed,
                nonfinite=not finite,
            )
        )

    def _stop_nonfinite(self, step: int, losses: list[float], samples: int, step_s: float) -> pb.Directive:
        """``on_nonfinite: stop``: push nothing, tell the coordinator (it fails the job), end ``failed``."""
        log.error(
            "worker %d computed a non-finite loss or gradient at step %d; fault.on_nonfinite: stop: "
            "nothing was pushed, the job stops",
            self.worker_id,
            step,
        )
        self.progress.state = "failed"
        directive = self.reporter.report(
            pb.StepReport(
                worker_id=self.worker_id,
                step=step,
                loss=sum(losses) / len(losses),
                samples=samples,
                step_s=step_s,
                nonfinite=True,
            )
        )
        if directive.reason:
            log.error("coordinator: %s", directive.reason)
        return directive

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call`` repeated after ``Unavailable`` per ``self.retry``; a stop ends the backoff."""

        def warn(exc: PsClientError, delay_s: float) -> None:
            log.warning("%s failed (%s), retrying in %.1fs", what, exc, delay_s)

        return with_retries(call, self.retry, self.stop.wait, warn)

    def _record(
        self,
        step: int,
        losses: list[float],
        samples: int,
        compute_s: float,
        push_s: float,
        pull_s: float,
        step_s: float,
        skipped: bool = False,
    ) -> None:
        model_bytes = self.job.total_params * 4
        metrics.COMPUTE_SECONDS.observe(compute_s)
        metrics.PULL_SECONDS.observe(pull_s)
        metrics.STEP_SECONDS.observe(step_s)
        metrics.BYTES_PULLED.inc(model_bytes)
        metrics.SAMPLES.inc(samples)
        metrics.STEP.set(step + 1)
        if skipped:
            metrics.SKIPPED_STEPS.inc()
        else:
            metrics.PUSH_SECONDS.observe(push_s)
            metrics.BYTES_PUSHED.inc(model_bytes)
            metrics.LOSS.set(sum(losses) / len(losses))
        log.debug("step %d: compute %.3fs push %.3fs pull %.3fs", step, compute_s, push_s, pull_s)
