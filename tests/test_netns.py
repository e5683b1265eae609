"""Hosts, not only processes: a worker in its own network namespace, its link cut for a while.

The coordinator, the PS shards and worker A run in this namespace on one end of a veth pair;
worker B runs in a namespace of its own on the other end (distinct addresses, ``--advertise-host``,
as on a separate host), each under a systemd-like supervisor (``Restart=on-failure``). Cutting the
link for less than the heartbeat timeout is a partition the job rides out; cutting it for longer
makes the coordinator declare B failed and hold the step, and B, told so once the link is back,
exits 1, is restarted and replaces itself in its slot. Either way the job ends with the model of
a fault-free run. Skipped where network namespaces cannot be created (not root, no ``ip``).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pstrain.coordinator.journal import read_journal
from pstrain.runtime.ports import free_port
from tests.helpers import child_env, metrics_lines, pids_with_marker, run_local, wait_for, write_job
from tests.test_service_recovery import Unit

STEPS = 30
HEARTBEAT_TIMEOUT_S = 4.0


@dataclass(frozen=True)
class Namespace:
    name: str
    host_link: str  # our end of the veth pair: down cuts the namespace off
    host_ip: str
    ns_ip: str

    def cut(self, down: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_link, "down" if down else "up"], check=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _free_octet() -> int:
    """A 10.231.X.0/24 that no address or route here uses yet.

    A namespace left by a run that was killed before its finalizer keeps its veth, address and
    route; a new pair on the same /24 would lose its traffic to that stale link (the older route
    wins), and worker B would never reach the coordinator.
    """
    used = "".join(
        subprocess.run(["ip", "-4", "-o", *args], check=True, capture_output=True, text=True).stdout
        for args in (("addr", "show"), ("route", "show", "table", "all"))
    )
    free = [octet for octet in range(16, 250) if f"10.231.{octet}." not in used]
    if not free:
        pytest.skip("every 10.231.X.0/24 for the test's veth pair is in use here")
    return random.choice(free)


def _sweep_stale() -> None:
    """Delete the namespaces (and their host links) of test runs whose process is gone: a run killed before its
    finalizer leaves them for good. Names carry the creating pid (``pst<pid>x<tag>``); a live run's are kept."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for match in re.finditer(r"^pst(\d+)x([0-9a-f]{4})\b", listed, re.MULTILINE):
        try:
            os.kill(int(match[1]), 0)
            continue  # its run is alive (or the pid was reused: kept, harmless)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        subprocess.run(["ip", "netns", "del", match[0]], capture_output=True)
        subprocess.run(["ip", "link", "del", f"vh{match[1]}x{match[2]}"], capture_output=True)


@pytest.fixture
def namespace(request):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    _sweep_stale()
    tag = f"{os.getpid()}x{uuid.uuid4().hex[:4]}"  # interface names: at most 15 characters ("vh" + 7 + 1 + 4)
    ns = Namespace(f"pst{tag}", f"vh{tag}", "", "")
    try:
        _ip("netns", "add", ns.name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace: {exc.stderr.decode(errors='replace').strip()}")

    def clean() -> None:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
        subprocess.run(["ip", "link", "del", ns.host_link], capture_output=True)

    request.addfinalizer(clean)
    octet = _free_octet()
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    _ip("link", "add", ns.host_link, "type", "veth", "peer", "name", f"vn{tag}")
    _ip("link", "set", f"vn{tag}", "netns", ns.name)
    _ip("addr", "add", f"{host_ip}/24", "dev", ns.host_link)
    _ip("link", "set", ns.host_link, "up")
    for args in (("addr", "add", f"{ns_ip}/24", "dev", f"vn{tag}"), ("link", "set", f"vn{tag}", "up")):
        _ip("netns", "exec", ns.name, "ip", *args)
    _ip("netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
    return Namespace(ns.name, ns.host_link, host_ip, ns_ip)


def job_file(path: Path) -> Path:
    return write_job(
        path,
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": 37}, "shard_size": 3},
        job={"steps": STEPS, "seed": 17},
        checkpoint={"every_steps": 5, "keep": 2},
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "push_timeout_s": 60.0},
        fault={"coordinator_timeout_s": 60.0, "replace_timeout_s": 60.0},
    )


def cluster(tmp: Path, job: Path, ns: Namespace, marker: str, log) -> list[Unit]:  # type: ignore[no-untyped-def]
    env = child_env(marker)
    py = [sys.executable, "-m"]
    coordinator = f"{ns.host_ip}:{free_port(ns.host_ip)}"
    token = tmp / "token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    secure = ["--token-file", str(token)]  # members listen beyond loopback: never without a token
    common = ["--coordinator", coordinator, "--grace-s", "1", "--metrics-port", "-1", "--connect-timeout-s", "60"]
    common += secure
    units = [
        Unit(
            "coordinator",
            [*py, "pstrain.coordinator", "--config", str(job), "--out", str(tmp / "out"), "--bind", coordinator]
            + ["--linger-s", "5", "--grace-s", "1", "--metrics-port", "-1", *secure],
            env,
            log,
        )
    ]
    for shard in range(3):
        argv = [*py, "pstrain.ps_server", *common, "--shard-id", str(shard), "--bind", f"{ns.host_ip}:0"]
        units.append(Unit(f"ps-{shard}", argv, env, log))
    units.append(Unit("worker-a", [*py, "pstrain.worker", *common, "--bind", f"{ns.host_ip}:0"], env, log))
    inside = ["ip", "netns", "exec", ns.name]
    argv = [*inside, *py, "pstrain.worker", *common, "--bind", f"{ns.ns_ip}:47123", "--advertise-host", ns.ns_ip]
    units.append(Unit("worker-b", argv, env, log))
    return units


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    result = run_local(job_file(tmp / "job.yaml"), tmp / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp / "out" / "model.pt", weights_only=True)


@pytest.mark.parametrize("cut_s", [1.5, HEARTBEAT_TIMEOUT_S + 4.0])
def test_a_partitioned_worker_is_ridden_out_or_replaced(tmp_path, namespace, reference, cut_s):
    job = job_file(tmp_path / "job.yaml")
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    with open(tmp_path / "services.log", "wb") as log:
        units = cluster(tmp_path, job, namespace, marker, log)
        for unit in units:
            unit.start()
        cut_at: float | None = None
        healed = False
        deadline = time.monotonic() + 300
        try:
            while not all(u.done for u in units):
                assert time.monotonic() < deadline, (tmp_path / "services.log").read_text()[-6000:]
                now = time.monotonic()
                for unit in units:
                    unit.tend(now)
                if cut_at is None and metrics_lines(out) >= 8:
                    namespace.cut(True)
                    cut_at = now
                if cut_at is not None and not healed and now - cut_at >= cut_s:
                    namespace.cut(False)
                    healed = True
                time.sleep(0.05)  # the supervisor's tick; the cut's length is measured, not slept
        finally:
            namespace.cut(False)
            for unit in units:
                if unit.popen is not None and unit.popen.poll() is None:
                    unit.popen.kill()
                    unit.popen.wait()
    assert healed
    by_name = {u.name: u for u in units}
    assert all(u.exits[-1] == 0 for u in units), {u.name: u.exits for u in units}
    events = read_journal(out / "journal.jsonl") if (out / "journal.jsonl").exists() else []
    state = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    text = (tmp_path / "services.log").read_text(errors="replace")
    if cut_s < HEARTBEAT_TIMEOUT_S:
        assert by_name["worker-b"].exits == [0] and by_name["coordinator"].starts == 1
        assert "failed (silent" not in text
    else:
        assert f"at {namespace.ns_ip}:47123 failed (silent for over" in text  # declared failed, the step held
        assert by_name["worker-b"].starts >= 2  # told so once the link was back: it restarted
        assert "resumes its slot at step" in text or by_name["coordinator"].starts >= 2, events[-5:]
    wait_for(lambda: not pids_with_marker(marker), 30, "every service to be gone")
