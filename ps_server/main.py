"""``pstrain-ps``: run one parameter-server shard.

Start order: serve (health NOT_SERVING) -> register with the coordinator -> receive the
initial parameters of this shard's range -> SERVING, READY=1 to systemd -> heartbeat until
the coordinator says the job is over or SIGTERM arrives -> NOT_SERVING, drain, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import threading

import grpc
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import TensorAssembler
from pstrain.runtime.lifecycle import (
    add_common_flags,
    sd_notify,
    start_member,
    stop_on_signals,
    wait_until_reachable,
    write_port_file,
)
from pstrain.runtime.logs import configure_logging
from pstrain.runtime.security import SecurityError
from pstrain.runtime.transport import CONTROL_TIMEOUT_S, open_channel
from pstrain.ps_server.service import ParameterServerServicer
from pstrain.ps_server.shard import ParameterShard

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pstrain-ps", description="Run one pstrain parameter-server shard.")
    p.add_argument("--coordinator", required=True, help="coordinator address, host:port")
    p.add_argument("--shard-id", type=int, required=True, help="which shard of the job this process serves")
    p.add_argument("--advertise-host", help="host name peers use to reach this process (default: bind host or FQDN)")
    p.add_argument("--connect-timeout-s", type=float, default=120.0)
    add_common_flags(p, default_bind="0.0.0.0:0")
    return p.parse_args(argv)


def fetch_initial(stub: pb_grpc.CoordinatorStub, shard_id: int, numel: int) -> torch.Tensor:
    assembler = TensorAssembler(torch.float32, numel)
    for chunk in stub.FetchInitialParameters(pb.InitialParametersRequest(shard_id=shard_id), timeout=300):
        assembler.add(chunk)
    return assembler.result()


def run(args: argparse.Namespace) -> int:
    servicer = ParameterServerServicer()
    try:
        member = start_member(args, [(pb_grpc.add_ParameterServerServicer_to_server, servicer)], ["ParameterServer"])
    except SecurityError as exc:
        log.error("%s", exc)
        return 2
    server, address, metrics_address, security = member.server, member.address, member.metrics_address, member.security
    stop = threading.Event()
    stop_on_signals(stop)
    log.info("shard %d listening on %s", args.shard_id, address)
    channel = open_channel(args.coordinator, security)
    shard: ParameterShard | None = None
    try:
        wait_until_reachable(channel, args.coordinator, args.connect_timeout_s)
        stub = pb_grpc.CoordinatorStub(channel)
        reply = stub.RegisterParameterServer(
            pb.RegisterPsRequest(shard_id=args.shard_id, address=address, metrics_address=metrics_address),
            timeout=CONTROL_TIMEOUT_S,
        )
        job = reply.job
        initial = fetch_initial(stub, args.shard_id, reply.end - reply.start)
        shard = ParameterShard(
            args.shard_id, reply.start, reply.end, initial, job.optimizer, job.lr_schedule, job.workers
        )
        servicer.attach(shard, job.chunk_bytes)
        server.set_serving(True)
        if args.port_file:
            write_port_file(args.port_file, server.port)
        stub.ParameterServerReady(pb.PsReadyRequest(shard_id=args.shard_id), timeout=CONTROL_TIMEOUT_S)
        sd_notify("READY=1")
        log.info("shard %d serving [%d, %d) of %d parameters", args.shard_id, reply.start, reply.end, job.total_params)
        while not stop.wait(job.heartbeat_s):
            try:
                directive = stub.Heartbeat(pb.HeartbeatRequest(role="ps", id=args.shard_id), timeout=CONTROL_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.warning("heartbeat to coordinator failed: %s", exc.details())
                continue
            if directive.stop:
                log.info("coordinator says stop: %s", directive.reason)
                break
        return 0
    except grpc.RpcError as exc:
        log.error("coordinator refused shard %d: %s: %s", args.shard_id, exc.code().name, exc.details())
        return 1
    except ConnectionError as exc:
        log.error("%s", exc)
        return 1
    finally:
        sd_notify("STOPPING=1")
        if shard is not None:
            shard.close()
        server.stop(args.grace_s)
        channel.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(f"pstrain-ps-{args.shard_id}", args.log_level)
    return run(args)
