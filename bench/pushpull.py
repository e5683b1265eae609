"""Push+pull throughput of the parameter server vs. raw TCP and a gloo all-reduce, same run.

For a flat model of ``--params`` float32 parameters and one worker, a step is: push the
gradient to every shard (each shard then runs its SGD update) and pull the new parameters
back. Throughput = 2 x model bytes / step time. In the same run the script measures:

* raw TCP: the same bytes sent to another process over loopback and sent back (the bound);
* gloo: ``torch.distributed.all_reduce`` of the same tensor between 2 processes (what users
  would otherwise pick; its "throughput" uses the same 2 x bytes / time definition).
* the remote path (issue 12): the client's ``shared_memory`` off (every peer here is on this
  host, so the rows would otherwise take the colocated path), payloads on bulk sockets (raw TCP
  beside gRPC, ``ps_server/bulk.py``): the headline rows; and the same with ``bulk`` off too, the
  payloads streamed in gRPC messages (what a TLS channel uses), for several chunk sizes;
* the colocated shared-memory path: the client's ``shared_memory`` on, so the tensor bytes go
  through ``/dev/shm`` and gRPC carries headers.

PS shards run in their own processes, as in production (an asyncio gRPC server with the
data plane's byte-level serializers). Results go to ``bench/results/pushpull.md``.

Copies per direction (``--copies``, on when gdb is installed): the script runs itself under
gdb for one push, one pull of an already-encoded version and one first pull of a new version
of a 4 MiB shard (client and server in one process), over bulk sockets and over gRPC streams,
counts the bytes every libc memcpy/memmove of 4 KiB or more moves, and divides by the payload:
user-space copies of each payload byte, gRPC's own included (see ``protos/codec.py``). The
kernel's socket copies (two per direction, as for raw TCP) are not counted.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pstrain.protos import pstrain_pb2 as pb  # noqa: E402
from pstrain.ps_server.optimizer import update_threads  # noqa: E402
from pstrain.ps_server.pieces import PiecedShard  # noqa: E402
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server  # noqa: E402
from pstrain.ps_server.shard import ParameterShard  # noqa: E402
from pstrain.runtime.buckets import shard_pieces  # noqa: E402
from pstrain.runtime.layout import ParamLayout  # noqa: E402
from pstrain.runtime.ps_client import PsClient  # noqa: E402
from pstrain.runtime.shard_map import ShardRange, shard_ranges  # noqa: E402
from pstrain.runtime.transport import start_server  # noqa: E402

MB = 1e6


def model_pieces(total: int, shards: int, piece_bytes: int) -> list[ShardRange]:
    """The pieces a job's buckets of ``piece_bytes`` cut the shards of a flat model into (as ``pstrain plan``)."""
    per = max(1, piece_bytes // 4)
    sizes = [min(per, total - start) for start in range(0, total, per)]
    layout = ParamLayout.from_shapes([str(i) for i in range(len(sizes))], [[n] for n in sizes])
    return [p for r in shard_ranges(total, shards) for p in shard_pieces(layout, r, piece_bytes)]


def serve_shard(shard_id: int, total: int, shards: int, chunk_bytes: int, piece_bytes: int, conn: Connection) -> None:
    torch.set_num_threads(update_threads())  # as pstrain-ps sets them (1 on 2 cores, at most 4)
    r = shard_ranges(total, shards)[shard_id]
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    sgd, schedule = pb.OptimizerSpec(name="sgd"), pb.LrSchedule(scaled_lr=0.01)
    shard: ParameterShard | PiecedShard
    if piece_bytes:
        pieces = [p for p in model_pieces(total, shards, piece_bytes) if p.shard_id == shard_id]
        shard = PiecedShard.build(pieces, torch.zeros(r.numel), sgd, schedule, 1)
    else:
        shard = ParameterShard(shard_id, r.start, r.end, torch.zeros(r.numel), sgd, schedule, 1)
    servicer.attach(shard, chunk_bytes)
    conn.send(server.port)
    conn.recv()  # block until the parent says stop
    server.stop(0)
    servicer.close_shared_memory()


def time_pushpull(
    total: int,
    shards: int,
    chunk_bytes: int,
    steps: int,
    shared_memory: bool = False,
    bulk: bool = True,
    piece_bytes: int = 0,
) -> list[float]:
    """Median-ready step times of one worker: the whole model pushed and pulled back, shard by shard, or (with
    ``piece_bytes``) piece by piece as a training step moves it: every piece pushed in backward order, each one
    pulled back as soon as it is acknowledged (``push_pull_pieces``), so a piece's update overlaps the next ones'
    transfers."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    pieces = model_pieces(total, shards, piece_bytes)[::-1] if piece_bytes else []
    for shard_id in range(shards):
        parent, child = ctx.Pipe()
        args = (shard_id, total, shards, chunk_bytes, piece_bytes, child)
        proc = ctx.Process(target=serve_shard, args=args, daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        addresses = [f"127.0.0.1:{p.recv()}" for p in pipes]
        client = PsClient(
            addresses,
            total,
            chunk_bytes=chunk_bytes,
            push_timeout_s=600,
            pull_timeout_s=600,
            shared_memory=shared_memory,
            bulk=bulk,
        )
        grads = torch.randn(total)
        params = torch.empty(total)
        times = []
        for step in range(steps + 2):  # two warm-up steps
            started = time.perf_counter()
            if pieces:
                pushed, pulled = client.push_pull_pieces(grads, pieces, 0, step, 1, params)
                pushed.wait()
                pulled.wait()
            else:
                client.push(grads, 0, step, 1).wait()
                client.pull(step + 1, params)
            if step >= 2:
                times.append(time.perf_counter() - started)
        counts = client.shared.counts
        if shared_memory and counts.streamed_bytes:
            raise RuntimeError(f"the shared-memory run streamed {counts.streamed_bytes} bytes")
        pulls = (steps + 2) * (len(pieces) or shards)
        if shared_memory and counts.board_pulls != pulls:
            raise RuntimeError(f"{counts.board_pulls} of {pulls} pulls came off the shards' boards")
        if not shared_memory and bulk and (client.bulk._off or not any(client.bulk._idle.values())):
            raise RuntimeError("the bulk-socket run did not use bulk sockets")
        client.close()
        return times
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for proc in procs:
            proc.join(30)


def time_shard_alone(total: int, steps: int) -> list[float]:
    """The shard's share of a step: a push that completes the step, without gRPC. As a received push, the gradient
    is in a buffer the shard may keep as its accumulator (handing back the old one to receive the next push into)."""
    torch.set_num_threads(update_threads())  # as serve_shard
    shard = ParameterShard(0, 0, total, torch.zeros(total), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(), 1)
    grads = torch.randn(total)
    received = torch.empty(total)
    times = []
    for step in range(steps + 2):
        received.copy_(grads)  # what the network wrote, untimed
        handed: list[torch.Tensor] = []
        started = time.perf_counter()
        shard.push(0, step, received, 1, recycle=handed.append)
        if step >= 2:
            times.append(time.perf_counter() - started)
        received = handed[0] if handed else received
    return times


def _per_step(times: list[float], moved: int) -> tuple[float, float]:
    med = statistics.median(times)
    return med, moved / med / MB


def echo_server(conn, nbytes: int) -> None:  # type: ignore[no-untyped-def]
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while True:
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:], nbytes - got)
            if n == 0:
                return
            got += n
        sock.sendall(view)


def time_raw_tcp(nbytes: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=echo_server, args=(child, nbytes), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", parent.recv()))
    payload = memoryview(bytearray(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()))
    back = memoryview(bytearray(nbytes))
    times = []
    for i in range(rounds + 1):
        started = time.perf_counter()
        sock.sendall(payload)
        got = 0
        while got < nbytes:
            got += sock.recv_into(back[got:], nbytes - got)
        if i:
            times.append(time.perf_counter() - started)
    sock.close()
    proc.join(30)
    return times


def gloo_worker(rank: int, port: int, total: int, rounds: int, out) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.randn(total)
    times = []
    for i in range(rounds + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if i:
            times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    if rank == 0:
        out.send(times)


def time_gloo(total: int, rounds: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=gloo_worker, args=(r, port, total, rounds, child)) for r in range(2)]
    for p in procs:
        p.start()
    times = parent.recv()
    for p in procs:
        p.join(60)
    return times


PROBE_NUMEL = 1 << 20  # 4 MiB of float32 in one chunk
GDB_COMMANDS = """set pagination off
set confirm off
handle SIGTRAP stop nopass
handle SIGPIPE nostop noprint pass
run
break memcpy if $rdx >= 4096
commands
silent
printf "COPY %lu\\n", $rdx
continue
end
break memmove if $rdx >= 4096
commands
silent
printf "COPY %lu\\n", $rdx
continue
end
continue
delete
continue
"""
PROBE_PHASES = {
    "bulk-push": "push, bulk socket",
    "bulk-pull": "pull, bulk socket",
    "push": "push, gRPC stream",
    "pull": "pull (per pull), gRPC stream",
    "pull-new": "first pull of a version (+ encoding), gRPC stream",
}


def copy_probe(phase: str) -> None:
    """The inferior: one operation between two SIGTRAPs, at which gdb arms and disarms its breakpoints."""
    numel = PROBE_NUMEL
    servicer = ParameterServerServicer()
    server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
    shard = ParameterShard(0, 0, numel, torch.zeros(numel), pb.OptimizerSpec(name="sgd"), pb.LrSchedule(), 2)
    servicer.attach(shard, numel * 4)
    bulk = phase.startswith("bulk-")
    client = PsClient([f"127.0.0.1:{server.port}"], numel, chunk_bytes=numel * 4, shared_memory=False, bulk=bulk)
    grad, out = torch.ones(numel), torch.empty(numel)
    client.push(grad, 0, 0, 1).wait()  # the step's first contribution (and the bulk socket's handshake)
    client.pull(0, out)  # warm up the channel; version 0 is encoded
    if phase == "pull-new":
        client.push(grad, 1, 0, 1).wait()  # version 1 exists, nobody has pulled it
    os.kill(os.getpid(), signal.SIGTRAP)
    if phase.endswith("push"):
        client.push(grad, 1, 0, 1).wait()
    else:
        client.pull(1 if phase == "pull-new" else 0, out)
    os.kill(os.getpid(), signal.SIGTRAP)
    client.close()
    server.stop(0)


def count_copies(gdb: str) -> dict[str, float]:
    """Copies of each payload byte per phase, from gdb's log of the probe's big memcpys."""
    counts = {}
    with tempfile.NamedTemporaryFile("w", suffix=".gdb") as commands:
        commands.write(GDB_COMMANDS)
        commands.flush()
        for phase in PROBE_PHASES:
            run = subprocess.run(
                [gdb, "-q", "-batch", "-x", commands.name, "--args", sys.executable, __file__, "--copy-probe", phase],
                capture_output=True,
                text=True,
                timeout=600,
            )
            moved = sum(int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("COPY "))
            counts[phase] = moved / (PROBE_NUMEL * 4)
            print(f"copies per payload byte, {PROBE_PHASES[phase]:<40} {counts[phase]:.2f}", flush=True)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunk-kib", default="256,512,1024,4096", help="chunk sizes to sweep for S=1 over gRPC")
    parser.add_argument("--default-chunk-kib", type=int, default=512)
    parser.add_argument(
        "--piece-mib", type=int, default=8, help="piece size of the rows that move the model as training does"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pushpull.md"))
    parser.add_argument(
        "--copies",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count copies with gdb (default: when found)",
    )
    parser.add_argument("--copy-probe", choices=list(PROBE_PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.piece_mib < 1:
        parser.error("--piece-mib must be at least 1 (the whole-shard rows are the others)")
    if args.copy_probe:
        copy_probe(args.copy_probe)
        return 0
    load_start = os.getloadavg()[0]
    gdb = shutil.which("gdb")
    copies = count_copies(gdb) if gdb and args.copies is not False else {}

    nbytes = args.params * 4
    moved = 2 * nbytes
    rows: list[tuple[str, float, float]] = []  # name, median s, MB/s

    def record(name: str, times: list[float]) -> float:
        med = statistics.median(times)
        rows.append((name, med, moved / med / MB))
        print(f"{name:<40} {med * 1e3:9.1f} ms  {moved / med / MB:9.1f} MB/s", flush=True)
        return moved / med

    tcp = record("raw TCP loopback (send + receive)", time_raw_tcp(nbytes, args.steps))
    gloo = record("gloo all_reduce, 2 processes", time_gloo(args.params, args.steps))
    default = args.default_chunk_kib
    s1 = record("pstrain push+pull S=1, bulk sockets", time_pushpull(args.params, 1, default * 1024, args.steps))
    s2 = record("pstrain push+pull S=2, bulk sockets", time_pushpull(args.params, 2, default * 1024, args.steps))
    sweep = {}
    for kib in [int(k) for k in args.chunk_kib.split(",")]:
        sweep[kib] = record(
            f"pstrain push+pull S=1, gRPC stream, chunk {kib} KiB",
            time_pushpull(args.params, 1, kib * 1024, args.steps, bulk=False),
        )
    g1 = sweep.get(default) or record(
        f"pstrain push+pull S=1, gRPC stream, chunk {default} KiB",
        time_pushpull(args.params, 1, default * 1024, args.steps, bulk=False),
    )
    g2 = record(
        f"pstrain push+pull S=2, gRPC stream, chunk {default} KiB",
        time_pushpull(args.params, 2, default * 1024, args.steps, bulk=False),
    )
    shm1 = record(
        "pstrain push+pull S=1, shared memory", time_pushpull(args.params, 1, default * 1024, args.steps, True)
    )
    shm2 = record(
        "pstrain push+pull S=2, shared memory", time_pushpull(args.params, 2, default * 1024, args.steps, True)
    )
    piece_bytes = args.piece_mib << 20
    p1 = record(
        f"pstrain push+pull S=1, bulk sockets, {args.piece_mib} MiB pieces",
        time_pushpull(args.params, 1, default * 1024, args.steps, piece_bytes=piece_bytes),
    )
    pshm1 = record(
        f"pstrain push+pull S=1, shared memory, {args.piece_mib} MiB pieces",
        time_pushpull(args.params, 1, default * 1024, args.steps, True, piece_bytes=piece_bytes),
    )

    rows.append(
        (
            "shard push + SGD update alone, in process (no wire)",
            *_per_step(time_shard_alone(args.params, args.steps), moved),
        )
    )
    print(f"{rows[-1][0]:<40} {rows[-1][1] * 1e3:9.1f} ms", flush=True)

    ratios = [
        ("pstrain remote (bulk sockets) S=1 / raw TCP", s1 / tcp),
        ("pstrain remote (bulk sockets) S=2 / raw TCP", s2 / tcp),
        ("pstrain remote (bulk sockets) S=1 / gloo all_reduce", s1 / gloo),
        ("pstrain remote (bulk sockets) S=2 / gloo all_reduce", s2 / gloo),
        (f"pstrain gRPC stream S=1 (chunk {default} KiB) / raw TCP", g1 / tcp),
        (f"pstrain gRPC stream S=2 (chunk {default} KiB) / raw TCP", g2 / tcp),
        ("pstrain shared memory S=1 / raw TCP", shm1 / tcp),
        ("pstrain shared memory S=2 / raw TCP", shm2 / tcp),
        (f"pstrain remote (bulk sockets) S=1, {args.piece_mib} MiB pieces / raw TCP", p1 / tcp),
        (f"pstrain shared memory S=1, {args.piece_mib} MiB pieces / raw TCP", pshm1 / tcp),
    ]
    print()
    for name, ratio in ratios:
        print(f"{name:<55} {ratio:6.2f}x")

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]  # other processes on the host skew every row, the ratios less
    print(f"load average at the start {load_start:.1f}, at the end {load:.1f}")
    lines = [
        "# Push+pull throughput (bench/pushpull.py)",
        "",
        f"Run {when} on {platform.machine()} with {os.cpu_count()} cores (load average {load_start:.1f} at the "
        f"start, {load:.1f} at the end), "
        f"Python {platform.python_version()}, "
        f"torch {torch.__version__}, grpcio {grpc.__version__}. Model: {args.params:,} float32 parameters "
        f"({nbytes / MB:.0f} MB), one worker, {args.steps} timed steps after 2 warm-up steps (median). "
        "Throughput = 2 x model bytes / step time. PS shards and peers run in separate processes on loopback; "
        f"every pstrain step includes the shard's SGD update ({update_threads()} intra-op thread(s) per shard, as "
        "pstrain-ps sets them), timed alone in the last row (no wire).",
        "",
        "| what | median time per step | throughput |",
        "|---|---:|---:|",
        *[f"| {name} | {med * 1e3:.1f} ms | {mbs:.0f} MB/s |" for name, med, mbs in rows],
        "",
        "| ratio | value |",
        "|---|---:|",
        *[f"| {name} | {ratio:.2f} |" for name, ratio in ratios],
        "",
    ]
    if copies:
        lines += [
            "User-space copies of each payload byte (gdb: bytes moved by libc memcpy/memmove calls of 4 KiB or "
            "more / payload bytes; one 4 MiB shard, client and server in one process; gRPC's own copies included, "
            "the kernel's socket copies not):",
            "",
            "| operation | copies |",
            "|---|---:|",
            *[f"| {PROBE_PHASES[phase]} | {count:.1f} |" for phase, count in copies.items()],
            "",
        ]
    lines += [
        "Remote path on bulk sockets, by construction: the client writes the payload with ``sendall`` straight from "
        "the tensor and the shard reads it with ``recv_into`` straight into its staging buffer (push); the shard "
        "writes from the published parameters and the client reads into the caller's buffer (pull): 0 user-space "
        "copies per direction, the kernel's 2 (as raw TCP). Over a gRPC stream (TLS channels, bulk off): 1 out of "
        "the tensor (ours), 3 in gRPC Python (a slice to send, a ``bytes`` per received slice, their join), 1 into "
        "the destination (ours), plus 1 per published version for every pull of it (the shared encoding); gdb counts "
        "one more for a push, inside gRPC (not attributed).",
        "",
        "Shared-memory path (colocated; gRPC carries the header and the acknowledgement only), user-space copies "
        "of each payload byte by construction (torch ``copy_`` calls, which the gdb probe above cannot see):",
        "",
        "| operation | copies |",
        "|---|---:|",
        "| push (client: tensor -> push region; the shard reads it in place: one worker's straight into its update, "
        "else into its accumulator) | 1 |",
        "| pull (client: the shard's published board -> destination) | 1 |",
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
