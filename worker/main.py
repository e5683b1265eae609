"""``pstrain-worker``: one process per host, driving all of that host's devices.

Start order: serve status (NOT_SERVING) -> register with the coordinator -> wait until every
PS shard serves -> build one replica per device -> pull version 0 -> SERVING -> train to the
job's last step -> (worker 0) upload the model buffers -> exit 0. SIGTERM, even during a
blocked pull, cancels the in-flight PS calls and exits 0. A job the coordinator failed exits
1 when a restart of the cluster may mend it (a member died or restarted; the coordinator was
lost), so the unit restarts this worker to rejoin, and ``EXIT_JOB_FAILED`` (3) when a restart
would fail the same way (this worker computed a non-finite loss or gradient under
``fault.on_nonfinite: stop``, or cannot train the model: ``runtime/model_refusal.py``).
The skeleton (serve, ready, heartbeat, drain) is ``MemberProcess``; this module is the join.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from collections.abc import Callable

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime import host_pinning
from pstrain.runtime.factories import FactoryError, LossFn, build_dataset, build_model, resolve_loss
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.logs import configure_logging
from pstrain.runtime.member import (
    EXIT_JOB_FAILED,
    EXIT_RESTART,
    MemberProcess,
    add_member_flags,
    drain_waits_s,
    join_waits_s,
)
from pstrain.runtime.model_refusal import ModelUnsupported
from pstrain.runtime.ps_api import Cancelled, PsClientError
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.transport import CONTROL_TIMEOUT_S
from pstrain.worker.coordinator_link import CoordinatorLink
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.devices import DeviceError, resolve_devices
from pstrain.worker.probe import device_profile, run_probe
from pstrain.worker.replicas import MemoryPolicy, ReplicaSet
from pstrain.worker.row_store import host_row_store, probe_row_store, rejoin_rows_check
from pstrain.worker.service import WorkerServicer
from pstrain.worker.slot_buffers import SlotBufferCheckpoints
from pstrain.worker.trainer import Trainer

log = logging.getLogger(__name__)

TRAINER_JOIN_S = 30.0
"""After SIGTERM cancels its parameter-server calls, how long the trainer thread gets to leave the step it is in
(a forward/backward pass is not interruptible) before the worker drains without it."""


def start_waits_s(args: argparse.Namespace) -> float:
    """The longest the worker waits on others before READY=1: the coordinator (``join_waits_s``), then every PS
    shard (``--cluster-timeout-s``). Its own work (building the model, the memory probe) comes on top."""
    return join_waits_s(args) + float(args.cluster_timeout_s)


def worst_case_stop_s(grace_s: float) -> float:
    """The longest the worker's own waits hold its exit after SIGTERM: the trainer's step (``TRAINER_JOIN_S``),
    then the member's drain (``drain_waits_s``). The unit's TimeoutStopSec must exceed it, or systemd SIGKILLs a
    worker that is still draining."""
    return TRAINER_JOIN_S + drain_waits_s(grace_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pstrain-worker", description="Run the pstrain worker of this host.")
    p.add_argument("--devices", default="", help="comma-separated devices (cuda:0,cuda:1); default from the job")
    p.add_argument("--cluster-timeout-s", type=float, default=600.0, help="how long to wait for every PS shard")
    add_member_flags(p)
    return p.parse_args(argv)


def build_replicas(job: pb.JobSpec, devices: list[torch.device], layout: ParamLayout) -> ReplicaSet:
    memory = MemoryPolicy(dict(job.layer_policies), job.prefetch, job.pinned_limit_bytes, job.offload_params)
    if memory.layer_policies:
        log.info("memory plan: %s", ", ".join(f"{k}={v}" for k, v in sorted(memory.layer_policies.items())))
    return ReplicaSet(lambda: build_model(job.model_factory, job.model_kwargs_json), devices, layout, memory)


def probe_until_accepted(
    link: CoordinatorLink,
    job: pb.JobSpec,
    devices: list[torch.device],
    layout: ParamLayout,
    feed: DataFeed,
    loss_fn: LossFn,
) -> tuple[pb.JobSpec, ReplicaSet]:
    """S2.1: run one real iteration, report its peak, and follow the coordinator's verdicts."""
    limit = 0
    profiled = False
    while True:
        replicas = build_replicas(job, devices, layout)
        try:
            inputs, targets = feed.peek_batch(job.per_device_batch * len(devices))
            rows = probe_row_store(job, [r.model for r in replicas.replicas], devices)  # issue 9: seeded rows
            device_peak, host_peak = run_probe(replicas, inputs, targets, loss_fn, limit, rows)
            # issue 10: once, after the first measured iteration (its peak stays its own), the planner's profile
            profile = None if profiled else device_profile(job, devices[0], feed.peek_batch, loss_fn)
            verdict = link.report_probe(
                pb.ProbeReport(
                    worker_id=link.worker_id,
                    per_device_batch=job.per_device_batch,
                    device_peak_bytes=device_peak,
                    host_peak_bytes=host_peak,
                    limit_bytes=limit,
                    profile=profile,
                )
            )
            profiled = True  # sent once: the coordinator re-plans from it
        except BaseException:
            replicas.close()
            raise
        log.info("probe at batch %d: device peak %d B -> %s", job.per_device_batch, device_peak, verdict.message)
        if verdict.done and verdict.job == job:
            return job, replicas
        replicas.close()
        job, limit = verdict.job, verdict.limit_bytes
        if verdict.done:
            return job, build_replicas(job, devices, layout)


def run_interruptibly(trainer: Trainer, stop: threading.Event) -> int | None:
    """Train in a thread so SIGTERM is seen even while a pull waits for slower workers.

    Returns None when training reached the last step, else the exit code: 0 for an orderly
    stop (SIGTERM, or the coordinator ending the job), ``EXIT_JOB_FAILED`` when the job failed
    (a non-finite step under ``fault.on_nonfinite: stop``, a FAILED directive); an error
    training raised is raised again.
    """
    errors: list[BaseException] = []
    done = threading.Event()

    def train() -> None:
        try:
            trainer.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
        finally:
            done.set()
            stop.set()  # wakes the main thread

    thread = threading.Thread(target=train, name="trainer", daemon=True)
    thread.start()
    stop.wait()
    if not done.is_set():
        log.info("stopping: cancelling in-flight parameter-server calls")
        trainer.ps.close(cancel=True)
        thread.join(timeout=TRAINER_JOIN_S)
        return 0
    if errors:
        raise errors[0]
    if trainer.progress.state == "failed":
        return EXIT_RESTART if trainer.restart_may_help else EXIT_JOB_FAILED
    return None if trainer.progress.state == "finished" else 0


def train(member: MemberProcess, servicer: WorkerServicer, args: argparse.Namespace) -> int:
    """Join as a worker, train to the job's last step (or until stopped); the exit code."""
    link = CoordinatorLink(member.channel)
    requested = [d for d in args.devices.split(",") if d]
    reply = member.join(
        lambda: link.register(member.served.address, requested, socket.gethostname(), member.served.metrics_address)
    )
    job = reply.job
    if reply.replacement:
        log.info(
            "replacing failed worker %d at step %d, configured like it: devices %s, memory estimate %d B device, "
            "%d B host",
            reply.worker_id,
            reply.start_step,
            list(reply.devices),
            reply.device_memory_bytes,
            reply.host_memory_bytes,
        )
    devices = resolve_devices(requested or list(reply.devices) or list(job.devices), job.devices_per_worker)
    servicer.worker_id, servicer.devices = reply.worker_id, [str(d) for d in devices]
    log.info("registered as worker %d with devices %s", reply.worker_id, servicer.devices)
    member.start_heartbeat(
        reply.worker_id, job.heartbeat_s, stop_when_job_ends=False, coordinator_timeout_s=job.coordinator_timeout_s
    )
    link.patience_s, link.stop = job.coordinator_timeout_s, member.stop  # ride out a coordinator restart
    try:
        return train_registered(member, servicer, args, link, reply, devices)
    except ModelUnsupported as exc:
        log.error("%s", exc)
        directive = link.refuse_model(str(exc))
        if directive is not None:
            log.error("the job is %s: %s", pb.JobState.Name(directive.state), directive.reason)
        return EXIT_JOB_FAILED


def train_registered(
    member: MemberProcess,
    servicer: WorkerServicer,
    args: argparse.Namespace,
    link: CoordinatorLink,
    reply: pb.RegisterWorkerReply,
    devices: list[torch.device],
) -> int:
    """From the cluster's start to the job's end, as worker ``reply.worker_id``; the exit code."""
    cluster = link.wait_for_cluster(args.cluster_timeout_s)
    job = cluster.job  # final: the probe may have changed the batch and the memory plan
    layout = ParamLayout.of(build_model(job.model_factory, job.model_kwargs_json))
    if layout.total != job.total_params or list(layout.names) != [p.name for p in job.params]:
        raise FactoryError("this host's model factory builds a different model than the coordinator's")
    feed = DataFeed(build_dataset(job.data_factory, job.data_kwargs_json), link, not job.data_prefetch_off)
    member.closing(feed.close)
    loss_fn = resolve_loss(job.loss)
    if cluster.probe:
        job, replicas = probe_until_accepted(link, job, devices, layout, feed, loss_fn)
    else:
        replicas = build_replicas(job, devices, layout)
    member.closing(replicas.close)
    ps = PsClient(
        list(cluster.ps_addresses),
        job.total_params,
        job.chunk_bytes,
        job.push_timeout_s,
        job.pull_timeout_s,
        security=member.served.security,
        push_dtype=torch.bfloat16 if job.push_dtype == pb.BFLOAT16 else torch.float32,  # issue 12
        shared_memory=not job.shared_memory_off,  # issue 12: colocated shards through /dev/shm
        bulk=not job.bulk_sockets_off,  # issue 12: remote shards' payloads on raw TCP (transport.bulk_sockets)
        pinning=host_pinning.for_devices(devices) if replicas.places_on_device else None,  # issue 12: one GPU
    )
    member.closing(lambda: ps.close(cancel=True))  # a pull left waiting on a failed step must not hold the exit
    rows_check = rejoin_rows_check(job, cluster.ps_addresses, reply.worker_id, member.served.security)  # issue 9
    trainer = Trainer(reply.worker_id, job, replicas, ps, feed, loss_fn, link, member.stop)
    if reply.replacement:
        trainer.start_at = rejoin(member, reply.worker_id, ps, job.total_params, rows_check, reply.start_step)
        if trainer.start_at is None:
            return EXIT_RESTART
    trainer.sparse = host_row_store(  # issue 9: sparse embedding rows, when the job declares tables
        job,
        cluster.ps_addresses,
        reply.worker_id,
        [r.model for r in replicas.replicas],
        devices,
        member.served.security,
    )
    trainer.buffers = SlotBufferCheckpoints.of(link, replicas, job)  # issue 11: buffers in the checkpoints
    if trainer.sparse is not None:
        member.closing(lambda: trainer.sparse.client.close(cancel=True))  # type: ignore[union-attr]
    servicer.progress = trainer.progress
    member.ready()
    outcome = run_interruptibly(trainer, member.stop)
    if member.aborted.is_set():
        return member.abort_exit_code
    if outcome is not None:
        return outcome
    buffers = replicas.buffers()
    if reply.worker_id == 0 and buffers:
        link.upload_buffers(buffers, job.chunk_bytes)
    log.info("worker %d finished at step %d", reply.worker_id, trainer.progress.step)
    return 0


def rejoin(
    member: MemberProcess,
    worker_id: int,
    ps: PsClient,
    total_params: int,
    rows_check: Callable[[int], str] | None = None,
    start_step: int = 0,
) -> int | None:
    """S2.5: a replacement pulls the version its slot goes on from and tells the coordinator, which positions
    the slot's data there; that version, or None when the job cannot go on in place (the coordinator rolls it
    back).

    ``start_step`` is the slot's first unreported step. A dense job goes on from the step after it when the
    failed predecessor had pushed it to every piece (its push stays counted; the coordinator stands in for its
    report), else it redoes that step: the pieces the predecessor had pushed it to are one version ahead and
    serve the version before (``pull_at``), so the replacement computes the same gradient on the same samples
    (its pushes to those pieces are duplicates) and the result equals the fault-free run however far the push
    got. (Data shards are completed only after a step's whole push, so a step pushed to some pieces completed
    none.) A job with sparse tables pulls the newest common version, since its row shards keep their own step
    (``rows_check(version)``, issue 9, ``row_store.rows_behind``: why the tables cannot go on there)."""
    inconsistent = ""
    params = torch.empty(total_params, dtype=torch.float32)
    if rows_check is None:
        version = start_step
        try:
            version = start_step + 1 if ps.contributed(worker_id) >= start_step else start_step
            ps.pull_at(version, params)
        except Cancelled:
            raise  # this process is stopping: not a reason to roll the job back
        except PsClientError as exc:  # a shard two versions past it, restarting, or silent: roll back
            inconsistent = str(exc)
    else:
        try:
            version = ps.pull(start_step, params)  # issue 11: a slot taken back
        except Cancelled:
            raise
        except (RuntimeError, PsClientError) as exc:  # the shards disagree: the failed worker pushed to some only
            version, inconsistent = -1, str(exc)
        if not inconsistent:
            inconsistent = rows_check(version)
    directive = member.coordinator.RejoinAt(
        pb.RejoinRequest(worker_id=worker_id, step=version, inconsistent=inconsistent), timeout=CONTROL_TIMEOUT_S
    )
    if directive.stop:
        log.error("cannot take over the slot of worker %d: %s", worker_id, directive.reason)
        return None
    log.info("worker %d takes over its slot at step %d", worker_id, version)
    return version


def run(args: argparse.Namespace) -> int:
    servicer = WorkerServicer(devices=[])
    member = MemberProcess(
        args,
        "worker",
        [(pb_grpc.add_WorkerServicer_to_server, servicer)],
        ["Worker"],
        (DeviceError, FactoryError, PsClientError),
    )
    return member.run(lambda member: train(member, servicer, args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("pstrain-worker", args.log_level)
    MemberProcess.freeze_gc_when_ready = True  # its own process: ready() freezes the start-up objects
    return run(args)
