"""Type=notify services: READY=1 once serving; SIGTERM -> NOT_SERVING, STOPPING=1, exit 0."""

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, child_env, pids_with_marker, wait_for, write_job


@pytest.fixture
def notify_socket():
    directory = tempfile.mkdtemp(prefix="sd-", dir="/tmp")  # AF_UNIX paths must stay short
    path = Path(directory) / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(90)
    yield sock, path
    sock.close()
    shutil.rmtree(directory)


def spawn(args, marker, notify_path=None):
    env = child_env(marker)
    env["PYTHONFAULTHANDLER"] = "1"  # a hung process dumps every thread's stack on SIGABRT
    if notify_path is not None:
        env["NOTIFY_SOCKET"] = str(notify_path)
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def exit_code(proc, timeout_s=60):
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        stacks = proc.communicate(timeout=30)[1].decode()
        raise AssertionError(f"{proc.args[2]} did not exit within {timeout_s}s:\n{stacks[-6000:]}") from None


def messages_until(sock, wanted, procs):
    seen: list[str] = []
    while wanted not in seen:
        try:
            seen.extend(sock.recv(4096).decode().split("\n"))
        except TimeoutError:
            for proc in procs:
                if proc is not None and proc.poll() is None:
                    proc.kill()
            logs = [p.stderr.read().decode()[-3000:] for p in procs if p is not None]
            raise AssertionError(f"no {wanted} after {seen}; logs: {logs}") from None
    return seen


def test_coordinator_and_ps_notify_and_stop_cleanly(tmp_path, notify_socket):
    sock, path = notify_socket
    marker = uuid.uuid4().hex
    job = write_job(tmp_path / "job.yaml")
    port_file = tmp_path / "port"
    coordinator = spawn(
        ["pstrain.coordinator", "--config", str(job), "--bind", "127.0.0.1:0", "--port-file", str(port_file)],
        marker,
        path,
    )
    ps = None
    try:
        assert "READY=1" in messages_until(sock, "READY=1", [coordinator, ps])
        assert port_file.exists(), "READY=1 comes only once the server is serving"
        address = f"127.0.0.1:{int(port_file.read_text())}"
        ps = spawn(
            ["pstrain.ps_server", "--coordinator", address, "--shard-id", "0", "--bind", "127.0.0.1:0"], marker, path
        )
        assert "READY=1" in messages_until(sock, "READY=1", [coordinator, ps])
        ps.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in messages_until(sock, "STOPPING=1", [coordinator, ps])
        assert exit_code(ps) == 0, ps.stderr.read().decode()[-2000:]
        coordinator.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in messages_until(sock, "STOPPING=1", [coordinator, ps])
        assert exit_code(coordinator) == 0, coordinator.stderr.read().decode()[-2000:]
    finally:
        for proc in (coordinator, ps):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    wait_for(lambda: not pids_with_marker(marker), 30, "the services to exit")
