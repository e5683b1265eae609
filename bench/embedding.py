"""Sparse embedding tables through pstrain vs. one process with ``nn.EmbeddingBag(sparse=True)`` (issue 9).

Same batches for both: Zipf-distributed ids (exponent 1.05) over a table of ``--rows`` x 64 float32
(default 10^6 = 256 MB; ``--rows 10000000`` for the issue's 2.5 GB table, which needs that much
free RAM per PS process set). Measured:

* rows/s: distinct rows looked up and updated per second. pstrain: one worker host (its row
  store over ``--devices`` CPU replicas) against 2 PS shards (each a ``SparseTables`` gRPC server
  in a separate process on 127.0.0.1), SGD on the shards; the baseline: ``nn.EmbeddingBag(sparse=True)``
  with ``torch.optim.SGD`` and with ``torch.optim.SparseAdam`` on the whole global batch in one process.
* bytes on the wire per step (pull + push payloads, protobuf sizes), against the distinct ids of
  the step: it scales with the ids, not the table.
* worker RSS (peak, ``VmHWM``) with 1, 2 and 4 devices at the same per-device batch: the
  row store holds one copy per host of the step's rows.

The PS shards create rows on first touch, so the first steps are slower (row creation); the
timed steps follow ``--warmup`` steps. Results go to ``bench/results/embedding.md``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import resource
import time

import numpy as np
import torch
from torch import nn

DIM = 64


def zipf_ids(rows: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Zipf-like ids in [0, rows): rank r drawn with probability ~ 1/r^1.05 (inverse CDF of the continuous law)."""
    s = 1.05
    u = rng.random(n)
    hi = rows ** (1 - s)
    ranks = ((1 - u) + u * hi) ** (1 / (1 - s))  # in [1, rows]
    return torch.from_numpy(np.minimum(ranks.astype(np.int64) - 1, rows - 1) * 7919 % rows)  # scatter hot ids


def batches(rows: int, steps: int, per_step: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [zipf_ids(rows, per_step, rng) for _ in range(steps)]


def serve_shards(rows: int, shards: int, workers: int, devices: int, ports: mp.Queue, stop: mp.Event) -> None:
    from pstrain.ps_server.sparse_service import SparseTablesServicer, add_sparse_tables
    from pstrain.ps_server.sparse_table import SparseShard
    from pstrain.runtime.sparse_rows import TableSpec
    from pstrain.runtime.transport import start_server

    torch.set_num_threads(1)
    spec = TableSpec("t", rows, DIM, seed=0, lr=0.05)
    servers = []
    for k in range(shards):
        servicer = SparseTablesServicer()
        server = start_server("127.0.0.1:0", [(add_sparse_tables, servicer)], ["SparseTables"], aio=True)
        servicer.attach(SparseShard(k, shards, [spec], workers, devices))
        server.set_serving(True)
        servers.append(server)
    ports.put([s.port for s in servers])
    stop.wait()
    for s in servers:
        s.stop(0)


class Bag(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        from pstrain.nn import SparseEmbedding

        self.emb = SparseEmbedding("t", rows, DIM, mode="sum")

    def sparse_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": x}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x)


def run_worker(
    rows: int, ports: list[int], devices: int, steps: list[torch.Tensor], warmup: int, out: mp.Queue
) -> None:
    from pstrain.runtime.sparse_client import SparseClient
    from pstrain.runtime.sparse_rows import TableSpec
    from pstrain.worker.row_store import HostRowStore

    torch.set_num_threads(1)
    spec = TableSpec("t", rows, DIM, seed=0, lr=0.05)
    client = SparseClient([f"127.0.0.1:{p}" for p in ports], [spec])
    models = [Bag(rows) for _ in range(devices)]
    store = HostRowStore(client, 0, [spec], models, [torch.device("cpu")] * devices)
    timed_rows = timed_bytes = 0
    started = 0.0
    for step, ids in enumerate(steps):
        if step == warmup:
            started, sent0 = time.perf_counter(), client.bytes_sent + client.bytes_received
            timed_rows = 0
        chunks = list(ids.view(devices, -1, 1))
        store.prepare(step, chunks)
        for m, x in zip(models, chunks, strict=True):
            m(x).sum().backward()
        timed_rows += store.rows_held
        store.push(step)
    elapsed = time.perf_counter() - started
    timed_bytes = client.bytes_sent + client.bytes_received - sent0
    client.close()
    timed = len(steps) - warmup
    out.put(
        {
            "rows_per_s": timed_rows / elapsed,
            "step_ms": 1000 * elapsed / timed,
            "unique_per_step": timed_rows / timed,
            "bytes_per_step": timed_bytes / timed,
            "rss_mb": peak_rss_mb(),
        }
    )


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss, which a spawned child inherits)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def baseline(rows: int, steps: list[torch.Tensor], warmup: int, optimizer: str) -> dict[str, float]:
    torch.set_num_threads(1)
    bag = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
    opt = torch.optim.SGD(bag.parameters(), lr=0.05) if optimizer == "sgd" else torch.optim.SparseAdam(bag.parameters())
    timed_rows, started = 0, 0.0
    for step, ids in enumerate(steps):
        if step == warmup:
            started, timed_rows = time.perf_counter(), 0
        opt.zero_grad()
        bag(ids.view(-1, 1)).sum().backward()
        opt.step()
        timed_rows += int(torch.unique(ids).numel())
    elapsed = time.perf_counter() - started
    return {"rows_per_s": timed_rows / elapsed, "step_ms": 1000 * elapsed / (len(steps) - warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (10000000 for the issue's 2.5 GB table)")
    p.add_argument("--per-device", type=int, default=2048, help="ids per device per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="bench/results/embedding.md")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    lines = [
        "# Sparse embedding tables: pstrain vs one-process nn.EmbeddingBag(sparse=True)",
        "",
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {os.cpu_count()} cores, "
        f"load average before: {os.getloadavg()[0]:.1f}. Table {args.rows:,} x {DIM} float32 "
        f"({args.rows * DIM * 4 / 2**20:.0f} MiB if fully created), Zipf(1.05) ids, {args.per_device} ids per "
        f"device per step, {args.steps - args.warmup} timed steps after {args.warmup}; 1 intra-op thread per process; "
        "2 PS shards (SGD) in their own process on 127.0.0.1.",
        "",
        "| run | devices | ms/step | distinct rows/step | rows/s | wire bytes/step | bytes per distinct row "
        "| worker RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for devices in (1, 2, 4):
        steps = batches(args.rows, args.steps, args.per_device * devices, seed=devices)
        ports_q, stop = ctx.Queue(), ctx.Event()
        server = ctx.Process(target=serve_shards, args=(args.rows, 2, 1, devices, ports_q, stop))
        server.start()
        ports = ports_q.get(timeout=120)
        out = ctx.Queue()
        worker = ctx.Process(target=run_worker, args=(args.rows, ports, devices, steps, args.warmup, out))
        worker.start()
        r = out.get(timeout=1200)
        worker.join()
        stop.set()
        server.join()
        lines.append(
            f"| pstrain (gRPC, 2 shards) | {devices} | {r['step_ms']:.1f} | {r['unique_per_step']:.0f} | "
            f"{r['rows_per_s']:,.0f} | {r['bytes_per_step']:,.0f} | {r['bytes_per_step'] / r['unique_per_step']:.0f} | "
            f"{r['rss_mb']:.0f} |"
        )
        for name in ("sgd", "sparseadam"):
            b = baseline(args.rows, steps, args.warmup, name)
            label = "EmbeddingBag(sparse) + " + ("SGD" if name == "sgd" else "SparseAdam")
            lines.append(f"| {label} | {devices} (one batch) | {b['step_ms']:.1f} | | {b['rows_per_s']:,.0f} | | | |")
        print("\n".join(lines[-3:]), flush=True)
    lines += ["", f"load average after: {os.getloadavg()[0]:.1f}"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
