"""Synchronous PS training equals single-process torch.optim on the global batch.

W=2 workers x D=2 CPU devices x S=3 shards over a 74-parameter model (74 % 3 != 0). The
dataset holds exactly one global batch, so every step trains on all of it and the data
order cannot matter.
"""

import subprocess
import sys
import uuid

import pytest
import torch

from tests.helpers import (
    REPO_ROOT,
    child_env,
    classification_set,
    odd_mlp,
    pids_with_marker,
    run_local,
    wait_for,
    write_job,
)

STEPS = 6
WORKERS, DEVICES, SHARDS, PER_DEVICE = 2, 2, 3, 4
GLOBAL = WORKERS * DEVICES * PER_DEVICE


def reference(optimizer_cls, lr_at, seed=3, **kwargs):
    torch.manual_seed(seed)
    model = odd_mlp()
    x, y = classification_set(GLOBAL).tensors
    opt = optimizer_cls(model.parameters(), lr=lr_at(0), **kwargs)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_equivalent(state, expected):
    assert list(state) == list(expected)
    for name in expected:
        rel = (state[name] - expected[name]).norm() / expected[name].norm()
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
        torch.testing.assert_close(state[name], expected[name], rtol=1e-5, atol=1e-6)


SGD_MOMENTUM = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
LINEAR = {"per_device": PER_DEVICE, "lr_scaling": "linear"}


def job_file(tmp_path, optimizer, batch, **extra):
    return write_job(
        tmp_path / "job.yaml",
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": GLOBAL}, "shard_size": 8},
        optimizer=optimizer,
        batch=batch,
        job={"steps": STEPS, "seed": 3},
        cluster={"ps_shards": SHARDS, "workers": WORKERS, "devices_per_worker": DEVICES},
        **extra,
    )


def test_sgd_momentum_with_warmup_via_pstrain_local(tmp_path):
    job = job_file(
        tmp_path,
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        {"per_device": PER_DEVICE, "lr_scaling": "linear", "warmup_steps": 3},
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    scaled = 0.05 * WORKERS * DEVICES
    expected = reference(
        torch.optim.SGD, lambda s: scaled * min(1.0, (s + 1) / 3), momentum=0.9, nesterov=True, weight_decay=0.01
    )
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)
    assert not pids_with_marker(marker)


def test_adam_with_services_started_by_hand(tmp_path):
    """The three entry points run on their own, as systemd runs them."""
    job = job_file(
        tmp_path,
        {"name": "adam", "lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.001},
        {"per_device": PER_DEVICE, "lr_scaling": "sqrt"},
    )
    marker = uuid.uuid4().hex
    port_file = tmp_path / "coordinator.port"
    procs: list[subprocess.Popen] = []
    with open(tmp_path / "services.log", "wb") as logs:

        def spawn(*args: str) -> None:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", *args, "--bind", "127.0.0.1:0"],
                    cwd=REPO_ROOT,
                    env=child_env(marker),
                    stdout=logs,
                    stderr=subprocess.STDOUT,
                )
            )

        try:
            spawn(
                "pstrain.coordinator",
                "--config",
                str(job),
                "--out",
                str(tmp_path / "out"),
                "--port-file",
                str(port_file),
            )
            wait_for(port_file.exists, 60, "the coordinator's port file")
            address = f"127.0.0.1:{int(port_file.read_text())}"
            for shard in range(SHARDS):
                spawn("pstrain.ps_server", "--coordinator", address, "--shard-id", str(shard))
            for _ in range(WORKERS):
                spawn("pstrain.worker", "--coordinator", address, "--devices", "cpu,cpu")
            codes = [p.wait(timeout=180) for p in procs]
            assert codes == [0] * len(procs), (tmp_path / "services.log").read_text()[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    scaled = 0.01 * (WORKERS * DEVICES) ** 0.5
    expected = reference(torch.optim.Adam, lambda s: scaled, betas=(0.9, 0.99), weight_decay=0.001)
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)
    assert not pids_with_marker(marker)


@pytest.mark.parametrize("workers, devices, shards", [(1, 1, 1), (3, 1, 2)])
def test_other_cluster_shapes(tmp_path, workers, devices, shards):
    per_device = GLOBAL // (workers * devices) if GLOBAL % (workers * devices) == 0 else None
    n = GLOBAL if per_device else 12
    per_device = per_device or n // (workers * devices)
    job = write_job(
        tmp_path / "job.yaml",
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": n}, "shard_size": per_device * devices},
        optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.05},
        batch={"per_device": per_device, "lr_scaling": "none"},
        job={"steps": STEPS, "seed": 3},
        cluster={"ps_shards": shards, "workers": workers, "devices_per_worker": devices},
    )
    result = run_local(job, tmp_path / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.manual_seed(3)
    model = odd_mlp()
    x, y = classification_set(n).tensors
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), model.state_dict())


def test_swapping_every_layer_changes_nothing(tmp_path):
    """The worker applies the coordinator's plan (swap every layer that saves a tensor of its own) bit-exactly."""
    job = job_file(tmp_path, SGD_MOMENTUM, LINEAR, memory={"policy": "swap", "device_memory": "1GiB"})
    result = run_local(job, tmp_path / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memory plan: 0=swap, 1=swap\n" in (tmp_path / "out" / "logs" / "worker-0.log").read_text()
    expected = reference(torch.optim.SGD, lambda s: 0.05 * WORKERS * DEVICES, momentum=0.9)
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)


def test_the_masters_probe_does_not_disturb_training(tmp_path):
    """S2.1: worker 0 runs one real iteration first; no parameter or sample may be affected."""
    job = job_file(
        tmp_path,
        SGD_MOMENTUM,
        LINEAR,
        memory={"probe": True, "device_memory": "4GiB", "estimate": "increment", "increment": "64MiB"},
    )
    result = run_local(job, tmp_path / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "out" / "logs" / "coordinator.log").read_text()
    assert "probe accepted at batch 4" in log
    worker_logs = [(tmp_path / "out" / "logs" / f"worker-{i}.log").read_text() for i in range(WORKERS)]
    assert sum("probe at batch 4" in text for text in worker_logs) == 1, "exactly one worker (slot 0) probes"
    expected = reference(torch.optim.SGD, lambda s: 0.05 * WORKERS * DEVICES, momentum=0.9)
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)
