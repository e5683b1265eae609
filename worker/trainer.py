"""The worker's training loop: pull, compute on every device, sum on the host, push, report.

S4 (``worker.overlap``): the push and the pull run per gradient bucket and overlap the compute.
A step is: forward (each module first waits for its buckets of the version this step trains on),
backward (each bucket is summed on the host and pushed as soon as backward has produced it, and
its pull of the next version starts right behind the push), then the wait for the pushes' acks.
The per-phase figures are compute, exposed push (the wait after backward) and exposed pull (the
time forward waited for buckets); non-finite handling per bucket is described in ``overlap``.
As before S4, a step counts as done (``run``'s count, ``progress.step``) once the parameters it
produced have all arrived, which is now during the next step's forward (or at the end of the run).
The step report goes to the coordinator in the background (issue 12: a control RPC off the critical
path); its directive is read after the next forward, before that step pushes anything.

The trainer talks to the parameter server through ``ParameterServerClient`` only, so it runs
the same over gRPC and over in-memory shards (``tests/test_trainer.py``). It owns the retry of
a push or pull that found a shard ``Unavailable``: both calls are idempotent, and backing off
on the stop flag lets SIGTERM end a backoff at once.

A non-finite loss or gradient bucket is never pushed (``job.on_nonfinite``): under ``skip``
the worker asks the shards to complete the step without an update for every piece not yet
pushed, reports it ``nonfinite`` and trains on; under ``stop`` it reports it ``nonfinite`` (the
coordinator fails the job, naming step and worker) and ends ``failed``.

``TrainerProgress.state``: starting -> training -> finished (the job's last step is done),
stopped (the stop flag, a coordinator directive, or a call cancelled by ``close(cancel=True)``
after a stop) or failed (a non-finite step under ``stop``, or a directive saying the job
FAILED). An error raised by ``run`` leaves the state as it was.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.buckets import Bucket, plan_buckets
from pstrain.runtime.factories import LossFn
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.ps_api import (
    RETRYABLE,
    Cancelled,
    ParameterServerClient,
    PsClientError,
    RetryPolicy,
    with_retries,
)
from pstrain.worker import metrics
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.overlap import BucketLoader, BucketPusher, StepPushes
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.row_store import HostRowStore
from pstrain.worker.slot_buffers import SlotBufferCheckpoints

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
        self._unloaded: int | None = None  # the step whose new parameters are still being pulled (S4)
        self.sparse: HostRowStore | None = None  # issue 9: the host's embedding rows, when the job has tables
        # Issue 12: a step's report goes out in the background; its directive is read before the next step pushes.
        self._reporting: ThreadPoolExecutor | None = None  # one thread per run(), shut down when it returns
        self._report: Future[pb.Directive] | None = None
        self.buffers: SlotBufferCheckpoints | None = None  # issue 11: the slot's buffers in the checkpoints
        self.start_at: int | None = None  # S2.5: a replacement's version (``pull_at``); None: the newest
        self.plan = plan_buckets(replicas.layout, ps.ranges, job.bucket_bytes)
        self.pusher = BucketPusher(
            self.plan,
            len(replicas),
            ps,
            worker_id,
            replicas.host_grads,
            replicas.host_params,
            replicas.staging,
            self.skip_nonfinite,
            place_on_device=replicas.places_on_device,
            push_dtype=torch.bfloat16 if job.push_dtype == pb.BFLOAT16 else torch.float32,
        )
        self.loader = BucketLoader(self.plan, len(replicas), replicas.host_params)
        replicas.attach(self.plan, self.pusher, self.loader)

    def run(self) -> int:
        """Train until the job's last step or a stop; returns the number of steps this worker ran.

        To stop a trainer blocked in a pull, set ``stop``, then ``ps.close(cancel=True)``.
        """
        self._ran = 0
        self._unloaded = None
        self._reporting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-report")
        try:
            try:
                self._train()
            except BaseException:
                with contextlib.suppress(Exception):  # the report in flight is sent; the error raised is training's
                    self._wait_report()
                raise
            self._wait_report()  # every report has reached the coordinator before run returns
        except Cancelled:
            if not self.stop.is_set():
                raise  # the client was closed under a trainer nobody asked to stop
            self.progress.state = "stopped"
            log.info("worker %d stopped during a parameter-server call", self.worker_id)
        finally:
            self._reporting.shutdown(wait=False)  # the last report was waited for above; its thread ends now
            self._reporting = None
            self.pusher.close()  # the bucket sender's thread ends too (a later run makes a new one)
        return self._ran

    def _train(self) -> None:
        version = self.start_at
        if version is None:
            version = self._retrying("pull", lambda: self.ps.pull(0, self.replicas.host_params))
        else:  # a replacement (S2.5): exactly the version it rejoined at, though some pieces may be one past it
            self._retrying("pull", lambda: self.ps.pull_at(version, self.replicas.host_params))
        self.replicas.load_parameters()
        if self.buffers is not None:
            self.buffers.restore(version)  # a resumed slot's buffers back, before its first forward
        self.replicas.train()
        self.progress.state = "training"
        log.info("worker %d starts at step %d of %d", self.worker_id, version, self.job.steps)
        for step in range(version, self.job.steps):
            if self.stop.is_set():
                self._load_all()
                self.progress.state = "stopped"
                log.info("worker %d stopping before step %d", self.worker_id, step)
                return
            directive = self._step(step)
            if self.progress.state == "failed":
                return
            if directive is not None:  # the previous step's directive stopped the job, or the stop flag: no push
                if directive.stop:
                    log.warning("coordinator stopped the job at step %d: %s", step - 1, directive.reason)
                else:
                    log.info("worker %d stopping before step %d", self.worker_id, step)
                self._load_all()
                self.progress.state = "failed" if directive.state == pb.FAILED else "stopped"
                self.restart_may_help = directive.retryable
                return
        self._wait_report()  # the last step's directive: the job is over whatever it says
        self._load_all()  # the last step's pulls: the replicas end on the final parameters
        self.progress.state = "finished"

    def _loaded(self) -> None:
        """The new parameters of the pending step have all arrived: as before S4, that is when a step is done."""
        if self._unloaded is not None:
            self._ran += 1
            self.progress.step = self._unloaded + 1
            self._unloaded = None

    def _step(self, step: int) -> pb.Directive | None:
        """One step; None once its report is on its way, else why nothing was pushed (or the non-finite report's
        directive): the previous step's directive stopped the job, the stop flag was set, or ``on_nonfinite: stop``."""
        started = time.perf_counter()
        devices = len(self.replicas)
        inputs, targets = self.feed.next_batch(self.job.per_device_batch * devices)
        if step + 1 < self.job.steps:  # data.prefetch: the next step's batch is read while this one computes
            self.feed.prefetch(self.job.per_device_batch * devices)
        if self.sparse is not None:  # issue 9: pull this host batch's embedding rows, bind them per device
            self.sparse.prepare(step, list(inputs.chunk(devices)), self._retrying)
        kept = self.replicas.keep_buffers() if self.skip_nonfinite else None  # a skipped step moves no statistics
        losses = self.replicas.forward(list(inputs.chunk(devices)), list(targets.chunk(devices)), self.loss_fn)
        pull_s = max(self.loader.waited_s)  # forward's waits for this step's buckets: the exposed pull
        self._loaded()  # forward loaded every bucket of this step's version: the previous step is done
        if self.stop.is_set():
            self.replicas.drop_losses()
            return self._wait_report()
        if all(math.isfinite(loss) for loss in losses):
            # The previous step's report went out during this forward; its directive is read by the sender before
            # this step's first push (``BucketPusher.start``), so the coordinator's answer may come during backward.
            self.pusher.start(step, self._report)
            self.replicas.backward()  # every bucket is pushed as backward completes it
            computed = time.perf_counter()
            pushes = self.pusher.finish()
            previous = self._wait_report()  # raises the report's error; then nothing was pushed
            if previous.stop:  # the sender saw it before any push: this step pushed nothing
                return previous
        else:
            self.replicas.drop_losses()
            previous = self._wait_report()
            if previous.stop:
                return previous
            if not self.skip_nonfinite:
                return self._stop_nonfinite(step, losses, int(inputs.shape[0]), time.perf_counter() - started)
            if kept is not None:  # the forward of a NaN batch moved BatchNorm's running statistics to NaN for good
                kept.restore()
            computed = time.perf_counter()
            pushes = self.pusher.skip_all(step, devices)
        finite = pushes.finite and (self.sparse is None or self.sparse.finite())  # issue 9: rows too
        if self.sparse is not None:  # issue 9: row gradients + counts, after the dense buckets (sparse_checkpoint.py)
            self.sparse.push(step, not finite, self._retrying)
        self._wait_pushes(pushes, devices)
        pushed = time.perf_counter()
        if not finite and not self.skip_nonfinite:
            return self._stop_nonfinite(step, losses, int(inputs.shape[0]), pushed - started)
        if not finite:
            self._warn_nonfinite(step, pushes)
        self.feed.commit()
        self.loader.arm(step + 1, pushes.pulls, self._repull)
        self._unloaded = step
        elapsed = time.perf_counter() - started
        self.progress.last_step_s = elapsed
        self._record(
            step,
            losses,
            int(inputs.shape[0]),
            computed - started - pull_s,
            pushed - computed,
            pull_s,
            elapsed,
            skipped=not finite,
        )
        if self.buffers is not None:
            self.buffers.after_step(step)  # a checkpoint step's buffers go up before its report
        report = pb.StepReport(
            worker_id=self.worker_id,
            step=step,
            loss=sum(losses) / devices,
            samples=int(inputs.shape[0]),
            step_s=elapsed,
            nonfinite=not finite,
        )
        assert self._reporting is not None  # inside run()
        self._report = self._reporting.submit(self.reporter.report, report)
        return None

    def _wait_report(self) -> pb.Directive:
        """The directive answering the step report in flight (an empty one if none is): off the critical path.

        ``_step`` sends a report in the background; the next step's pushes wait for its directive (the bucket
        sender reads it before the step's first push, while backward runs), so a directive that stops the job
        still stops it before any further push. The trainer reads it here after backward (or, for a step whose loss
        is not finite, before it pushes its skips); a report's error is raised here.
        """
        pending, self._report = self._report, None
        return pb.Directive() if pending is None else pending.result()

    def _wait_pushes(self, pushes: StepPushes, devices: int) -> None:
        """Wait for every bucket's acknowledgements; a bucket a shard could not take now is pushed again."""
        for bucket, skipped, handle in pushes.handles:
            try:
                handle.wait()
            except RETRYABLE:

                def again(bucket: Bucket = bucket, skipped: bool = skipped) -> object:
                    if skipped:
                        return self.ps.skip_pieces(bucket.pieces, self.worker_id, pushes.step, devices).wait()
                    grads = self.pusher.host_gradient(pushes, bucket)  # the host sum the first try pushed
                    return self.ps.push_pieces(grads, bucket.pieces, self.worker_id, pushes.step, devices).wait()

                self._retrying("push", again)
        self.pusher.pull_missing(pushes)

    def _repull(self, bucket: Bucket, version: int) -> int:
        """A bucket's pull failed with a retryable error: pull it again, with the trainer's retries."""
        return self._retrying(
            "pull", lambda: self.ps.pull_pieces(version, self.replicas.host_params, bucket.pieces).wait()
        )

    def _load_all(self) -> None:
        """Wait for every outstanding bucket pull and load it into every replica."""
        for index, r in enumerate(self.replicas.replicas):
            self.loader.ensure_all(index, functools.partial(r.load_bucket, self.replicas.host_params))
        self._loaded()

    def _warn_nonfinite(self, step: int, pushes: StepPushes) -> None:
        applied = sum(b.numel for b, skipped, _ in pushes.handles if not skipped)
        log.warning(
            "worker %d computed a non-finite loss or gradient at step %d; skipping the step "
            "(fault.on_nonfinite: skip)%s",
            self.worker_id,
            step,
            f"; {applied} of {self.plan.total} gradient values were pushed before it was seen (partial update; "
            f"transport.bucket_bytes: 0 avoids that)"
            if applied
            else "",
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
        model_bytes = self.job.total_params * 4  # pulled as float32; pushed as the job's push dtype, as a shard counts
        pushed_bytes = self.job.total_params * (2 if self.job.push_dtype == pb.BFLOAT16 else 4)
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
            metrics.BYTES_PUSHED.inc(pushed_bytes)
            metrics.LOSS.set(sum(losses) / len(losses))
        log.debug("step %d: compute %.3fs push %.3fs pull %.3fs", step, compute_s, push_s, pull_s)
