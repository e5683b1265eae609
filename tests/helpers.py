"""Factories that test jobs name by path (child processes import them) and process helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset, TensorDataset

REPO_ROOT = Path(__file__).resolve().parent.parent


def odd_mlp(inputs: int = 5, hidden: int = 7, classes: int = 4) -> nn.Module:
    """74 parameters with the defaults: not divisible by 3 shards."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def blocked_mlp(inputs: int = 5, hidden: int = 7, classes: int = 4) -> nn.Module:
    """Two blocks (``memory.blocks: ["0", "1"]``) of two Linear+Tanh each, then a head: recomputing a block frees
    what it saves inside, where recomputing a lone Linear or Tanh frees nothing (its input stays)."""

    def block(width: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())

    return nn.Sequential(block(inputs), block(hidden), nn.Linear(hidden, classes))


def bn_mlp() -> nn.Module:
    """Has buffers (BatchNorm running statistics) that must reach model.pt."""
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4))


def classification_set(n: int = 16, inputs: int = 5, classes: int = 4, seed: int = 1) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, inputs, generator=gen), torch.randint(0, classes, (n,), generator=gen))


class PacedDataset(Dataset):
    """``classification_set`` whose samples take ``sample_s`` each to read: a job that cannot finish
    before a test has had time to act on it (a kill at step 7 of a job that is already over tests nothing)."""

    def __init__(self, n: int = 16, sample_s: float = 0.02) -> None:
        self.inner = classification_set(n)
        self.sample_s = sample_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sample_s)
        return self.inner[index]


class FailingDataset(Dataset):
    """Raises when a worker reads sample ``fail_at`` (the coordinator only asks for its length)."""

    def __init__(self, n: int = 64, fail_at: int = 10) -> None:
        self.inner = classification_set(n)
        self.fail_at = fail_at

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        if index == self.fail_at:
            raise RuntimeError(f"injected failure reading sample {index}")
        return self.inner[index]


def failing_set(n: int = 64, fail_at: int = 10) -> Dataset:
    return FailingDataset(n, fail_at)


class RecordingDataset(Dataset):
    """``classification_set`` that appends every index it reads to ``<record_dir>/reads-<pid>.txt``.

    Which worker trains which data shard depends on who asks the coordinator first, so a test
    that checks the data split end to end needs each worker's reads in order. Only a worker
    process (one that imported the trainer) records: the launcher and the coordinator read
    sample 0 to check the dataset before anything starts (``coordinator/preflight.py``), which
    is not training data. The file is opened lazily, so a process that never reads leaves none.
    """

    def __init__(self, n: int, record_dir: str) -> None:
        self.inner = classification_set(n)
        self.record_dir = Path(record_dir)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        if "pstrain.worker.trainer" not in sys.modules:
            return self.inner[index]
        with open(self.record_dir / f"reads-{os.getpid()}.txt", "a") as log:
            log.write(f"{index}\n")
        return self.inner[index]


def recording_set(n: int, record_dir: str) -> Dataset:
    return RecordingDataset(n, record_dir)


def recorded_reads(record_dir: Path) -> list[list[int]]:
    """Every reading process's indices, in the order it read them."""
    return [[int(line) for line in path.read_text().split()] for path in sorted(record_dir.glob("reads-*.txt"))]


def write_job(path: Path, **sections: object) -> Path:
    """Write a job file: a tiny default job with ``sections`` replacing whole top-level keys."""
    job: dict[str, object] = {
        "model": {"factory": "tests.helpers:odd_mlp"},
        "data": {"factory": "tests.helpers:classification_set", "shard_size": 8, "shuffle": True},
        "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "batch": {"per_device": 4, "lr_scaling": "linear"},
        "job": {"steps": 6, "seed": 3},
        "cluster": {"ps_shards": 3, "workers": 2, "devices_per_worker": 2},
        "transport": {"heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0},
    }
    job.update(sections)
    path.write_text(yaml.safe_dump(job))
    return path


def child_env(marker: str, gpus: bool = False) -> dict[str, str]:
    """Environment for a launched cluster; ``marker`` lets a test find every descendant.

    Without ``gpus`` the cluster sees no GPU (``CUDA_VISIBLE_DEVICES`` empty): a test written for CPU
    stand-ins (``devices_per_worker: 2``) then runs the same on a GPU host as in CI, where it would
    otherwise ask for 2 GPUs. CUDA tests pass ``gpus=True``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["PSTRAIN_TEST_MARKER"] = marker
    env["PYTHONFAULTHANDLER"] = "1"  # a hung process dumps every thread's stack on SIGABRT
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def pids_with_marker(marker: str, variable: str = "PSTRAIN_TEST_MARKER") -> list[int]:
    """Live processes whose environment carries ``variable=marker`` (children inherit it)."""
    found = []
    needle = f"{variable}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it returns something truthy or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def run_local(  # type: ignore[no-untyped-def]
    job: Path, out: Path, marker: str, timeout_s: float = 240, extra: list[str] | None = None, gpus: bool = False
):
    """Run ``pstrain local`` as a real process and return the CompletedProcess (``gpus``: see ``child_env``)."""
    cmd = [
        sys.executable,
        "-m",
        "pstrain.launcher.cli",
        "local",
        "--config",
        str(job),
        "--out",
        str(out),
        *(extra or []),
    ]
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=child_env(marker, gpus), capture_output=True, text=True, timeout=timeout_s
    )


def start_local(job: Path, out: Path, marker: str) -> subprocess.Popen:
    """Start ``pstrain local`` in the background; the caller stops it (see ``stop_local``)."""
    cmd = [sys.executable, "-m", "pstrain.launcher.cli", "local", "--config", str(job), "--out", str(out)]
    return subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=child_env(marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def communicate_or_dump(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """``proc.communicate`` that, on a hang, fails with the stacks of every thread of ``proc``."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"{proc.args} still running after {timeout_s:.0f}s:\n{stderr[-8000:]}") from None


def stop_local(proc: subprocess.Popen, marker: str) -> None:
    """Ctrl-C the launcher, wait for it, and make sure nothing it started survives."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    wait_for(lambda: not pids_with_marker(marker), 30, "the cluster's processes to exit")


def metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def build_wheel(dest: Path) -> Path:
    """Build the pstrain wheel into ``dest/dist`` from a clean copy of the checkout.

    Not from the checkout itself: setuptools packs whatever an earlier build left in ``build/``,
    so a module that was moved away would still be shipped and the packaging tests would lie.
    """
    import shutil

    source = dest / "source"
    junk = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "runs", "__pycache__", ".*_cache")
    shutil.copytree(REPO_ROOT, source, ignore=junk)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest / "dist")]
    result = subprocess.run([*cmd, str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (dest / "dist").glob("pstrain-*.whl")
    return wheel


def nan_set(n: int = 16, nan_at: int = 0) -> TensorDataset:
    """``classification_set`` whose sample ``nan_at`` has NaN inputs: any batch holding it has a NaN
    loss and gradient (with ``shuffle: false`` the step that reads it is known)."""
    inputs, targets = classification_set(n).tensors
    inputs = inputs.clone()
    inputs[nan_at] = float("nan")
    return TensorDataset(inputs, targets)


# Broken factories for the job-file preflight (tests/test_job_file_errors.py).


def raising_model(message: str = "hidden must be even") -> nn.Module:
    raise ValueError(message)


def parameterless_model() -> nn.Module:
    return nn.Sequential(nn.ReLU())


def text_samples(n: int = 8) -> list[tuple[str, int]]:
    """A map-style dataset (a list) whose inputs are strings, not tensors."""
    return [("seven", 7)] * n


def empty_set() -> TensorDataset:
    return TensorDataset(torch.empty(0, 5), torch.empty(0, dtype=torch.int64))


def mean_output(model: nn.Module, n: int = 4) -> dict[str, float]:
    """An eval callable: the model's mean output on ``n`` fixed inputs."""
    return {"mean_output": float(model(classification_set(n).tensors[0]).mean())}


@dataclass
class GuardedShard:
    address: str
    keys: Any  # MemberKeys: the credentials its gate accepts
    servicer: Any  # ParameterServerServicer
    shard: Any  # ParameterShard


@contextlib.contextmanager
def guarded_shard(numel: int, workers: int, pulls: Any = None) -> Iterator[GuardedShard]:
    """A real PS shard on an asyncio gRPC server on 127.0.0.1 whose gate checks member credentials (fresh keys), as a
    job's shard does; SGD with learning rate 1 from zeros. (Imports inside: job factories in child processes import
    this module.)"""
    from pstrain.protos import pstrain_pb2 as pb
    from pstrain.ps_server.admission import ShardGate
    from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
    from pstrain.ps_server.shard import ParameterShard
    from pstrain.runtime.identity import MemberKeys
    from pstrain.runtime.transport import start_server

    keys = MemberKeys.generate()
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    schedule = pb.LrSchedule(scaled_lr=1.0)
    shard = ParameterShard(0, 0, numel, torch.zeros(numel), pb.OptimizerSpec(name="sgd"), schedule, workers)
    try:
        servicer.attach(shard, 1024)
        servicer.gate = ShardGate(keys, 1, pulls)
        server.set_serving(True)
        yield GuardedShard(f"127.0.0.1:{server.port}", keys, servicer, shard)
    finally:
        shard.close()
        server.stop(0)


class FullCopies(TorchDispatchMode):
    """Counts ``copy_`` calls that write ``numel`` elements: the passes over a shard that copy it."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten.copy_.default and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **(kwargs or {}))
