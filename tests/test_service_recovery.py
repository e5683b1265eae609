"""Recovery as systemd runs pstrain: each service under ``Restart=on-failure``, no launcher.

A tiny supervisor stands in for systemd (restart a unit that exits with anything but 0, 2 or 3,
after ``RestartSec``; ports fixed as the units fix them). kill -9 a PS shard, a worker or the
worker mid-job: the restarted member re-registers, the coordinator fails the job retryably,
every member exits 1 and is restarted, the restarted coordinator resumes from the last committed
checkpoint, and the job finishes with the model of a fault-free run. kill -9 the coordinator: the
restarted one takes the job back from its journal and no member is restarted (no rollback). So
does ``systemctl restart`` of the coordinator (SIGTERM, then a new start): a stop is not a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
import torch

from pstrain.runtime.ports import free_port
from tests.helpers import child_env, metrics_lines, pids_with_marker, run_local, wait_for, write_job

STEPS = 30
RESTART_S = 0.5  # RestartSec
NOT_RESTARTED = (0, 2, 3)  # success, RestartPreventExitStatus=2 3


@dataclass
class Unit:
    """One service under Restart=on-failure."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: IO[bytes]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)
    restart_at: float | None = None

    def start(self) -> None:
        self.starts += 1
        self.log.write(f"--- {self.name} start {self.starts}\n".encode())
        self.log.flush()
        self.popen = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    def tend(self, now: float) -> None:
        """What systemd does on each look: note an exit, restart a failed unit after RestartSec."""
        assert self.popen is not None
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.start()
            return
        code = self.popen.poll()
        if code is None or len(self.exits) == self.starts:
            return
        self.exits.append(code)
        if code not in NOT_RESTARTED:
            self.restart_at = now + RESTART_S

    @property
    def done(self) -> bool:
        """Exited for good: every start's exit noted and no restart pending."""
        return self.restart_at is None and len(self.exits) == self.starts


def job_file(path: Path, checkpoints: Path) -> Path:
    return write_job(
        path,
        data={"factory": "tests.helpers:PacedDataset", "kwargs": {"n": 37}, "shard_size": 3},
        job={"steps": STEPS, "seed": 13},
        checkpoint={"every_steps": 3, "keep": 2, "dir": str(checkpoints)},
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 8.0},
        fault={"coordinator_timeout_s": 20.0, "replace_timeout_s": 0},  # rollback; see test_worker_replacement
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    result = run_local(job_file(tmp / "job.yaml", tmp / "ckpt"), tmp / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp / "out" / "model.pt", weights_only=True)


def units(tmp: Path, job: Path, marker: str, log: IO[bytes]) -> list[Unit]:
    env = child_env(marker)
    py = [sys.executable, "-m"]
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--coordinator", coordinator, "--grace-s", "1", "--metrics-port", "-1", "--connect-timeout-s", "60"]
    found = [
        Unit(
            "coordinator",
            [*py, "pstrain.coordinator", "--config", str(job), "--out", str(tmp / "out"), "--bind", coordinator]
            + ["--linger-s", "5", "--grace-s", "1", "--metrics-port", "-1"],
            env,
            log,
        )
    ]
    for shard in range(3):
        argv = [*py, "pstrain.ps_server", *common, "--shard-id", str(shard), "--bind", f"127.0.0.1:{free_port()}"]
        found.append(Unit(f"ps-{shard}", argv, env, log))
    for index in range(2):
        argv = [*py, "pstrain.worker", *common, "--devices", "cpu,cpu", "--bind", f"127.0.0.1:{free_port()}"]
        found.append(Unit(f"worker-{index}", argv, env, log))
    return found


@pytest.mark.parametrize("victim", ["ps-1", "worker-0", "coordinator", "coordinator-sigterm"])
def test_services_restarted_like_systemd_finish_with_the_fault_free_model(tmp_path, reference, victim):
    """``coordinator-sigterm`` is ``systemctl restart``: SIGTERM (an orderly exit 0, which
    ``Restart=on-failure`` would not restart), then started again at once."""
    sigterm = victim.endswith("-sigterm")
    victim = victim.removesuffix("-sigterm")
    job = job_file(tmp_path / "job.yaml", tmp_path / "ckpt")
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    with open(tmp_path / "services.log", "wb") as log:
        cluster = units(tmp_path, job, marker, log)
        for unit in cluster:
            unit.start()
        killed = False
        deadline = time.monotonic() + 240
        try:
            while not all(u.done for u in cluster):
                assert time.monotonic() < deadline, (tmp_path / "services.log").read_text()[-6000:]
                now = time.monotonic()
                for unit in cluster:
                    unit.tend(now)
                if not killed and metrics_lines(out) >= 7:
                    target = next(u for u in cluster if u.name == victim)
                    assert target.popen is not None
                    os.kill(target.popen.pid, signal.SIGTERM if sigterm else signal.SIGKILL)
                    killed = True
                    if sigterm:  # systemctl restart: wait for the stop, then start the unit again
                        assert target.popen.wait(timeout=60) == 0
                        target.tend(time.monotonic())
                        target.start()
                time.sleep(0.05)  # the supervisor's tick, as systemd watches its units
        finally:
            for unit in cluster:
                if unit.popen is not None and unit.popen.poll() is None:
                    unit.popen.kill()
                    unit.popen.wait()
    text = (tmp_path / "services.log").read_text(errors="replace")
    assert killed
    by_name = {u.name: u for u in cluster}
    assert (0 if sigterm else -signal.SIGKILL) in by_name[victim].exits
    assert all(u.exits[-1] == 0 for u in cluster), {u.name: u.exits for u in cluster}
    if victim == "coordinator":  # taken back from the journal: the members rode the outage out
        assert by_name["coordinator"].starts == 2 and "recovered job" in text
        assert all(u.starts == 1 for u in cluster if u.name != "coordinator"), {u.name: u.starts for u in cluster}
    else:
        assert by_name["coordinator"].starts >= 2 and "resuming from the committed checkpoint" in text
    state = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    wait_for(lambda: not pids_with_marker(marker), 30, "every service to be gone")
