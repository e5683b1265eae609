"""What ``data.prefetch`` saves a worker whose dataset takes time to read.

One worker, one CPU device, the 8 x Linear(1024) MLP at 64 samples a step, pushed to and pulled from in-memory
PS shards (the trainer and its buckets as in production, no network: the reading is what differs). Each sample's
read waits ``--read-ms`` (a file or object-store read: a wait that leaves the interpreter free), then returns an
in-memory tensor. ``data.prefetch: false`` reads each step's batch before its forward; ``true`` reads the next
step's batch in a background thread while this step computes. The two alternate over the rounds; the table gives the
median step time of each round and the ratio, with the read time per step and the compute time per step (a round
with reads of 0 ms) for scale. A read that holds the interpreter (decoding in Python) overlaps less than this. Results
go to ``bench/results/prefetch.md``; about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.ps_api import RetryPolicy
from pstrain.runtime.shard_map import shard_ranges
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64
WIDTH = 1024
BUCKET_BYTES = 4 << 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


class SlowReads(Dataset):
    """In-memory samples, each read waiting ``read_s`` first (released interpreter: I/O, not Python decoding)."""

    def __init__(self, samples: int, read_s: float) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, WIDTH, generator=gen)
        self.y = torch.randint(0, WIDTH, (samples,), generator=gen)
        self.read_s = read_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.read_s:
            time.sleep(self.read_s)
        return self.x[index], self.y[index]


class OneSource:
    def __init__(self, samples: int) -> None:
        self.indices = list(range(samples))

    def request(self) -> pb.DataShard:
        return pb.DataShard(data_shard_id=0, indices=self.indices)

    def complete(self, data_shard_id: int) -> None:
        pass


class Times:
    def __init__(self) -> None:
        self.step_s: list[float] = []

    def report(self, report: pb.StepReport) -> pb.Directive:
        self.step_s.append(report.step_s)
        return pb.Directive()


def run(steps: int, read_ms: float, prefetch: bool) -> float:
    """The median step time (s) of ``steps`` steps after 2 warm-up steps."""
    layout = ParamLayout.of(mlp())
    initial = layout.flatten(mlp())
    shards = [
        PiecedShard.build(
            shard_pieces(layout, r, BUCKET_BYTES),
            initial[r.start : r.end].clone(),
            pb.OptimizerSpec(name="sgd", momentum=0.9),
            pb.LrSchedule(scaled_lr=0.01),
            1,
        )
        for r in shard_ranges(layout.total, 2)
    ]
    total = steps + 2
    job = pb.JobSpec(steps=total, per_device_batch=BATCH, total_params=layout.total, bucket_bytes=BUCKET_BYTES)
    replicas = ReplicaSet(mlp, [torch.device("cpu")], layout)
    feed = DataFeed(SlowReads(BATCH * total, read_ms / 1000), OneSource(BATCH * total), prefetch)
    ps = LocalPsClient(shards, pull_timeout_s=60)
    times = Times()
    trainer = Trainer(0, job, replicas, ps, feed, F.cross_entropy, times, threading.Event(), RetryPolicy())
    try:
        assert trainer.run() == total
    finally:
        ps.close(cancel=True)
        replicas.close()
        feed.close()
    return statistics.median(times.step_s[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--read-ms", type=float, default=1.0, help="wait per sample read")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefetch.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    run(2, 0.0, False)  # warm the allocator and the kernels before the first timed round
    rows = []
    for round_ in range(args.rounds):
        compute = run(args.steps, 0.0, False)
        off = run(args.steps, args.read_ms, False)
        on = run(args.steps, args.read_ms, True)
        rows.append((round_ + 1, compute, off, on))
        print(
            f"round {round_ + 1}: reads of 0 ms {compute * 1000:.1f} ms; prefetch off {off * 1000:.1f} ms, "
            f"on {on * 1000:.1f} ms, ratio {on / off:.2f}"
        )
    read_s = BATCH * args.read_ms / 1000
    compute = statistics.median(r[1] for r in rows)
    load = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# data.prefetch (bench/prefetch.py)",
        "",
        f"Run {started} on {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}. One worker, "
        f"one CPU device, 8 x Linear({WIDTH}) MLP, {BATCH} samples a step, in-memory PS shards (2, SGD momentum); "
        f"each sample's read waits {args.read_ms:g} ms ({read_s * 1000:.0f} ms of reads per step). Median step time "
        f"of {args.steps} steps per run, after 2 warm-up steps; each round runs reads of 0 ms (the compute alone), "
        f"then prefetch off, then on. Load average {load:.1f} at the end.",
        "",
        "| round | reads of 0 ms | prefetch off | prefetch on | on / off |",
        "|---:|---:|---:|---:|---:|",
        *[
            f"| {r} | {c * 1000:.1f} ms | {off * 1000:.1f} ms | {on * 1000:.1f} ms | {on / off:.2f} |"
            for r, c, off, on in rows
        ],
        "",
        f"Bound: without prefetch a step takes compute + reads ({(compute + read_s) * 1000:.0f} ms); with it, "
        f"the larger of the two ({max(compute, read_s) * 1000:.0f} ms).",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
