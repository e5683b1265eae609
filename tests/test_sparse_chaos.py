"""kill -9 a PS shard of a job with sparse tables: the resumed run's model.pt, tables included, equals the
fault-free one (issue 9 with issue 11). The sparse rows are part of each shard's confirmed checkpoint."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import metrics_lines, pids_with_marker, run_local, start_local, wait_for, write_job
from tests.test_chaos import child_pid

STEPS = 18
SIZES = {"users": 2000, "items": 1000, "contexts": 50}


def ctr_job(path: Path) -> Path:
    """A small DLRM of examples/ctr.py: 2 workers x 2 devices, 2 shards, Adam tables, checkpoints every 3 steps."""
    return write_job(
        path,
        model={"factory": "examples.ctr:dlrm", "kwargs": {**SIZES, "dim": 8, "hidden": 16}},
        data={
            "factory": "examples.ctr:train_set",
            "kwargs": {"samples": 4000, **SIZES, "seed": 0, "holdout": 0.1},
            "shard_size": 16,
            "shuffle": True,
        },
        optimizer={"name": "adam", "lr": 0.002},
        batch={"per_device": 8, "lr_scaling": "none", "warmup_steps": 4},
        cluster={"ps_shards": 2, "workers": 2, "devices_per_worker": 2},
        job={"steps": STEPS, "seed": 5},
        checkpoint={"every_steps": 3, "keep": 2},
        fault={"max_restarts": 2, "restart_backoff_s": 0.2, "replace_timeout_s": 0},
        embeddings={
            "user": {"rows": SIZES["users"], "dim": 8, "optimizer": "adam", "lr": 0.05},
            "item": {"rows": SIZES["items"], "dim": 8, "optimizer": "adagrad", "lr": 0.1},
            "ctx": {"rows": SIZES["contexts"], "dim": 8, "lr": 0.1, "lr_schedule": "constant"},
        },
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse-reference")
    marker = uuid.uuid4().hex
    result = run_local(ctr_job(tmp / "job.yaml"), tmp / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not pids_with_marker(marker)
    return torch.load(tmp / "out" / "model.pt", weights_only=True)


def test_a_killed_ps_shard_is_survived_and_the_tables_equal_the_fault_free_run(tmp_path, reference):
    out = tmp_path / "out"
    marker = uuid.uuid4().hex
    proc = start_local(ctr_job(tmp_path / "job.yaml"), out, marker)
    try:
        wait_for(lambda: metrics_lines(out) >= 8, 180, "8 steps")
        assert list(out.rglob("sparse-*/step-*.pt"))  # the tables are checkpointed beside the dense range
        os.kill(child_pid(marker, "pstrain.ps_server"), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "restarting the cluster from the last committed checkpoint" in stderr
    state = torch.load(out / "model.pt", weights_only=True)
    assert {k for k in reference if k.startswith("tables.")} == {
        "tables.0.weight",
        "tables.1.weight",
        "tables.2.weight",
    }
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6)
    assert not pids_with_marker(marker)
