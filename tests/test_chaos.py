"""kill -9 a worker, a PS shard or the coordinator mid-job: the job finishes with the fault-free model.

``pstrain local`` restarts the cluster after a worker or PS shard dies; the coordinator resumes
from the newest committed checkpoint, the PS shards load it, and data order is a function of (seed,
epoch, slot, step), so the resumed run trains on exactly the samples an uninterrupted one would.
A killed coordinator is restarted alone and takes the job back from its journal, without a
rollback (``tests/test_coordinator_recovery.py`` checks that no member was restarted).
"""

from __future__ import annotations

import json
import os
import random
import signal
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import metrics_lines, pids_with_marker, run_local, start_local, wait_for, write_job

STEPS = 24


def chaos_job(path: Path, **extra: object) -> Path:
    """Data shards that straddle steps (3 samples, 8 per worker-step), 2+ epochs, checkpoints every 3 steps."""
    sections: dict[str, object] = {
        "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 37}, "shard_size": 3},
        "job": {"steps": STEPS, "seed": 11},
        "checkpoint": {"every_steps": 3, "keep": 2},
        "fault": {"max_restarts": 2, "restart_backoff_s": 0.2, "replace_timeout_s": 0},  # the rollback path
    }
    sections.update(extra)
    return write_job(path, **sections)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run every chaotic run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    marker = uuid.uuid4().hex
    result = run_local(chaos_job(tmp / "job.yaml"), tmp / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not pids_with_marker(marker)
    return torch.load(tmp / "out" / "model.pt", weights_only=True), (tmp / "out" / "metrics.jsonl")


def child_pid(marker: str, module: str) -> int:
    for pid in pids_with_marker(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in cmdline:
            return pid
    raise AssertionError(f"no {module} process of this cluster is running")


@pytest.mark.parametrize("module", ["pstrain.worker", "pstrain.ps_server", "pstrain.coordinator"])
def test_a_killed_process_is_survived_and_the_model_equals_the_fault_free_run(tmp_path, reference, module):
    expected, reference_metrics = reference
    out = tmp_path / "out"
    marker = uuid.uuid4().hex
    kill_after = random.Random(module).randrange(4, STEPS - 6)  # a random step, reproducible per case
    proc = start_local(chaos_job(tmp_path / "job.yaml"), out, marker)
    try:
        wait_for(lambda: metrics_lines(out) >= kill_after, 120, f"{kill_after} steps")
        os.kill(child_pid(marker, module), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    if module == "pstrain.coordinator":
        assert "the coordinator was killed (signal 9); restarting it alone" in stderr
    else:
        assert "exited with code -9; restarting the cluster from the last committed checkpoint" in stderr
    state = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))  # every step once, in order
    reference_lines = [json.loads(line) for line in reference_metrics.read_text().splitlines()]
    assert [line["loss"] for line in lines] == pytest.approx([line["loss"] for line in reference_lines], rel=1e-6)
    wait_for(lambda: not pids_with_marker(marker), 30, "every child to be gone")


def test_a_second_run_of_a_finished_job_trains_anew_and_another_job_file_is_refused(tmp_path):
    out = tmp_path / "out"
    job = chaos_job(tmp_path / "job.yaml", job={"steps": 6, "seed": 11})
    assert run_local(job, out, uuid.uuid4().hex).returncode == 0
    first = (out / "metrics.jsonl").read_text()
    again = run_local(job, out, uuid.uuid4().hex)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "metrics.jsonl").read_text().count("\n") == 6 and first.count("\n") == 6
    other = chaos_job(tmp_path / "other.yaml", job={"steps": 12, "seed": 12})  # another seed: another job
    refused = run_local(other, out, uuid.uuid4().hex)
    assert refused.returncode == 2, refused.stderr[-2000:]  # the coordinator's exit: a restart cannot help
    assert "another job file" in refused.stderr and "--fresh" in refused.stderr and "Traceback" not in refused.stderr
    fresh = run_local(other, out, uuid.uuid4().hex, extra=["--fresh"])
    assert fresh.returncode == 0, fresh.stderr[-2000:]
