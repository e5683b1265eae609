"""``pstrain-ps``: run one parameter-server shard.

Start order: serve (health NOT_SERVING) -> register with the coordinator -> receive the
initial parameters of this shard's range, or load the committed checkpoint the coordinator
names from this host's checkpoint directory -> SERVING, READY=1 to systemd -> heartbeat until
the coordinator says the job is over or SIGTERM arrives -> NOT_SERVING, drain (the checkpoint
writer finishes its queued writes), exit 0.
The skeleton (serve, ready, heartbeat, drain) is ``MemberProcess``; this module is the join.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import TensorAssembler
from pstrain.ps_server.admission import ShardGate, pull_limits
from pstrain.ps_server.bulk import BulkSockets
from pstrain.ps_server.checkpoint import CheckpointError, CheckpointWriter, load_state
from pstrain.ps_server.norm_service import GrpcPoster, LayerNormsServicer, add_layer_norms, layers_for
from pstrain.ps_server.optimizer import update_threads
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import CheckpointPolicy
from pstrain.ps_server.sparse_checkpoint import CheckpointJoin, sparse_shard_for
from pstrain.ps_server.sparse_service import SparseTablesServicer, add_sparse_tables
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.dir_lock import DirectoryBusy, hold_directory, ps_shard_lock
from pstrain.runtime.identity import MemberVerifier
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
from pstrain.runtime.shard_map import ShardRange
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, host_of

log = logging.getLogger(__name__)
_PS_VIEW = pb.WaitForClusterRequest(worker_id=-1)  # issue 10: the PS addresses, for the norm exchange

INITIAL_FETCH_S = 300.0
"""The deadline of each start-up stream from the coordinator: this shard's initial parameters, its sparse rows."""


def start_waits_s(args: argparse.Namespace) -> float:
    """The longest a shard waits on the coordinator before READY=1: reaching and joining it (``join_waits_s``),
    then its initial parameters and rows (``INITIAL_FETCH_S`` each). Loading a checkpoint instead comes on top."""
    return join_waits_s(args) + 2 * INITIAL_FETCH_S


WRITER_CLOSE_S = 60.0
"""How long a stopping shard waits for each checkpoint writer, twice: to queue its end behind the snapshots it
still has to write, then for them to be written (``SnapshotWriter.close``). A clean stop keeps its last checkpoint."""

CHECKPOINT_WRITERS = 2
"""The dense range's writer and, for a job with sparse tables, the tables' writer: closed one after the other."""


def worst_case_stop_s(grace_s: float) -> float:
    """The longest a shard's own waits hold its exit after SIGTERM: its checkpoint writers finishing their queued
    snapshots, then the member's drain (``drain_waits_s``). The unit's TimeoutStopSec must exceed it, or systemd
    SIGKILLs a shard that is writing its last checkpoint."""
    return CHECKPOINT_WRITERS * 2 * WRITER_CLOSE_S + drain_waits_s(grace_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pstrain-ps", description="Run one pstrain parameter-server shard.")
    p.add_argument("--shard-id", type=int, required=True, help="which shard of the job this process serves")
    p.add_argument(
        "--bulk-port",
        type=_port,
        default=0,
        help="TCP port of this shard's bulk sockets, on the --bind host: remote workers' tensors as raw bytes "
        "(issue 12); default 0, an ephemeral port; give a fixed one to open it in a firewall",
    )
    p.add_argument("--no-bulk", action="store_true", help="no bulk port: every worker streams its tensors inside gRPC")
    add_member_flags(p)
    return p.parse_args(argv)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is in [0, 65535], got {port}")
    return port


def fetch_initial(stub: pb_grpc.CoordinatorStub, shard_id: int, numel: int) -> torch.Tensor:
    assembler = TensorAssembler(torch.float32, numel)
    for chunk in stub.FetchInitialParameters(pb.InitialParametersRequest(shard_id=shard_id), timeout=INITIAL_FETCH_S):
        assembler.add(chunk)
    return assembler.result()


def open_bulk_port(bulk: BulkSockets, tls: bool, shard_id: int) -> bool:
    """Issue 12: listen on the bulk port now, so a fixed port that is taken fails the start (False). A shard that
    serves TLS opens none: its bytes would be plaintext (``OpenBulk`` refuses TLS channels), so every worker streams.
    """
    if not bulk.enabled:
        return True
    if tls:
        bulk.turn_off()
        log.info("shard %d serves TLS: no bulk port, every worker streams its tensors inside gRPC", shard_id)
        return True
    try:
        port = bulk.listen()
    except OSError as exc:
        log.error("shard %d cannot listen on its bulk port %d (--bulk-port): %s", shard_id, bulk.port, exc)
        return False
    log.info("shard %d bulk sockets on port %d", shard_id, port)
    return True


def serve_shard(
    member: MemberProcess,
    servicer: ParameterServerServicer,
    shard_id: int,
    sparse: SparseTablesServicer | None = None,
    norms: LayerNormsServicer | None = None,
) -> int:
    """Join as shard ``shard_id``, serve it until the job ends or SIGTERM."""
    log.info("shard %d listening on %s", shard_id, member.served.address)
    if not open_bulk_port(servicer.bulk, member.served.security.tls, shard_id):  # issue 12: before joining
        return EXIT_RESTART
    stub = member.coordinator
    request = pb.RegisterPsRequest(
        shard_id=shard_id, address=member.served.address, metrics_address=member.served.metrics_address
    )
    reply = member.join(lambda: stub.RegisterParameterServer(request, timeout=CONTROL_TIMEOUT_S))
    job = reply.job
    if job.checkpoint_dir:  # its snapshots on this host are this process's alone until it exits
        try:
            member.holding(
                hold_directory(
                    Path(job.checkpoint_dir), ps_shard_lock(shard_id), "checkpoint.dir", f"PS shard {shard_id}"
                )
            )
        except DirectoryBusy as exc:
            log.error("cannot serve shard %d: %s", shard_id, exc)
            return EXIT_JOB_FAILED  # a restart would find the same holder; the coordinator sees this shard fail
    limits = pull_limits(job)  # issue 8: the job file's transport.max_waiting_pulls[_per_peer], pull_timeout_s
    servicer.gate = ShardGate(pulls=limits)
    if reply.job_key:  # issue 8: pushes only with the pushing worker's credential, pulls within limits
        servicer.gate = ShardGate(MemberVerifier(reply.job_key), job.devices_per_worker or None, limits)
        if sparse is not None:
            sparse.gate = servicer.gate  # row pushes and pulls are bound like dense ones
        if norms is not None:
            norms.keys = servicer.gate.keys  # issue 10: only this job's PS shards post partial norms
    # Heartbeat from registration on: loading a large checkpoint must not look like a dead shard.
    member.start_heartbeat(
        shard_id, job.heartbeat_s, stop_when_job_ends=True, coordinator_timeout_s=job.coordinator_timeout_s
    )
    policy = None
    confirm_sparse = None
    if job.checkpoint_dir and job.checkpoint_every_steps > 0:

        def confirm(step: int) -> int:
            written = pb.CheckpointWritten(shard_id=shard_id, step=step)
            return stub.ReportCheckpoint(written, timeout=CONTROL_TIMEOUT_S).committed_step

        confirm_dense: Callable[[int], int | None] = confirm
        if job.embeddings:  # issue 9: step t is confirmed once the dense and the sparse file of t are durable
            join = CheckpointJoin(("dense", "sparse"), confirm)
            confirm_dense, confirm_sparse = join.part("dense"), join.part("sparse")
        writer = CheckpointWriter(Path(job.checkpoint_dir), shard_id, job.checkpoint_keep, confirm_dense)
        member.closing(partial(writer.close, WRITER_CLOSE_S))  # after the shard: queued snapshots are still written
        policy = CheckpointPolicy(job.checkpoint_every_steps, job.steps, writer.submit)
    # S4: the shard collects and updates each piece (its range cut at the workers' bucket boundaries) on its own.
    layout = ParamLayout.from_shapes([p.name for p in job.params], [list(p.shape) for p in job.params])
    pieces = shard_pieces(layout, ShardRange(shard_id, reply.start, reply.end), job.bucket_bytes)
    layers = None
    if norms is not None:  # issue 10: LARS/LAMB need the slice's parameter segments and the peers' partial norms
        poster = GrpcPoster(
            lambda: stub.WaitForCluster(_PS_VIEW, timeout=CONTROL_TIMEOUT_S).ps_addresses, member.served.security
        )
        member.closing(poster.close)
        layers = layers_for(job, shard_id, norms.board, poster)
    if reply.resume_step > 0:
        try:
            state = load_state(Path(job.checkpoint_dir), shard_id, reply.start, reply.end, reply.resume_step)
            shard = PiecedShard.restore(
                state, pieces, job.optimizer, job.lr_schedule, job.workers, policy, layers, job.push_dtype or pb.FLOAT32
            )
        except CheckpointError as exc:
            log.error("%s", exc)
            return EXIT_JOB_FAILED  # a restart would find the same files
        log.info("shard %d resumes from its checkpoint of step %d", shard_id, reply.resume_step)
    else:
        initial = fetch_initial(stub, shard_id, reply.end - reply.start)
        shard = PiecedShard.build(
            pieces,
            initial,
            job.optimizer,
            job.lr_schedule,
            job.workers,
            checkpoints=policy,
            layers=layers,
            push_dtype=job.push_dtype or pb.FLOAT32,  # issue 12: UNSPECIFIED (an older spec) is float32
        )
    member.closing(shard.close)  # wakes pulls blocked on a version before the server drains
    servicer.shared_memory = not job.shared_memory_off  # issue 12
    if job.push_timeout_s > 0:  # issue 12: a bulk push's payload moves within the job's push timeout
        servicer.push_timeout_s = job.push_timeout_s
    if job.bulk_sockets_off and servicer.bulk.enabled:  # issue 12: transport.bulk_sockets: off, every worker streams
        servicer.bulk.turn_off()
        log.info("shard %d: transport.bulk_sockets is off; its bulk port is closed", shard_id)
    servicer.attach(shard, job.chunk_bytes)
    member.closing(servicer.close_shared_memory)  # issue 12: unlink every worker's /dev/shm regions
    if sparse is not None:  # issue 9: this shard's rows of the sparse embedding tables
        try:
            initial_rows = lambda: stub.FetchInitialRows(  # noqa: E731 - init_checkpoint's rows this shard owns
                pb.InitialParametersRequest(shard_id=shard_id), timeout=INITIAL_FETCH_S
            )
            sparse_shard, sparse_writer = sparse_shard_for(
                job, shard_id, reply.resume_step, confirm_sparse, initial_rows
            )
        except CheckpointError as exc:
            log.error("%s", exc)
            return EXIT_JOB_FAILED
        if sparse_writer is not None:
            member.closing(partial(sparse_writer.close, WRITER_CLOSE_S))  # after the tables: queued snapshots too
        member.closing(sparse_shard.close)
        sparse.attach(sparse_shard)
    member.ready(lambda: stub.ParameterServerReady(pb.PsReadyRequest(shard_id=shard_id), timeout=CONTROL_TIMEOUT_S))
    log.info("shard %d serving [%d, %d) of %d parameters", shard_id, reply.start, reply.end, job.total_params)
    member.stop.wait()
    return member.abort_exit_code if member.aborted.is_set() else 0


def run(args: argparse.Namespace) -> int:
    servicer = ParameterServerServicer()
    servicer.bulk = BulkSockets(enabled=not args.no_bulk, host=host_of(args.bind), port=args.bulk_port)  # issue 12
    sparse = SparseTablesServicer()
    norms = LayerNormsServicer()  # issue 10
    member = MemberProcess(
        args,
        "ps",
        [
            (add_parameter_server, servicer),
            (add_sparse_tables, sparse),
            (add_layer_norms, norms),
        ],  # issue 12: byte-level Push/Pull serializers,
        ["ParameterServer", "SparseTables", "LayerNorms"],
        aio=True,  # issue 12: an asyncio server, so waiting pulls hold no threads
    )
    return member.run(lambda member: serve_shard(member, servicer, args.shard_id, sparse, norms))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(f"pstrain-ps-{args.shard_id}", args.log_level)
    MemberProcess.freeze_gc_when_ready = True  # its own process: ready() freezes the start-up objects
    torch.set_num_threads(update_threads())  # the update is memory-bound; a host also runs a worker
    return run(args)
