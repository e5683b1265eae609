"""cluster.min_workers end to end: services started as systemd would, a worker killed -9 and never restarted.

Three workers, ``min_workers: 2``: the coordinator waits ``fault.replace_timeout_s`` for a replacement,
then drops the slot. The job finishes with two workers; metrics.jsonl shows the step where the worker
count, the global batch and the LR changed together; the journal records the change; no data shard is
completed twice and each one the dead worker held is trained by a live worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from pstrain.coordinator.journal import read_journal
from pstrain.runtime.ports import free_port
from tests.helpers import child_env, metrics_lines, pids_with_marker, wait_for, write_job

STEPS = 30
PER_DEVICE = 4
LR = 0.05


def job_file(path: Path, steps: int = STEPS) -> Path:
    return write_job(
        path,
        data={"factory": "tests.helpers:PacedDataset", "kwargs": {"n": 64}, "shard_size": 3},
        job={"steps": steps, "seed": 5},
        batch={"per_device": PER_DEVICE, "lr_scaling": "linear"},
        optimizer={"name": "sgd", "lr": LR, "momentum": 0.9},
        cluster={"ps_shards": 2, "workers": 3, "min_workers": 2, "devices_per_worker": 1},
        checkpoint={"every_steps": 0},  # no compaction: the journal keeps the whole run's ledger
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 3.0},
        fault={"replace_timeout_s": 2.0},
    )


def journaled(out: Path, event: str) -> int:
    path = out / "journal.jsonl"
    return sum(e["event"] == event for e in read_journal(path)) if path.exists() else 0


@pytest.mark.parametrize("comes_back", [False, True])
def test_a_worker_killed_and_not_replaced_is_dropped_and_the_job_finishes_with_two(tmp_path, comes_back):
    """``comes_back``: once the job went on with two, a new worker process registers and takes the slot back."""
    steps = 80 if comes_back else STEPS
    marker = uuid.uuid4().hex
    env = child_env(marker)
    out = tmp_path / "out"
    job = job_file(tmp_path / "job.yaml", steps)
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--coordinator", coordinator, "--grace-s", "1", "--metrics-port", "-1", "--connect-timeout-s", "60"]
    py = [sys.executable, "-m"]
    argvs = {
        "coordinator": [*py, "pstrain.coordinator", "--config", str(job), "--out", str(out), "--bind", coordinator]
        + ["--linger-s", "5", "--grace-s", "1", "--metrics-port", "-1"],
        **{
            f"ps-{i}": [*py, "pstrain.ps_server", *common, "--shard-id", str(i), "--bind", "127.0.0.1:0"]
            for i in range(2)
        },
        **{
            f"worker-{i}": [*py, "pstrain.worker", *common, "--devices", "cpu", "--bind", "127.0.0.1:0"]
            for i in range(3)
        },
    }
    log_path = tmp_path / "services.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with open(log_path, "wb") as log:
        try:
            for name, argv in argvs.items():
                procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: metrics_lines(out) >= 6, 120, "6 steps")
            victim = "worker-2"
            os.kill(procs[victim].pid, signal.SIGKILL)
            if comes_back:
                wait_for(lambda: journaled(out, "workers_changed") >= 1, 120, "the job to go on with two workers")
                argv = [*py, "pstrain.worker", *common, "--devices", "cpu", "--bind", "127.0.0.1:0"]
                procs["worker-3"] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 240
            for name, proc in procs.items():
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if name != victim:
                    assert code == 0, (name, code, log_path.read_text(errors="replace")[-6000:])
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    text = log_path.read_text(errors="replace")
    assert "the job goes on with 2 workers" in text, text[-6000:]
    assert ("takes its dropped slot back" in text) == comes_back
    assert (out / "model.pt").exists()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(steps))
    change = next(i for i, m in enumerate(lines) if m["workers"] == 2)
    back = next((i for i, m in enumerate(lines) if i > change and m["workers"] == 3), steps)
    assert change >= 6 and all(m["workers"] == 3 for m in lines[:change])
    assert all(m["workers"] == 2 for m in lines[change:back]) and all(m["workers"] == 3 for m in lines[back:])
    assert (back < steps) == comes_back
    assert {m["global_batch"] for m in lines[:change] + lines[back:]} == {3 * PER_DEVICE}
    assert {m["global_batch"] for m in lines[change:back]} == {2 * PER_DEVICE}
    assert all(m["lr"] == pytest.approx(2 * LR) for m in lines[change:back])
    assert lines[0]["lr"] == pytest.approx(3 * LR) and lines[-1]["lr"] == pytest.approx((3 if comes_back else 2) * LR)
    events = read_journal(out / "journal.jsonl")
    kinds = Counter(e["event"] for e in events)
    assert kinds["worker_failed"] == 1 and kinds["workers_changed"] == (2 if comes_back else 1), kinds
    assert kinds["worker_returned"] == comes_back
    changed = next(e for e in events if e["event"] == "workers_changed")
    assert changed["from_step"] == change and len(changed["ids"]) == 2 and changed["worker"] not in changed["ids"]
    completed = [e["data_shard"] for e in events if e["event"] == "data_shard_completed"]
    completed += [
        d for e in events if e["event"] in ("worker_rejoined", "workers_changed") for d in e["data_shards_done"]
    ]
    assert len(completed) == len(set(completed))  # no data shard trained twice
    dispatched = Counter(e["data_shard"] for e in events if e["event"] == "data_shard_dispatched")
    failed = next(e for e in events if e["event"] == "worker_failed")
    for data_shard in failed["requeued"]:  # what the dead worker held was handed to a live one
        assert dispatched[data_shard] >= 2 or data_shard in completed, data_shard
    wait_for(lambda: not pids_with_marker(marker), 30, "every service to be gone")


def test_pstrain_local_leaves_a_worker_past_its_restarts_dead_and_the_job_goes_on_with_fewer(tmp_path):
    """``pstrain local`` with ``fault.max_restarts: 0`` and ``cluster.min_workers: 2``: a worker killed -9 is
    not restarted and the cluster is not restarted either; the coordinator drops its slot and the job ends."""
    from tests.helpers import start_local

    job = write_job(
        tmp_path / "job.yaml",
        data={"factory": "tests.helpers:PacedDataset", "kwargs": {"n": 64}, "shard_size": 3},
        job={"steps": STEPS, "seed": 5},
        batch={"per_device": PER_DEVICE, "lr_scaling": "linear"},
        optimizer={"name": "sgd", "lr": LR},
        cluster={"ps_shards": 2, "workers": 3, "min_workers": 2, "devices_per_worker": 1},
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 3.0},
        fault={"replace_timeout_s": 2.0, "max_restarts": 0},
    )
    marker = uuid.uuid4().hex
    out = tmp_path / "out"
    proc = start_local(job, out, marker)
    try:
        wait_for(lambda: metrics_lines(out) >= 6, 120, "6 steps")
        workers = [p for p in pids_with_marker(marker) if b"pstrain.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 3
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "is not restarted" in stderr and "restarting the cluster" not in stderr, stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(STEPS))
    assert lines[0]["workers"] == 3 and lines[-1]["workers"] == 2 and lines[-1]["global_batch"] == 2 * PER_DEVICE
    wait_for(lambda: not pids_with_marker(marker), 30, "every child to be gone")
