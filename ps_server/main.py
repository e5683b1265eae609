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
from pathlib import Path

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import TensorAssembler
from pstrain.ps_server.checkpoint import CheckpointError, CheckpointWriter, load_state
from pstrain.ps_server.optimizer import update_threads
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import CheckpointPolicy, ParameterShard
from pstrain.runtime.logs import configure_logging
from pstrain.runtime.member import EXIT_JOB_FAILED, MemberProcess, add_member_flags
from pstrain.runtime.transport import CONTROL_TIMEOUT_S

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pstrain-ps", description="Run one pstrain parameter-server shard.")
    p.add_argument("--shard-id", type=int, required=True, help="which shard of the job this process serves")
    add_member_flags(p)
    return p.parse_args(argv)


def fetch_initial(stub: pb_grpc.CoordinatorStub, shard_id: int, numel: int) -> torch.Tensor:
    assembler = TensorAssembler(torch.float32, numel)
    for chunk in stub.FetchInitialParameters(pb.InitialParametersRequest(shard_id=shard_id), timeout=300):
        assembler.add(chunk)
    return assembler.result()


def serve_shard(member: MemberProcess, servicer: ParameterServerServicer, shard_id: int) -> int:
    """Join as shard ``shard_id``, serve it until the job ends or SIGTERM."""
    log.info("shard %d listening on %s", shard_id, member.served.address)
    stub = member.coordinator
    request = pb.RegisterPsRequest(
        shard_id=shard_id, address=member.served.address, metrics_address=member.served.metrics_address
    )
    reply = member.join(lambda: stub.RegisterParameterServer(request, timeout=CONTROL_TIMEOUT_S))
    job = reply.job
    # Heartbeat from registration on: loading a large checkpoint must not look like a dead shard.
    member.start_heartbeat(
        shard_id, job.heartbeat_s, stop_when_job_ends=True, coordinator_timeout_s=job.coordinator_timeout_s
    )
    policy = None
    if job.checkpoint_dir and job.checkpoint_every_steps > 0:
        writer = CheckpointWriter(
            Path(job.checkpoint_dir),
            shard_id,
            job.checkpoint_keep,
            lambda step: (
                stub.ReportCheckpoint(
                    pb.CheckpointWritten(shard_id=shard_id, step=step), timeout=CONTROL_TIMEOUT_S
                ).committed_step
            ),
        )
        member.closing(writer.close)  # closed after the shard: queued snapshots are still written
        policy = CheckpointPolicy(job.checkpoint_every_steps, job.steps, writer.submit)
    if reply.resume_step > 0:
        try:
            state = load_state(Path(job.checkpoint_dir), shard_id, reply.start, reply.end, reply.resume_step)
        except CheckpointError as exc:
            log.error("%s", exc)
            return EXIT_JOB_FAILED  # a restart would find the same files
        shard = ParameterShard.restore(state, job.optimizer, job.lr_schedule, job.workers, policy)
        log.info("shard %d resumes from its checkpoint of step %d", shard_id, reply.resume_step)
    else:
        initial = fetch_initial(stub, shard_id, reply.end - reply.start)
        shard = ParameterShard(
            shard_id, reply.start, reply.end, initial, job.optimizer, job.lr_schedule, job.workers, checkpoints=policy
        )
    member.closing(shard.close)  # wakes pulls blocked on a version before the server drains
    servicer.attach(shard, job.chunk_bytes)
    member.ready(lambda: stub.ParameterServerReady(pb.PsReadyRequest(shard_id=shard_id), timeout=CONTROL_TIMEOUT_S))
    log.info("shard %d serving [%d, %d) of %d parameters", shard_id, reply.start, reply.end, job.total_params)
    member.stop.wait()
    return member.abort_exit_code if member.aborted.is_set() else 0


def run(args: argparse.Namespace) -> int:
    servicer = ParameterServerServicer()
    member = MemberProcess(
        args,
        "ps",
        [(add_parameter_server, servicer)],  # issue 12: byte-level Push/Pull serializers,
        ["ParameterServer"],
        aio=True,  # issue 12: an asyncio server, so waiting pulls hold no threads
    )
    return member.run(lambda member: serve_shard(member, servicer, args.shard_id))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(f"pstrain-ps-{args.shard_id}", args.log_level)
    torch.set_num_threads(update_threads())  # the update is memory-bound; a host also runs a worker
    return run(args)
