"""Synchronous PS training equals single-process torch.optim on the global batch.

W=2 workers x D=2 CPU devices x S=3 shards over a 74-parameter model (74 % 3 != 0). Most
datasets hold exactly one global batch, so every step trains on all of it and the data order
cannot matter; ``test_data_spanning_data_shards_and_epochs`` checks the data split end to end.
"""

import json
import re
import subprocess
import sys
import uuid

import pytest
import torch

from pstrain.runtime.buckets import plan_buckets
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.shard_map import shard_ranges
from tests.helpers import (
    REPO_ROOT,
    child_env,
    classification_set,
    odd_mlp,
    pids_with_marker,
    recorded_reads,
    run_local,
    wait_for,
    write_job,
)

STEPS = 6
WORKERS, DEVICES, SHARDS, PER_DEVICE = 2, 2, 3, 4
GLOBAL = WORKERS * DEVICES * PER_DEVICE


def reference(optimizer_cls, lr_at, seed=3, shape=None, **kwargs):
    """torch.optim on the global batch; ``shape``: ``odd_mlp``'s inputs/hidden/classes (the data follows it)."""
    shape = shape or {}
    torch.manual_seed(seed)
    model = odd_mlp(**shape)
    data = {k: v for k, v in shape.items() if k in ("inputs", "classes")}
    x, y = classification_set(GLOBAL, **data).tensors
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "devices, memory",
    [(["cuda:0", "cuda:0"], {}), (["cuda:0"], {"offload_params": True})],
    ids=["two-replicas-on-one-gpu", "whole-layer-offload"],
)
def test_cuda_workers_train_as_torch_optim(tmp_path, devices, memory):
    """The GPU path end to end: replicas on cuda:0, host sums over PCIe, pinned buffers (a one-GPU host)."""
    job = write_job(
        tmp_path / "job.yaml",
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": GLOBAL}, "shard_size": 8},
        optimizer=SGD_MOMENTUM,
        batch={"per_device": GLOBAL // (WORKERS * len(devices)), "lr_scaling": "linear"},
        job={"steps": STEPS, "seed": 3},
        cluster={"ps_shards": SHARDS, "workers": WORKERS, "devices_per_worker": devices},
        **({"memory": memory} if memory else {}),
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker, gpus=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cuda:0" in (tmp_path / "out" / "logs" / "worker-0.log").read_text()
    expected = reference(torch.optim.SGD, lambda s: 0.05 * WORKERS * len(devices), momentum=0.9)
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)
    assert not pids_with_marker(marker)


WIDE = {"inputs": 32, "hidden": 64, "classes": 10}  # 2,762 parameters (11 KiB): several 4 KiB buckets


@pytest.mark.parametrize(
    "devices",
    [
        ["cpu", "cpu"],
        pytest.param(
            ["cuda:0", "cuda:0"], marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
        pytest.param(["cuda:0"], marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
    ids=["cpu-stand-ins", "two-replicas-on-one-gpu", "one-gpu-into-the-push-regions"],
)
def test_gradients_in_several_buckets_train_as_torch_optim(tmp_path, devices):
    """Several buckets per step, so a bucket leaves while backward still runs the layers below it: on a GPU its
    device-to-host copy runs on a side stream beside that backward (``Replica.stage_bucket``); same result. With
    one GPU the copy also goes straight into the shards' page-locked push regions (``runtime.host_pinning``)."""
    layout = ParamLayout.of(odd_mlp(**WIDE))
    assert len(plan_buckets(layout, shard_ranges(layout.total, SHARDS), 4096).buckets) >= 2
    data = {k: v for k, v in WIDE.items() if k in ("inputs", "classes")}
    job = write_job(
        tmp_path / "job.yaml",
        model={"factory": "tests.helpers:odd_mlp", "kwargs": WIDE},
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": GLOBAL, **data}, "shard_size": 8},
        optimizer=SGD_MOMENTUM,
        batch={"per_device": GLOBAL // (WORKERS * len(devices)), "lr_scaling": "linear"},
        job={"steps": STEPS, "seed": 3},
        cluster={"ps_shards": SHARDS, "workers": WORKERS, "devices_per_worker": devices},
        transport={"heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0, "bucket_bytes": 4096},
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker, gpus=devices[0].startswith("cuda"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = reference(torch.optim.SGD, lambda s: 0.05 * WORKERS * len(devices), shape=WIDE, momentum=0.9)
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected)
    assert not pids_with_marker(marker)
    log = (tmp_path / "out" / "logs" / "worker-0.log").read_text()
    assert "pushes and pulls go through shared memory" in log
    one_gpu = devices == ["cuda:0"]
    assert ("push region is page-locked for device copies" in log) is one_gpu
    placed = [int(n) for n in re.findall(r"payloads moved: .*placed_pushes=(\d+)", log)]
    assert placed and (min(placed) > 0 if one_gpu else max(placed) == 0), placed  # pieces the GPU put in place


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


# ---------------------------------------------------------------- several data shards and epochs
#
# Data order is a function of (seed, epoch, worker slot, step): each epoch is a permutation seeded
# by (seed, epoch) cut into ``shard_size`` data shards, and worker slot w trains data shards w,
# w + W, w + 2W, ... in order, whenever it asks. The test records every worker's reads, checks
# them against that contract (so a shard straddling two steps, or an epoch boundary inside a
# step, lands exactly where the contract says) and compares the model with plain SGD on the same
# global batches.

SPAN_N = 28  # 3.5 global batches of 8
SPAN_SHARD = 3  # smaller than a worker's step batch of 4 and not dividing it; 10 shards an epoch, the last of 1
SPAN_PER_DEVICE = 2
SPAN_STEPS = 9  # 72 samples: two whole epochs and part of a third
SPAN_SEED = 3


def coordinator_data_shards(n: int, size: int, seed: int, epochs: int) -> list[list[int]]:
    """Data shards by id: per epoch a permutation seeded by (seed, epoch), cut in order."""
    shards = []
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=gen).tolist()
        shards += [order[i : i + size] for i in range(0, n, size)]
    return shards


def slot_samples(shards: list[list[int]], slot: int, slots: int, count: int) -> list[int]:
    """The first ``count`` samples worker slot ``slot`` trains: its data shards in order, concatenated."""
    samples = [i for shard in shards[slot::slots] for i in shard]
    assert len(samples) >= count, "generate more epochs"
    return samples[:count]


def test_data_spanning_data_shards_and_epochs(tmp_path):
    record_dir = tmp_path / "reads"
    record_dir.mkdir()
    job = write_job(
        tmp_path / "job.yaml",
        data={
            "factory": "tests.helpers:recording_set",
            "kwargs": {"n": SPAN_N, "record_dir": str(record_dir)},
            "shard_size": SPAN_SHARD,
            "shuffle": True,
        },
        optimizer=SGD_MOMENTUM,
        batch={"per_device": SPAN_PER_DEVICE, "lr_scaling": "linear"},
        job={"steps": SPAN_STEPS, "seed": SPAN_SEED},
        cluster={"ps_shards": SHARDS, "workers": WORKERS, "devices_per_worker": DEVICES},
    )
    result = run_local(job, tmp_path / "out", uuid.uuid4().hex)
    assert result.returncode == 0, result.stderr[-3000:]

    step_batch = SPAN_PER_DEVICE * DEVICES
    reads = recorded_reads(record_dir)
    assert len(reads) == WORKERS, "only the workers read samples, each its own"
    assert [len(r) for r in reads] == [SPAN_STEPS * step_batch] * WORKERS

    shards = coordinator_data_shards(SPAN_N, SPAN_SHARD, SPAN_SEED, epochs=6)
    per_epoch = -(-SPAN_N // SPAN_SHARD)
    expected = [slot_samples(shards, w, WORKERS, SPAN_STEPS * step_batch) for w in range(WORKERS)]
    assert sorted(reads) == sorted(expected), "each worker's reads are its slot's data shards, in order"
    slots = [expected.index(r) for r in reads]
    read_in_full = {
        shard_id
        for shard_id in range(len(shards))
        if sum(len(s) for s in shards[shard_id % WORKERS : shard_id + 1 : WORKERS]) <= SPAN_STEPS * step_batch
    }
    assert set(range(2 * per_epoch)) <= read_in_full, "every sample of the first two epochs trained exactly once"
    reads = [reads[slots.index(w)] for w in range(WORKERS)]  # in slot order, as the reference sums them

    torch.manual_seed(SPAN_SEED)
    model = odd_mlp()
    x, y = classification_set(SPAN_N).tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * WORKERS * DEVICES, momentum=0.9)
    losses = []
    for step in range(SPAN_STEPS):
        batch = [i for r in reads for i in r[step * step_batch : (step + 1) * step_batch]]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert_equivalent(torch.load(tmp_path / "out" / "model.pt", weights_only=True), model.state_dict())
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(SPAN_STEPS))
    assert [r["global_batch"] for r in records] == [WORKERS * DEVICES * SPAN_PER_DEVICE] * SPAN_STEPS
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
