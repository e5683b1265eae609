"""Step time of pstrain vs. PyTorch DDP (gloo, CPU): same model, data, batch, optimizer and process count.

For each case (8 x Linear(1024) MLP at 64 and 256 samples per process, a small transformer):

* DDP: ``torch.nn.parallel.DistributedDataParallel`` over gloo on 127.0.0.1, 2 processes
  started with ``torch.multiprocessing``. A step is one iteration of the loop a DDP user
  writes: next batch from a ``DataLoader`` + ``DistributedSampler``, zero_grad, forward,
  backward (DDP's all-reduce runs inside it), ``SGD.step``. Step time = median over the
  measured iterations of the slower rank's iteration. "DDP compute" is the same loop under
  ``no_sync()`` (no all-reduce), run afterwards, so step - compute is DDP's exposed
  communication.
* pstrain: the real system. ``LocalCluster`` starts a coordinator, the PS shards and 2
  workers (1 CPU device each) as separate processes on 127.0.0.1, exactly as
  ``pstrain local`` does. Step time = median of the coordinator's ``step_s``
  (``metrics.jsonl``: the interval between two step completions) over the measured steps.
  The breakdown comes from the members' Prometheus endpoints (their addresses from
  ``GetJobStatus``), scraped when the last warm-up step and the last measured step complete:
  histogram sum / count deltas give the mean over exactly the measured steps of the worker's
  compute (batch + forward/backward, with the per-bucket pushes running beside backward), exposed
  push (the wait for acknowledgements after backward; for colocated pieces, pushed and pulled in one
  call, this includes the pull), exposed pull (forward's waits for buckets of new parameters) and the
  shard's optimizer update (summed over its pieces).
  ``--bucket-bytes`` sets pstrain's ``transport.bucket_bytes`` (S4 overlap; 0: one bucket).
* CPU per step, both systems: DDP's ranks time ``time.process_time()`` over their measured steps; pstrain's
  members report ``process_cpu_seconds_total`` in the same two scrapes. On a machine whose cores every
  process shares, CPU per step bounds the step time from below and depends less on other load than it.

Both systems: same factories (below, imported by path by pstrain's processes), same seeded
initial weights, SGD lr 0.01 momentum 0.9 with gradients averaged over the 2 processes
(pstrain: ``lr_scaling: none``), and 1 intra-op torch thread in every process
(``OMP_NUM_THREADS=1`` for pstrain's processes, ``torch.set_num_threads(1)`` in DDP's ranks):
the 2 training processes of either system then compete equally for the 2 cores. pstrain's
coordinator and shards also run on those cores; that is part of its cost here.

Each case runs 2 rounds (``--rounds``) of a DDP run and a pstrain run, the order alternating, and
pools them: the machine is shared, and a load that changes during the run then hits both alike.

Run: ``python bench/step.py [--quick]``; results go to ``bench/results/step.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from pstrain.runtime.buckets import DEFAULT_BUCKET_BYTES  # no gRPC: LocalCluster may still fork after this
from pstrain.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # job files and DDP's ranks import this module as ``bench.step``
RESULTS = ROOT / "bench" / "results" / "step.md"
CUDA_RESULTS = ROOT / "bench" / "results" / "step_cuda.md"  # --device cuda
PROCESSES = 2  # CPU: training processes of either system (pstrain: workers x 1 device)
SEED = 0
LR = 0.01
MOMENTUM = 0.9
TAIL_STEPS = 2  # pstrain runs past the measured steps, so its members are still up for the last scrape
RUN_TIMEOUT_S = 600  # one system's run of one case; a hung run fails instead of stalling the bench
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------- factories (job files name them by path)


def mlp(width: int = 1024, depth: int = 8) -> nn.Module:
    """``depth`` x Linear(width) with ReLU between: 8,396,800 parameters with the defaults."""
    layers: list[nn.Module] = []
    for index in range(depth):
        layers.append(nn.Linear(width, width))
        if index < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_set(n: int = 4096, width: int = 1024, classes: int = 10, seed: int = 1) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, width, generator=gen), torch.randint(0, classes, (n,), generator=gen))


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, ``layers`` post-norm encoder layers, mean pool, linear head."""

    def __init__(
        self, vocab: int, seq: int, d_model: int, heads: int, ff: int, layers: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(x).mean(dim=1))


def transformer(
    vocab: int = 1000,
    seq: int = 32,
    d_model: int = 256,
    heads: int = 4,
    ff: int = 1024,
    layers: int = 2,
    classes: int = 10,
    dropout: float = 0.1,
) -> nn.Module:
    return TinyTransformer(vocab, seq, d_model, heads, ff, layers, classes, dropout)


def token_set(n: int = 2048, seq: int = 32, vocab: int = 1000, classes: int = 10, seed: int = 1) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randint(0, vocab, (n, seq), generator=gen), torch.randint(0, classes, (n,), generator=gen)
    )


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    data: str
    batch: int  # samples per training process per step
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # cuda: DDP over NCCL, one rank per GPU; pstrain: one worker driving every GPU
    processes: int = PROCESSES  # CPU: training processes; cuda: GPUs

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def build_model(self) -> nn.Module:
        from pstrain.runtime.factories import build_model

        return build_model(self.model, json.dumps(self.model_kwargs), SEED)

    def build_dataset(self) -> Dataset:
        from pstrain.runtime.factories import build_dataset

        return build_dataset(self.data, json.dumps(self.data_kwargs))


# Next to no compute and 33K parameters: the step is each system's fixed cost per step (calls, threads, hooks,
# reports), which a GPU's short steps expose; the other cases hide it behind compute on 2 cores.
FIXED_COST = Case(
    "mlp 8x64, 8/proc (fixed cost per step)",
    "bench.step:mlp",
    "bench.step:mlp_set",
    8,
    model_kwargs={"width": 64},
    data_kwargs={"width": 64},
)
CASES = (
    Case("mlp 8x1024, 64/proc", "bench.step:mlp", "bench.step:mlp_set", 64),
    Case("mlp 8x1024, 256/proc", "bench.step:mlp", "bench.step:mlp_set", 256),
    Case("transformer 2x256, 32x32 tok/proc", "bench.step:transformer", "bench.step:token_set", 32),
    FIXED_COST,
)
# A GPU computes the CPU cases' batches in well under a millisecond: larger batches show where compute
# starts to hide the trip to the CPU shards and back.
CUDA_CASES = (
    CASES[0],
    Case("mlp 8x1024, 4096/GPU", "bench.step:mlp", "bench.step:mlp_set", 4096, data_kwargs={"n": 65536}),
    CASES[2],
    Case(
        "transformer 2x256, 512x32 tok/GPU",
        "bench.step:transformer",
        "bench.step:token_set",
        512,
        data_kwargs={"n": 16384},
    ),
    FIXED_COST,
)


@dataclass(frozen=True)
class Steps:
    warm: int
    measured: int
    ddp_compute: int  # DDP no_sync iterations for its compute-only time

    def __post_init__(self) -> None:
        if self.warm < 1 or self.measured < 1:
            raise ValueError(f"need at least 1 warm-up and 1 measured step, got {self}")


# ---------------------------------------------------------------- DDP


def _endless(loader: torch.utils.data.DataLoader, sampler: Any) -> Iterator[Any]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _ddp_rank(rank: int, case: Case, port: int, steps: Steps, result: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    # Its own session, as LocalCluster gives each pstrain process: with autogroup scheduling (Linux's
    # default) every session is one scheduling group, and on a machine that other work also loads a
    # rank sharing its group with the other rank would get half the CPU a pstrain worker gets.
    with contextlib.suppress(OSError):
        os.setsid()
    if case.cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if case.cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=case.processes,
        timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S),
    )
    try:
        model = DistributedDataParallel(case.build_model().to(device), device_ids=[rank] if case.cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        dataset = case.build_dataset()
        sampler = DistributedSampler(dataset, case.processes, rank, shuffle=True, seed=SEED, drop_last=True)
        loader = DataLoader(dataset, batch_size=case.batch, sampler=sampler, drop_last=True, pin_memory=case.cuda)
        batches = _endless(loader, sampler)

        def step() -> float:
            started = time.perf_counter()
            inputs, targets = next(batches)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if case.cuda:  # the step is over when the GPU is done with it
                torch.cuda.synchronize(device)
            return time.perf_counter() - started

        dist.barrier()
        for _ in range(steps.warm):
            step()
        cpu_started = time.process_time()  # every thread of the rank, gloo's included
        times = [step() for _ in range(steps.measured)]
        cpu_s = time.process_time() - cpu_started
        dist.barrier()
        with model.no_sync():  # the same loop without the all-reduce: DDP's compute alone
            compute = [step() for _ in range(steps.ddp_compute + 1)][1:]
        gathered: list[Any] = [None] * case.processes
        dist.all_gather_object(gathered, {"times": times, "compute": compute, "cpu_s": cpu_s})
        if rank == 0:
            Path(result).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_ddp(case: Case, steps: Steps, work: Path) -> dict[str, Any]:
    """Per measured step, the slower rank's iteration (``step_s``) and its ``no_sync`` iteration (``compute_s``)."""
    import torch.multiprocessing as mp

    result = work / "ddp.json"
    mp.spawn(_ddp_rank, args=(case, free_port(), steps, str(result)), nprocs=case.processes, join=True)
    ranks = json.loads(result.read_text())
    return {
        "step_s": [max(values) for values in zip(*(r["times"] for r in ranks), strict=True)],
        "compute_s": [max(values) for values in zip(*(r["compute"] for r in ranks), strict=True)],
        "cpu_ms": 1e3 * sum(r["cpu_s"] for r in ranks) / steps.measured,  # both ranks, per measured step
    }


# ---------------------------------------------------------------- pstrain


def _job(
    case: Case, steps: int, ps_shards: int, bucket_bytes: int | None = None, push_dtype: str | None = None
) -> dict[str, Any]:
    settings: dict[str, Any] = {"bucket_bytes": bucket_bytes, "push_dtype": push_dtype}
    transport = {k: v for k, v in settings.items() if v is not None}
    return {
        **({"transport": transport} if transport else {}),
        "model": {"factory": case.model, "kwargs": case.model_kwargs},
        "data": {"factory": case.data, "kwargs": case.data_kwargs, "shard_size": 512, "shuffle": True},
        "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "batch": {"per_device": case.batch, "lr_scaling": "none"},
        "job": {"steps": steps, "seed": SEED, "name": "bench-step"},
        # CPU: one worker per training process. cuda: the design's layout, one worker summing its host's GPUs.
        "cluster": {
            "ps_shards": ps_shards,
            "workers": _workers(case),
            "devices_per_worker": case.processes if case.cuda else ["cpu"],
        },
        "checkpoint": {"every_steps": 0},  # this measures steps, not checkpoints
    }


def _workers(case: Case) -> int:
    return 1 if case.cuda else case.processes


def _scrape(address: str) -> dict[str, float]:
    """Every ``pstrain_*_sum`` / ``_count`` sample of one Prometheus endpoint, and the process's CPU seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if (sample.name.startswith("pstrain_") and sample.name.endswith(("_sum", "_count")))
        or sample.name == "process_cpu_seconds_total"
    }


def _mean_ms(before: list[dict[str, float]], after: list[dict[str, float]], histogram: str) -> float:
    """Mean of ``histogram`` over the observations between two scrapes, summed over the members."""
    total = sum(
        a.get(f"{histogram}_sum", 0.0) - b.get(f"{histogram}_sum", 0.0) for b, a in zip(before, after, strict=True)
    )
    count = sum(
        a.get(f"{histogram}_count", 0.0) - b.get(f"{histogram}_count", 0.0) for b, a in zip(before, after, strict=True)
    )
    return 1e3 * total / count if count else float("nan")


def _total_ms(before: list[dict[str, float]], after: list[dict[str, float]], histogram: str) -> float:
    """Sum of ``histogram`` over the observations between two scrapes, summed over the members."""
    return 1e3 * sum(
        a.get(f"{histogram}_sum", 0.0) - b.get(f"{histogram}_sum", 0.0) for b, a in zip(before, after, strict=True)
    )


def _counter_ms(before: list[dict[str, float]], after: list[dict[str, float]], counter: str) -> float:
    """How much ``counter`` (seconds) grew between two scrapes, summed over the members, in ms."""
    return 1e3 * sum(a.get(counter, 0.0) - b.get(counter, 0.0) for b, a in zip(before, after, strict=True))


def run_pstrain(
    case: Case,
    steps: Steps,
    ps_shards: int,
    work: Path,
    bucket_bytes: int | None = None,
    push_dtype: str | None = None,
) -> dict[str, Any]:
    """Run a real local cluster; call in a process that has not used gRPC (``LocalCluster`` forks)."""
    import yaml

    from pstrain.coordinator.config import load_config
    from pstrain.launcher.local_cluster import LocalCluster
    from pstrain.protos import pstrain_pb2 as pb
    from pstrain.protos import pstrain_pb2_grpc as pb_grpc
    from pstrain.runtime.transport import open_channel

    job_path = work / "job.yaml"
    job_path.write_text(
        yaml.safe_dump(_job(case, steps.warm + steps.measured + TAIL_STEPS, ps_shards, bucket_bytes, push_dtype))
    )
    out = work / "out"
    cluster = LocalCluster(job_path, load_config(job_path), out, grace_s=5.0)
    marks = {steps.warm: "before", steps.warm + steps.measured: "after"}
    scrapes: dict[str, dict[str, list[dict[str, float]]]] = {}
    failures: list[BaseException] = []
    channel = None
    try:
        cluster.start()  # every fork happens here, before this process opens a channel
        channel = open_channel(cluster.coordinator_address)
        stub = pb_grpc.CoordinatorStub(channel)

        def follow() -> None:
            """Scrape every member when the last warm-up and the last measured step complete."""
            try:
                endpoints: dict[str, list[str]] = {}
                for event in stub.WatchProgress(pb.WatchProgressRequest(), timeout=3600):
                    if event.global_batch == 0:
                        return  # the job is over
                    if not endpoints:
                        status = stub.GetJobStatus(pb.JobStatusRequest(), timeout=30)
                        for role in ("worker", "ps"):
                            endpoints[role] = sorted(m.metrics_address for m in status.members if m.role == role)
                        endpoints["coordinator"] = [status.metrics_address] if status.metrics_address else []
                    mark = marks.get(event.step + 1)
                    if mark is not None:
                        scrapes[mark] = {role: [_scrape(a) for a in addresses] for role, addresses in endpoints.items()}
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        watcher = threading.Thread(target=follow, name="scrape", daemon=True)
        watcher.start()
        cluster.run()  # to the job's end; raises if a process dies or the job fails
        watcher.join(timeout=60)
    finally:
        if channel is not None:
            channel.close()
        cluster.shutdown()
    if failures:
        raise RuntimeError(f"scraping the members' metrics failed: {failures[0]!r}") from failures[0]
    if set(scrapes) != {"before", "after"}:
        raise RuntimeError(f"missed a scrape (got {sorted(scrapes)})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = records[steps.warm : steps.warm + steps.measured]
    before, after = scrapes["before"], scrapes["after"]
    if len(after["worker"]) != _workers(case) or not after["ps"]:
        raise RuntimeError(f"expected {_workers(case)} workers and the shards in GetJobStatus, got {after}")
    return {
        "step_s": [r["step_s"] for r in measured],
        "worker_step_ms": _mean_ms(before["worker"], after["worker"], "pstrain_worker_step_seconds"),
        "compute_ms": _mean_ms(before["worker"], after["worker"], "pstrain_worker_compute_seconds"),
        "push_ms": _mean_ms(before["worker"], after["worker"], "pstrain_worker_push_seconds"),
        "pull_ms": _mean_ms(before["worker"], after["worker"], "pstrain_worker_pull_seconds"),
        # S4: a shard updates each piece on its own; the update of a step is the sum over its pieces
        "update_ms": _total_ms(before["ps"], after["ps"], "pstrain_ps_update_seconds")
        / (steps.measured * len(after["ps"])),
        # CPU time per measured step, summed over the processes of each kind (process_cpu_seconds_total)
        **{
            f"cpu_{role}_ms": _counter_ms(before[role], after[role], "process_cpu_seconds_total") / steps.measured
            for role in ("worker", "ps", "coordinator")
        },
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
    }


def _pstrain_child(args: argparse.Namespace) -> int:
    """``--pstrain-case``: one pstrain measurement in a fresh process, so no fork ever follows gRPC."""
    case = Case(**json.loads(args.pstrain_case))
    steps = Steps(**json.loads(args.steps_json))
    figures = run_pstrain(case, steps, args.ps_shards, Path(args.work), args.bucket_bytes, args.push_dtype)
    Path(args.work, "pstrain.json").write_text(json.dumps(figures))
    return 0


def run_pstrain_isolated(
    case: Case,
    steps: Steps,
    ps_shards: int,
    work: Path,
    bucket_bytes: int | None = None,
    push_dtype: str | None = None,
) -> dict[str, Any]:
    env = {
        **os.environ,
        **({} if case.cuda else THREADS_ENV),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pstrain-case", json.dumps(asdict(case))]
    cmd += ["--steps-json", json.dumps(asdict(steps)), "--ps-shards", str(ps_shards), "--work", str(work)]
    if bucket_bytes is not None:
        cmd += ["--bucket-bytes", str(bucket_bytes)]
    if push_dtype is not None:
        cmd += ["--push-dtype", push_dtype]
    log_path = work / "driver.log"
    with open(log_path, "wb") as log_file:
        try:
            # The cluster's processes get SIGKILL with the driver (PR_SET_PDEATHSIG), so a timeout leaves nothing.
            run = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
            )
            code = run.returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        what = f"timed out after {RUN_TIMEOUT_S} s" if code == -1 else f"exit {code}"
        raise RuntimeError(f"pstrain run failed ({what}); logs under {work}:\n{tail}")
    return json.loads((work / "pstrain.json").read_text())


# ---------------------------------------------------------------- report


BREAKDOWN = ("compute_ms", "push_ms", "pull_ms", "update_ms", "worker_step_ms")
CPU_ROLES = ("worker", "ps", "coordinator")


@dataclass
class Row:
    """One case: every round's DDP and pstrain run, pooled."""

    case: Case
    params: int
    ddp_runs: list[dict[str, Any]] = field(default_factory=list)
    pstrain_runs: list[dict[str, Any]] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)  # "DDP 1.23 / pstrain 2.34" per round

    @property
    def ddp_step_ms(self) -> float:
        return 1e3 * statistics.median(t for run in self.ddp_runs for t in run["step_s"])

    @property
    def ddp_compute_ms(self) -> float:
        return 1e3 * statistics.median(t for run in self.ddp_runs for t in run["compute_s"])

    @property
    def pstrain_step_ms(self) -> float:
        return 1e3 * statistics.median(t for run in self.pstrain_runs for t in run["step_s"])

    def pstrain_mean(self, key: str) -> float:
        """Every round measures as many steps, so the mean of the rounds' means is the mean over all steps."""
        return statistics.fmean(run[key] for run in self.pstrain_runs)

    @property
    def ratio(self) -> float:
        return self.pstrain_step_ms / self.ddp_step_ms

    @property
    def ddp_cpu_ms(self) -> float:
        return statistics.fmean(run["cpu_ms"] for run in self.ddp_runs)

    @property
    def pstrain_cpu_ms(self) -> float:
        return sum(self.pstrain_mean(f"cpu_{role}_ms") for role in CPU_ROLES)

    def rounds(self) -> str:
        ddp = ", ".join(f"{1e3 * statistics.median(run['step_s']):.0f}" for run in self.ddp_runs)
        ps = ", ".join(f"{1e3 * statistics.median(run['step_s']):.0f}" for run in self.pstrain_runs)
        return f"DDP {ddp} ms; pstrain {ps} ms"


def _wait_policy() -> str:
    """What this run's OpenMP pools did when idle: the bench passes its environment to both systems."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return f"`{policy}`" if policy else "unset (libgomp's default: spin a while, then sleep)"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _source() -> str:
    """Which code was measured: the git commit (and whether the tree had uncommitted changes)."""
    if "PSTRAIN_BENCH_SOURCE" in os.environ:  # a snapshot outside git says what it is
        return os.environ["PSTRAIN_BENCH_SOURCE"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if commit.returncode != 0:
        return "unknown (not a git checkout)"
    changed = [line for line in dirty.stdout.splitlines() if not line[3:].startswith("bench/")]
    return f"commit {commit.stdout.strip()}" + (" with uncommitted changes" if changed else "")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


HEADER = (
    "| case | params | DDP step ms | DDP compute ms | pstrain step ms | pstrain / DDP "
    "| compute ms | exposed push ms | exposed pull ms | update ms |"
)


def table(rows: list[Row]) -> str:
    lines = [HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        compute, push, pull, update = (r.pstrain_mean(key) for key in BREAKDOWN[:4])
        lines.append(
            f"| {r.case.name} | {r.params / 1e6:.2f}M | {r.ddp_step_ms:.1f} | {r.ddp_compute_ms:.1f} "
            f"| {r.pstrain_step_ms:.1f} | **{r.ratio:.2f}x** | {compute:.1f} | {push:.1f} | {pull:.1f} | {update:.1f} |"
        )
    return "\n".join(lines)


CPU_HEADER = (
    "| case | DDP CPU ms/step | pstrain CPU ms/step | pstrain / DDP | workers | shards | coordinator |\n"
    "|---|---:|---:|---:|---:|---:|---:|"
)


def cpu_table(rows: list[Row]) -> str:
    """CPU time per step summed over each system's processes: what the shared cores must carry per step."""
    lines = [CPU_HEADER]
    for r in rows:
        workers, shards, coordinator = (r.pstrain_mean(f"cpu_{role}_ms") for role in CPU_ROLES)
        lines.append(
            f"| {r.case.name} | {r.ddp_cpu_ms:.1f} | {r.pstrain_cpu_ms:.1f} "
            f"| **{r.pstrain_cpu_ms / r.ddp_cpu_ms:.2f}x** | {workers:.1f} | {shards:.1f} | {coordinator:.1f} |"
        )
    return "\n".join(lines)


def write_results(
    rows: list[Row], steps: Steps, args: argparse.Namespace, loads: tuple[str, str], wall_s: float
) -> None:
    import grpc

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cores = os.cpu_count()
    per_round = "\n".join(
        f"- {r.case.name}: {r.rounds()}; 1-min load at each start: {'; '.join(r.loads)}" for r in rows
    )
    losses = "\n".join(
        f"- {r.case.name}: {r.pstrain_runs[0]['loss_first']:.3f} -> {r.pstrain_runs[0]['loss_last']:.3f}" for r in rows
    )
    default = f"the config default, {DEFAULT_BUCKET_BYTES >> 20} MiB"
    buckets = default if args.bucket_bytes is None else f"{args.bucket_bytes} bytes"
    text = f"""# pstrain step time vs. PyTorch DDP (bench/step.py)

- Run {now}, {wall_s:.0f} s in all; code: {_source()}.
- Machine: {platform.machine()}, {_cpu_model()}, **{cores} cores** (`nproc`); Python {platform.python_version()},
  torch {torch.__version__}, grpcio {grpc.__version__}.
- Load average (1 / 5 / 15 min): {loads[0]} at the start, {loads[1]} at the end. **The {cores} cores are shared
  by every process of both systems, and by whatever else runs on the machine** (other sessions' test runs,
  if the load average is well above 2): absolute times are noisy; the ratios come from this one run.

## Setup

- Both systems: {PROCESSES} training processes, the same model factory and seeded initial weights, the same
  synthetic data set, the same samples per process per step, SGD lr {LR} momentum {MOMENTUM} on gradients
  averaged over the processes, and **1 intra-op torch thread in every process** (`OMP_NUM_THREADS=1` for
  pstrain's processes, `torch.set_num_threads(1)` in DDP's ranks), so the training processes of either
  system compete equally for the cores.
- DDP: `DistributedDataParallel` over gloo on 127.0.0.1, a `DataLoader` with a `DistributedSampler`.
- pstrain: a real local cluster (`LocalCluster`, as `pstrain local` starts it) on 127.0.0.1: the
  coordinator, **{args.ps_shards} PS shard process(es)** and {PROCESSES} workers x 1 CPU device; checkpoints off.
  The coordinator and the shards run on the same cores as the workers: that is part of pstrain's cost here.
- Each case runs {args.rounds} round(s), each a DDP run and a pstrain run (the order alternates between
  rounds), each {steps.warm} warm-up steps and then {steps.measured} measured steps; figures pool the rounds.

## Results

{table(rows)}

pstrain / DDP above 1 means pstrain is slower; issue 12's target is at most 1.0x.

CPU time per measured step, summed over all processes of each system (mean over the rounds):

{cpu_table(rows)}

- **DDP step**: median over the measured iterations (per iteration, the slower rank's) of next batch +
  zero_grad + forward + backward (with DDP's all-reduce) + `SGD.step`. **DDP compute**: the same loop under
  `no_sync()` ({steps.ddp_compute} iterations per round, no all-reduce); DDP step - DDP compute is DDP's exposed
  communication.
- **pstrain step**: median of the coordinator's `step_s` (`metrics.jsonl`, the interval between two step
  completions) over the measured steps.
- pstrain overlaps communication with compute (S4): gradients leave in buckets of `transport.bucket_bytes`
  ({buckets}) while backward runs, each shard updates each piece as soon as both workers pushed it, and the
  next forward waits per bucket.
- pstrain pushes gradients as `transport.push_dtype` = {args.push_dtype or "float32"} (bfloat16 halves the push
  bytes; the shards keep float32 weights and sums).
- **compute / exposed push / exposed pull**: the workers' `pstrain_worker_{{compute,push,pull}}_seconds`
  histograms, scraped from their metrics endpoints when the last warm-up and the last measured step
  complete; mean over the measured steps of both workers. Compute: next batch + forward/backward (with the
  per-bucket host sums and pushes running beside it), without forward's waits for parameters. Exposed push:
  the wait for the pushes' acknowledgements after backward. Exposed pull: the time forward waited for
  buckets of new parameters (it includes waiting for the slower worker and the shards' updates). A colocated
  piece's push and pull are one call whose acknowledgement comes with the new version, so its whole wait
  counts as exposed push: read the sum of the two.
  **update**: the shards' `pstrain_ps_update_seconds` summed over a shard's pieces, mean per shard and step
  (the shards update their ranges in parallel, and pieces while backward still runs).
- **CPU ms/step**: DDP: `time.process_time()` of each rank over its measured steps, summed over the ranks, per
  step. pstrain: `process_cpu_seconds_total` of every worker, shard and the coordinator (their Prometheus
  endpoints, the same two scrapes), per measured step. With {cores} cores shared by everything, a step cannot take
  less than about CPU ms / {cores}; this figure depends less on the machine's other load than the step time.

Median step per round:

{per_round}

pstrain loss, first -> last step of round 1 (sanity: it trains):

{losses}
"""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)


def write_cuda_results(
    rows: list[Row], steps: Steps, args: argparse.Namespace, loads: tuple[str, str], wall_s: float
) -> None:
    """``--device cuda``: the same tables, another setup (NCCL, one rank per GPU; one pstrain worker)."""
    import grpc

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpus = args.processes
    name = torch.cuda.get_device_name(0)
    per_round = "\n".join(f"- {r.case.name}: {r.rounds()}" for r in rows)
    buckets = "the config default" if args.bucket_bytes is None else f"{args.bucket_bytes} bytes"
    text = f"""# pstrain step time vs. PyTorch DDP on GPUs (bench/step.py --device cuda)

- Run {now}, {wall_s:.0f} s in all; code: {_source()}.
- Machine: **{gpus} x {name}**, {platform.machine()} {_cpu_model()}, {os.cpu_count()} cores; Python
  {platform.python_version()}, torch {torch.__version__}, grpcio {grpc.__version__}. Load average (1 / 5 / 15 min):
  {loads[0]} at the start, {loads[1]} at the end.

## Setup

- DDP: `DistributedDataParallel` over NCCL, {gpus} rank(s), one GPU each (with one GPU: plain local
  training), a pinned `DataLoader` with a `DistributedSampler`; torch's default threads; SGD on the GPU.
  A step ends with `torch.cuda.synchronize()`.
- OpenMP wait policy (`OMP_WAIT_POLICY` in the bench's environment): {_wait_policy()} for DDP's ranks; pstrain's
  services start with `PASSIVE` unless that variable is set (`runtime/openmp.py`).
- pstrain: a real local cluster on 127.0.0.1, **one worker driving all {gpus} GPU(s)** (the design's layout: the
  host sums its GPUs' gradients in pinned host memory, S2) and **{args.ps_shards} CPU PS shard process(es)**
  that run the SGD update (each with the shard's own intra-op threads); buckets: {buckets}; checkpoints off.
- Same model factory, seeded initial weights, synthetic data, samples per GPU per step, SGD lr {LR} momentum
  {MOMENTUM} on gradients averaged over the GPUs; {args.rounds} round(s) per case, the order alternating, each
  {steps.warm} warm-up and {steps.measured} measured steps. Columns as in `step.md`.

## Results

{table(rows)}

CPU time per measured step, summed over each system's processes:

{cpu_table(rows)}

Median step per round:

{per_round}
"""
    CUDA_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    CUDA_RESULTS.write_text(text)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round of few steps: checks that everything runs")
    p.add_argument("--warm", type=int, help="warm-up steps per run (default 4, --quick 2)")
    p.add_argument("--measured", type=int, help="measured steps per run (default 20, --quick 5)")
    p.add_argument("--rounds", type=int, help="DDP + pstrain runs per case, order alternating (default 2, --quick 1)")
    p.add_argument("--ps-shards", type=int, default=2, help="pstrain PS shard processes (default 2)")
    p.add_argument(
        "--bucket-bytes",
        type=int,
        help=f"pstrain transport.bucket_bytes (default: the config's, {DEFAULT_BUCKET_BYTES >> 20} MiB; 0: one bucket)",
    )
    p.add_argument(
        "--push-dtype", choices=("float32", "bfloat16"), help="pstrain transport.push_dtype (default: float32)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: DDP over NCCL vs one pstrain worker on the GPUs; cases with larger batches; "
        f"results to {CUDA_RESULTS.relative_to(ROOT)}",
    )
    p.add_argument("--processes", type=int, help=f"training processes (cpu, default {PROCESSES}) or GPUs (cuda: all)")
    p.add_argument("--cases", help="comma-separated case numbers to run (1-based; default all)")
    p.add_argument("--no-write", action="store_true", help=f"print only, do not write {RESULTS.relative_to(ROOT)}")
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs, metrics.jsonl)")
    p.add_argument("--pstrain-case", help=argparse.SUPPRESS)  # internal: one pstrain run in a child process
    p.add_argument("--steps-json", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pstrain_case:
        return _pstrain_child(args)
    steps = Steps(
        warm=args.warm or (2 if args.quick else 4),
        measured=args.measured or (5 if args.quick else 20),
        ddp_compute=5 if args.quick else 8,
    )
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this host has no CUDA device")
        args.processes = args.processes or torch.cuda.device_count()
        catalogue = CUDA_CASES
    else:
        args.processes = args.processes or PROCESSES
        catalogue = CASES
    chosen = [catalogue[int(i) - 1] for i in args.cases.split(",")] if args.cases else list(catalogue)
    cases = [replace(case, device=args.device, processes=args.processes) for case in chosen]
    load_start = _load()
    started = time.monotonic()
    print(f"load average at start: {load_start}; {len(cases)} case(s), {args.rounds} round(s), {steps}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="pstrain-bench-step-"))
    rows: list[Row] = []
    try:
        for index, case in enumerate(cases, 1):
            row = Row(case, sum(p.numel() for p in case.build_model().parameters()))
            rows.append(row)
            for round_ in range(args.rounds):
                work = root / f"case{index}-round{round_}"
                work.mkdir()
                systems = ["DDP", "pstrain"] if round_ % 2 == 0 else ["pstrain", "DDP"]
                load: dict[str, float] = {}
                for system in systems:
                    print(f"[{index}/{len(cases)}] {case.name}, round {round_ + 1}: {system} ...", flush=True)
                    load[system] = os.getloadavg()[0]
                    if system == "DDP":
                        row.ddp_runs.append(run_ddp(case, steps, work))
                    else:
                        figures = run_pstrain_isolated(
                            case, steps, args.ps_shards, work, args.bucket_bytes, args.push_dtype
                        )
                        row.pstrain_runs.append(figures)
                row.loads.append(f"DDP {load['DDP']:.2f} / pstrain {load['pstrain']:.2f}")
            print(
                f"    DDP step {row.ddp_step_ms:.1f} ms (compute {row.ddp_compute_ms:.1f}); "
                f"pstrain step {row.pstrain_step_ms:.1f} ms = {row.ratio:.2f}x DDP ({row.rounds()})",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    load_end = _load()
    print(f"load average at end: {load_end}\n\n{table(rows)}\n\n{cpu_table(rows)}")
    if not args.no_write:
        write = write_cuda_results if args.device == "cuda" else write_results
        write(rows, steps, args, (load_start, load_end), time.monotonic() - started)
        print(f"\nwrote {(CUDA_RESULTS if args.device == 'cuda' else RESULTS).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
