"""``pstrain-coordinator``: plan the job, admit members, hand out data, end the job.

Runs until the job is FINISHED (model exported, every PS shard told to stop) or FAILED;
exits 0 or 1 accordingly. SIGTERM stops it early with health NOT_SERVING and a drain, without failing
the job: its journal stays usable, and a coordinator started again (``--recover auto``) takes it back.

Restarted after it died mid-job (``--recover auto``, the default), it takes the job back from
``<out>/journal.jsonl`` and the last committed checkpoint, with the job key it kept in
``<out>/job.key`` (0600), so the members' credentials stay valid and they go on without a
rollback. Without a usable journal, or with ``--recover never`` (what ``pstrain local`` passes
when it starts a whole cluster), it resumes from the last committed checkpoint as before.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import uuid
from pathlib import Path

import torch

from pstrain.coordinator.checkpoints import (
    CheckpointLedger,
    CheckpointMismatch,
    JobIdentity,
    Manifest,
    resume_point,
)
from pstrain.coordinator.config import JobConfig, load_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.job import Job, JobState
from pstrain.coordinator.journal import JOURNAL_NAME, JournalUnusable, Recovery, recovery
from pstrain.coordinator.metrics import register_job_metrics
from pstrain.coordinator.plan import job_spec
from pstrain.coordinator.planning import describe, plan_job, probe_setup
from pstrain.coordinator.preflight import preflight
from pstrain.coordinator.service import CoordinatorServicer, address_answers, ps_worker_setter
from pstrain.coordinator.table_export import attach_table_export
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.dir_lock import COORDINATOR, DirectoryBusy, hold_directory
from pstrain.runtime.identity import IdentityHolder, MemberKeys, MemberRegistry
from pstrain.runtime.lifecycle import add_common_flags, sd_notify, stop_on_signals, write_port_file
from pstrain.runtime.logs import configure_logging
from pstrain.runtime.member import CONNECT_TIMEOUT_S, EXIT_JOB_FAILED, freeze_startup_objects, metrics_address_of
from pstrain.runtime.metrics import serve_metrics
from pstrain.runtime.ps_api import RetryPolicy, with_retries
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.security import INSECURE, SecurityError, TransportSecurity, security_from_args
from pstrain.runtime.transport import BindError, PortInUse, host_of, start_server

log = logging.getLogger(__name__)


def worst_case_stop_s(grace_s: float, linger_s: float, heartbeat_s: float) -> float:
    """The longest the coordinator's own waits hold its exit after SIGTERM: the liveness loop's slice
    (``transport.heartbeat_s``); a job that just ended first lingers for its shards (``--linger-s``, which no
    signal cuts short); then the server's grace. The unit's TimeoutStopSec must exceed it."""
    return heartbeat_s + linger_s + grace_s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pstrain-coordinator", description="Run the pstrain coordinator of one job.")
    p.add_argument("--config", required=True, help="job file (YAML)")
    p.add_argument("--out", help="directory for model.pt and metrics.jsonl")
    p.add_argument("--steps", type=int, help="override job.steps")
    p.add_argument("--linger-s", type=float, default=30.0, help="after the job, wait this long for shards to stop")
    p.add_argument(
        "--fresh", action="store_true", help="discard the committed checkpoints instead of resuming from the newest"
    )
    p.add_argument(
        "--recover",
        choices=("auto", "never"),
        default="auto",
        help="auto: a coordinator restarted mid-job takes the job back from its journal (no rollback); "
        "never: resume from the last committed checkpoint",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="every member runs on this host (pstrain local passes it): without memory.host_memory, the workers "
        "plan with their share of this host's memory, after the PS shards'",
    )
    add_common_flags(p, default_bind="0.0.0.0:7070")
    return p.parse_args(argv)


KEY_NAME = "job.key"


def job_keys(out_dir: Path | None, recovered: bool) -> MemberKeys:
    """The job key behind every credential (issue 8): the kept one for a recovered job, else a new one,
    kept in ``<out>/job.key`` (0600, atomically) so a restarted coordinator can take the job back."""
    if out_dir is None:
        return MemberKeys.generate()
    path = out_dir / KEY_NAME
    if recovered:
        return MemberKeys(path.read_bytes())
    keys = MemberKeys.generate()
    atomic_write(path, lambda fh: fh.write(keys.job_key))  # 0600, and its directory entry durable too
    return keys


def journal_recovery(out_dir: Path | None, job_hash: str = "") -> Recovery | None:
    """The job as the journal left it, if it can be taken back (and was started from the job file whose hash is
    ``job_hash``); None (and why, logged) otherwise."""
    if out_dir is None:
        return None
    try:
        if not (out_dir / KEY_NAME).exists():
            raise JournalUnusable(f"no {KEY_NAME}: the members' credentials could not be checked")
        return recovery(out_dir / JOURNAL_NAME, job_hash)
    except (JournalUnusable, OSError, KeyError, TypeError, ValueError) as exc:
        if (out_dir / JOURNAL_NAME).exists():
            log.warning("not taking the job back from its journal (%s); resuming from the last checkpoint", exc)
        return None


def checkpoint_dir(cfg: JobConfig, out_dir: Path | None) -> Path | None:
    """``checkpoint.dir``, else ``<out>/checkpoints``; None (no checkpoints) without either or when off."""
    if cfg.checkpoint.every_steps == 0:
        return None
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir).resolve()
    return (out_dir / "checkpoints").resolve() if out_dir is not None else None


def build_job(
    cfg: JobConfig,
    out_dir: Path | None,
    security: TransportSecurity = INSECURE,
    fresh: bool = False,
    recover: bool = False,
    colocated: bool = False,
) -> Job:
    """Everything the coordinator knows before the first member calls, resumed from a checkpoint if any;
    with ``recover``, the running job taken back from the journal when it can be (``Job.recovered``);
    ``colocated``: every member runs on this host (``plan_job``)."""
    taken_back = journal_recovery(out_dir, JobIdentity.of(cfg).digest) if recover and not fresh else None
    if taken_back is not None:
        try:
            return _build_job(cfg, out_dir, security, fresh, taken_back, colocated)
        except JournalUnusable as exc:
            log.warning("not taking the job back from its journal (%s); resuming from the last checkpoint", exc)
    return _build_job(cfg, out_dir, security, fresh, None, colocated)


def _build_job(
    cfg: JobConfig,
    out_dir: Path | None,
    security: TransportSecurity,
    fresh: bool,
    taken_back: Recovery | None,
    colocated: bool,
) -> Job:
    checked = preflight(cfg)  # every factory the job file names, once: a bad one fails here with its key
    model, dataset = checked.model, checked.dataset
    dataset_size = len(dataset)  # type: ignore[arg-type]
    job_plan = plan_job(cfg, model.model, dataset, model.layout.total, colocated=colocated)
    plan = job_plan.plan
    if job_plan.memory is not None:
        log.info("memory plan:\n%s", describe(job_plan))
    if dataset_size < plan.per_device_batch:
        raise ConfigError(f"batch.per_device: {plan.per_device_batch} exceeds the dataset's {dataset_size} samples")
    job_id = taken_back.job_id if taken_back is not None else f"{cfg.job.name}-{uuid.uuid4().hex[:8]}"
    directory = checkpoint_dir(cfg, out_dir)
    where = str(directory) if directory is not None else ""
    spec = job_spec(cfg, plan, model.layout, job_id, job_plan.layer_policies(), where)
    probe = probe_setup(cfg, job_plan, lambda p, policies: job_spec(cfg, p, model.layout, job_id, policies, where))
    resume, ledger = None, None
    identity = JobIdentity.of(cfg)
    if directory is not None:
        try:
            model_file = out_dir / "model.pt" if out_dir is not None else None
            resume = resume_point(directory, identity, plan.steps, fresh, model_file)
        except CheckpointMismatch as exc:
            raise ConfigError(f"checkpoint.dir: {exc}") from exc
        if resume is not None and probe is not None:
            plan, spec = probe.replan(resume.per_worker_batch // plan.devices_per_worker)
            probe = None  # the checkpoint's batch was probed when it was first planned
    if taken_back is not None and probe is not None:
        plan, spec = probe.replan(taken_back.per_device_batch)
        probe = None  # the journal's job was probed before it started
    if directory is not None:
        template = Manifest(
            step=-1,
            job_hash=identity.digest,
            settings=identity.settings,
            ps_shards=spec.ps_shards,
            total_params=spec.total_params,
            workers=plan.workers,
            per_worker_batch=plan.per_device_batch * plan.devices_per_worker,
            committed_unix_s=0.0,
        )
        if resume is not None and (resume.ps_shards, resume.total_params, resume.workers, resume.per_worker_batch) != (
            template.ps_shards,
            template.total_params,
            template.workers,
            template.per_worker_batch,
        ):
            raise ConfigError(
                f"checkpoint.dir: the checkpoint of step {resume.step} in {directory} was made for another cluster "
                f"shape or batch; use --fresh to discard it"
            )
        ledger = CheckpointLedger(directory, template, cfg.checkpoint.keep)
    tracker = DataShardTracker(dataset_size, cfg.data.shard_size, cfg.data.shuffle, cfg.job.seed, slots=plan.workers)
    start_step = resume.step if resume is not None else 0
    if resume is not None and resume.tracker is not None and (taken_back is None or taken_back.tracker is None):
        tracker.restore(resume.tracker)  # slots were dropped or taken back before it (a journal's snapshot wins)
    elif start_step and taken_back is None:  # a job taken back positions its tracker from the journal
        tracker.resume(start_step, plan.per_device_batch * plan.devices_per_worker)
    if start_step and taken_back is None:
        log.info("resuming from the committed checkpoint of step %d in %s", start_step, directory)

    def export(addresses: list[str], version: int) -> torch.Tensor:
        client = PsClient(
            addresses, spec.total_params, spec.chunk_bytes, pull_timeout_s=spec.pull_timeout_s, security=security
        )
        try:
            flat = torch.empty(spec.total_params, dtype=torch.float32)
            with_retries(lambda: client.pull(version, flat), RetryPolicy(), threading.Event().wait)
            return flat
        finally:
            client.close()

    return Job(
        job_id,
        plan,
        spec,
        model,
        tracker,
        out_dir,
        export,
        cfg.transport.heartbeat_timeout_s,
        probe=probe,
        start_step=start_step,
        checkpoints=ledger,
        replace_timeout_s=cfg.fault.replace_timeout_s or None,
        reachable=address_answers(security),
        min_workers=cfg.cluster.least_workers,
        set_ps_workers=ps_worker_setter(security),
        recovery=taken_back,
        resume_workers=resume.worker_ids if resume is not None else None,
        job_hash=identity.digest,
        resumed_estimate=(resume.worker_device_bytes, resume.worker_host_bytes) if resume is not None else (0, 0),
    )


def warn_of_slow_takeovers(heartbeat_timeout_s: float) -> None:
    """A member restarted at its own address takes its slot once its predecessor has been silent this long, within
    its ``--connect-timeout-s``; past half the default the members may give up first (exit 1, restarted, and the
    job may fail for the silence in between)."""
    if heartbeat_timeout_s > CONNECT_TIMEOUT_S / 2:
        log.warning(
            "transport.heartbeat_timeout_s %.0f s: a member restarted at its address waits that long for its slot; "
            "give the members a --connect-timeout-s (default %.0f s) well above it (pstrain_connect_timeout_s)",
            heartbeat_timeout_s,
            CONNECT_TIMEOUT_S,
        )


def own_directories(cfg: JobConfig, out_dir: Path | None) -> contextlib.ExitStack:
    """Lock ``--out`` (the journal, the job key) and ``checkpoint.dir`` (the manifests) for this coordinator's life:
    a second coordinator on either fails at once (``DirectoryBusy``, exit 2) instead of appending to our journal
    or pruning our checkpoints (``runtime.dir_lock``)."""
    held = contextlib.ExitStack()
    try:
        if out_dir is not None:
            held.enter_context(hold_directory(out_dir, COORDINATOR, "--out", "coordinator"))
        checkpoints = checkpoint_dir(cfg, out_dir)
        if checkpoints is not None:
            held.enter_context(hold_directory(checkpoints, COORDINATOR, "checkpoint.dir", "coordinator"))
    except BaseException:
        held.close()
        raise
    return held


def run(args: argparse.Namespace, freeze_gc: bool = False) -> int:
    """Serve the job until it is over or a signal stops it; ``freeze_gc``: this is the process's own entry point."""
    with contextlib.ExitStack() as held:  # the directories this coordinator owns, until it returns
        return _serve(args, held, freeze_gc)


def _serve(args: argparse.Namespace, held: contextlib.ExitStack, freeze_gc: bool) -> int:
    try:
        identity = IdentityHolder()
        security = security_from_args(args).with_identity(identity)
        cfg = load_config(args.config)
        if args.steps is not None:
            cfg = cfg.with_steps(args.steps)
        out_dir = Path(args.out) if args.out else None
        warn_of_slow_takeovers(cfg.transport.heartbeat_timeout_s)
        held.enter_context(own_directories(cfg, out_dir))
        job = build_job(cfg, out_dir, security, args.fresh, recover=args.recover == "auto", colocated=args.colocated)
        registry = MemberRegistry(job_keys(out_dir, job.recovered))  # issue 8: the job key behind every credential
        for (role, member_id), incarnation in job.incarnations.items():
            for _ in range(incarnation + 1):  # the registry's count back to the newest credential issued
                registry.issue(role, member_id)
        identity.adopt(registry.keys.mint("coordinator", 0))  # its export pulls from the PS shards
        attach_table_export(job.export, cfg, security)  # issue 9: sparse tables into model.pt
    except (ConfigError, SecurityError, DirectoryBusy) as exc:
        log.error("cannot start job %s: %s", args.config, exc, exc_info=exc.__cause__ is not None)
        return 2
    stop = threading.Event()
    stop_on_signals(stop)
    servicer = CoordinatorServicer(job, registry)
    try:
        server = start_server(
            args.bind, [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], ["Coordinator"], security
        )
    except BindError as exc:  # settings that cannot work, as above: exit 2, which systemd does not restart
        log.error("cannot start job %s: %s", args.config, exc)
        job.close()
        return 1 if isinstance(exc, PortInUse) else 2  # a port taken may be free again on the next start
    metrics = serve_metrics(host_of(args.bind), args.metrics_port, security, args.metrics_host)
    if metrics:
        register_job_metrics(job)
        job.metrics_address = metrics_address_of(args.bind, metrics)
    log.info("job %s on port %d: %s", job.job_id, server.port, job.plan.describe())
    server.set_serving(True)
    job.serving()
    if args.port_file:
        write_port_file(args.port_file, server.port)
    sd_notify("READY=1")
    if freeze_gc:
        freeze_startup_objects()  # the job, the model, gRPC: left out of the collector's full passes from now on
    try:
        while not stop.is_set() and not job.wait_over(cfg.transport.heartbeat_s):
            job.check_liveness()
        if stop.is_set():
            # Not a failure of the job: the journal stays usable (no ``job_over``), so a coordinator started
            # again (``systemctl restart``) takes the job back while the members ride out the outage.
            log.warning(
                "stopped by signal at step %d; job %s is left %s: a coordinator started again takes it back",
                job.ledger.completed,
                job.job_id,
                job.state.name,
            )
            return 0  # SIGTERM is an orderly stop, not a failure of this process
        job.wait_stopped(args.linger_s)
        if job.state == JobState.FINISHED:
            return 0
        return 1 if job.failure_retryable else EXIT_JOB_FAILED
    finally:
        sd_notify("STOPPING=1")
        job.stop_waits()  # a WaitForCluster call ends now, not at its deadline (or after the server's grace)
        server.stop(args.grace_s)
        job.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("pstrain-coordinator", args.log_level)
    return run(args, freeze_gc=True)
