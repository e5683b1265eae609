"""Abuse benchmark (issue 8): a live `pstrain local` job under bounded attacks from 127.0.0.1.

Each attack runs for ``--phase-s`` seconds against the running job while training steps/s are
measured from metrics.jsonl, and is compared with a quiet phase before it. Prints and records
(bench/results/abuse.md) each attack, the status codes it got back, and steps/s before and during:

* forged pushes: well-formed pushes (finite garbage and NaN) for a real worker id at the shard's
  current version, without its credential or with a made-up one, to every PS shard;
* forged step reports (loss NaN, samples -2000) and data-shard requests for worker 0;
* a pull flood: pulls for a far-future version of shard 0;
* oversized uploads: UploadBuffers with a 64 MiB payload under an unknown name, and a claimed
  shape of 2^40 (the coordinator's RSS before and after is recorded);
* status load: GetJobStatus, a legitimate read.

Each attacker is held to each of ``--rates`` calls/s in turn (default 1,000 and 100; uploads 10/s)
and at most 256 calls in flight; every loop is bounded in time; nothing leaves 127.0.0.1.
On one small host the attacker's own CPU is taken from training. So each attack runs from two
clients (``--clients``): gRPC's Python client (``Paced``), which spends about as much CPU per call
as the server spends refusing it, and pre-encoded HTTP/2 frames (``bench/h2_flood.py``), which
spend almost none, as an attacker on another host would: that run shows what the services
themselves give up. On a host with cores to spare, ``--job-cpus`` and ``--attacker-cpus`` pin the
job and the attacker to disjoint cores: the attacker's CPU is then nobody else's, as from another host,
and only the services' own cost of answering it is taken from training.

    python bench/abuse.py [--phase-s 10] [--rates 1000,100] [--clients raw,grpc] [--job-cpus 0-11 --attacker-cpus 12-15]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from google.protobuf.message import Message

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.h2_flood import H2Flood, RawCall  # noqa: E402
from pstrain.protos import pstrain_pb2 as pb  # noqa: E402
from pstrain.protos import pstrain_pb2_grpc as pb_grpc  # noqa: E402
from pstrain.protos.codec import encode_chunks  # noqa: E402
from pstrain.runtime.identity import HEADER  # noqa: E402
from pstrain.runtime.transport import open_channel  # noqa: E402
from tests.helpers import child_env, pids_with_marker, stop_local, wait_for  # noqa: E402

MAX_IN_FLIGHT = 256
RAW_SAMPLE = 50  # with the raw client, one call in this many goes through gRPC's client for its status code


def write_job(path: Path) -> Path:
    job = {
        "model": {"factory": "tests.helpers:odd_mlp", "kwargs": {"inputs": 32, "hidden": 64, "classes": 10}},
        "data": {
            "factory": "tests.helpers:classification_set",
            "kwargs": {"n": 2000, "inputs": 32, "classes": 10},
            "shard_size": 50,
        },
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "batch": {"per_device": 16},
        "job": {"steps": 1_000_000, "seed": 1, "name": "abuse"},
        "cluster": {"ps_shards": 2, "workers": 2, "devices_per_worker": ["cpu"]},
        "transport": {"heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0},
        "checkpoint": {"every_steps": 0},
    }
    path.write_text(yaml.safe_dump(job))
    return path


@dataclass
class Cluster:
    proc: subprocess.Popen
    marker: str
    out: Path
    coordinator: str
    ps: list[str]
    numel: list[int]

    def steps(self) -> int:
        path = self.out / "metrics.jsonl"
        return sum(1 for _ in path.open()) if path.exists() else 0

    def coordinator_rss_mib(self) -> float:
        for pid in pids_with_marker(self.marker):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"pstrain.coordinator" in cmdline:
                    status = Path(f"/proc/{pid}/status").read_text()
                    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
                    return kb / 1024
            except (OSError, StopIteration):
                continue
        return float("nan")


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as taskset writes it ("0-11,14") -> {0, ..., 11, 14}; each CPU must be one this process may use."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"{spec!r}: {part!r} is not a CPU number or range such as 0-11")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"{spec!r} names no CPU")
    if missing := cpus - os.sched_getaffinity(0):
        raise ValueError(f"{spec!r}: CPUs {sorted(missing)} are not available here ({len(os.sched_getaffinity(0))})")
    return cpus


def format_cpus(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (taskset's list)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@contextlib.contextmanager
def thread_pinned(cpus: set[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` for a while: a process it starts meanwhile inherits them (no ``preexec_fn``,
    which is unsafe in a process with threads, such as gRPC's)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def process_cpus(pids: list[int]) -> set[frozenset[int]]:
    """The distinct CPU sets of ``pids`` (those still alive)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            found.add(frozenset(os.sched_getaffinity(pid)))
    return found


def start_cluster(tmp: Path, cpus: set[int] | None = None) -> Cluster:
    """Starts the job, its processes on ``cpus`` (they inherit the launcher's affinity)."""
    job = write_job(tmp / "job.yaml")
    out = tmp / "out"
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "pstrain.launcher.cli", "local", "--config", str(job), "--out", str(out)]
    with thread_pinned(cpus):
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(marker), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cluster = Cluster(proc, marker, out, "", [], [])
    try:
        wait_for(lambda: cluster.steps() >= 5 or proc.poll() is not None, 180, "training to start")
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-3000:] if proc.stderr else "pstrain local exited")
        cluster.coordinator = f"127.0.0.1:{int((out / 'coordinator.port').read_text())}"
        with open_channel(cluster.coordinator) as channel:
            status = pb_grpc.CoordinatorStub(channel).GetJobStatus(pb.JobStatusRequest(), timeout=10)
        shards = sorted((m.id, m.address) for m in status.members if m.role == "ps")
        cluster.ps = [address for _, address in shards]
        for address in cluster.ps:
            with open_channel(address) as channel:
                s = pb_grpc.ParameterServerStub(channel).GetShardStatus(pb.ShardStatusRequest(), timeout=10)
                cluster.numel.append(s.end - s.start)
    except BaseException:
        stop_local(proc, marker)
        raise
    return cluster


@dataclass
class Outcome:
    attack: str
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    calls: int = 0
    note: str = ""

    def record(self, code: grpc.StatusCode) -> None:
        self.codes[code.name] += 1
        self.calls += 1


Attack = Callable[[Cluster, threading.Event, Outcome], None]


class Paced:
    """Starts calls (futures) at exactly ``rate`` per second, at most MAX_IN_FLIGHT outstanding, until ``stop``.

    One thread: each call's outcome is recorded by a done-callback (on gRPC's own thread), so the attacker spends
    its CPU on starting calls, not on polling them; what that still costs is reported (the process's CPU), since
    on one host the attacker's CPU is taken from training too.
    """

    def __init__(self, rate: float, stop: threading.Event, outcome: Outcome) -> None:
        self.rate, self.stop, self.outcome = rate, stop, outcome
        self._lock = threading.Lock()
        self._in_flight = 0

    def _done(self, future: grpc.Future) -> None:
        code = future.code() if not future.cancelled() else None
        with self._lock:
            self._in_flight -= 1
            if code is not None:  # a call the attacker itself cancelled at the phase's end got no answer
                self.outcome.record(code)

    def run(self, start_call: Callable[[], grpc.Future]) -> None:
        started, sent, skipped = time.monotonic(), 0, 0
        cpu_before = time.process_time()
        pending: list[grpc.Future] = []
        while not self.stop.is_set():
            due = int((time.monotonic() - started) * self.rate)
            while sent + skipped < due:
                with self._lock:
                    full = self._in_flight >= MAX_IN_FLIGHT
                    self._in_flight += 0 if full else 1
                if full:  # held to its limit: a call not started now is not made up later
                    skipped += 1
                    continue
                future = start_call()
                sent += 1
                future.add_done_callback(self._done)
                pending.append(future)
            if len(pending) > 4 * MAX_IN_FLIGHT:
                pending = [f for f in pending if not f.done()]
            self.stop.wait(max(0.0005, (sent + skipped + 1) / self.rate - (time.monotonic() - started)))
        for future in pending:
            future.cancel()
        self._note(time.monotonic() - started, sent, skipped, time.process_time() - cpu_before)

    def _note(self, elapsed: float, sent: int, skipped: int, cpu_s: float) -> None:
        """Calls/s answered and sent, and the attacker's process CPU (all its threads, gRPC's included)."""
        elapsed = max(elapsed, 1e-9)
        with self._lock:
            answered = self.outcome.calls
        self.outcome.note = (
            f"{answered / elapsed:.0f} calls/s answered ({sent / elapsed:.0f} sent"
            + (f", {skipped} not sent at the in-flight limit" if skipped else "")
            + f"); attacker {cpu_s / elapsed:.0%} of a core"
        )


class Cached:
    """A figure (a shard's version, the job's step) that a thread of its own refreshes every ``every_s`` until
    ``stop``: the flood that reads it never waits for the fetch (a blocking gRPC call) or pays for it."""

    def __init__(self, fetch: Callable[[], int], stop: threading.Event, every_s: float = 0.5) -> None:
        self._fetch, self._stop, self._every_s = fetch, stop, every_s
        self.value = fetch()
        threading.Thread(target=self._follow, name="cached-figure", daemon=True).start()

    def _follow(self) -> None:
        while not self._stop.wait(self._every_s):
            with contextlib.suppress(grpc.RpcError):  # busy or gone: the last figure stands
                self.value = self._fetch()

    def __call__(self) -> int:
        return self.value


@dataclass(frozen=True)
class Call:
    """One attacker call, for either client: its target (an index into the attack's addresses), method and requests."""

    target: int
    service: str
    method: str
    requests: tuple[Message, ...]
    metadata: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0

    def start(self, stubs: list[Any]) -> grpc.Future:
        """Through gRPC's own client."""
        method = pb.DESCRIPTOR.services_by_name[self.service].methods_by_name[self.method]
        request = iter(self.requests) if method.client_streaming else self.requests[0]
        multicallable = getattr(stubs[self.target], self.method)
        start = multicallable if method.server_streaming else multicallable.future  # a response stream is a future
        return start(request, metadata=self.metadata or None, timeout=self.timeout_s)

    @functools.cached_property
    def raw(self) -> RawCall:
        """As pre-encoded HTTP/2 (``bench/h2_flood.py``): serialized once however often it is sent."""
        path = f"/{pb.DESCRIPTOR.services_by_name[self.service].full_name}/{self.method}"
        deadline = (("grpc-timeout", f"{round(self.timeout_s * 1000)}m"),)  # as gRPC's client sends it
        return RawCall(path, tuple(r.SerializeToString() for r in self.requests), deadline + self.metadata)


def flood(
    addresses: list[str],
    stub_type: Callable[[grpc.Channel], Any],
    rate: float,
    stop: threading.Event,
    outcome: Outcome,
    client: str,
    make_calls: Callable[[list[Any], threading.Event], Callable[[], Call]],
) -> None:
    """Sends ``make_calls(stubs, stop)()`` at ``rate``: through gRPC's client, or (``client="raw"``) as pre-encoded
    HTTP/2 with one call in RAW_SAMPLE through gRPC's client beside it, for the status codes (raw answers are
    counted, not decoded)."""
    channels = [open_channel(a) for a in addresses]
    try:
        stubs = [stub_type(c) for c in channels]
        next_call = make_calls(stubs, stop)
        if client == "grpc":
            Paced(rate, stop, outcome).run(lambda: next_call().start(stubs))
            return
        sampled = Outcome(outcome.attack)
        sampler = threading.Thread(
            target=Paced(rate / RAW_SAMPLE, stop, sampled).run, args=(lambda: next_call().start(stubs),), daemon=True
        )
        cpu_before = time.process_time()
        raw = H2Flood(addresses, MAX_IN_FLIGHT)
        try:
            sampler.start()

            def raw_call() -> tuple[int, RawCall]:
                call = next_call()
                return call.target, call.raw

            stats = raw.run(rate * (1 - 1 / RAW_SAMPLE), stop, raw_call)
        finally:
            raw.close()
            sampler.join(60)
        cpu = time.process_time() - cpu_before
        elapsed = max(stats.elapsed_s, 1e-9)
        outcome.codes, outcome.calls = sampled.codes, sampled.calls + stats.answered
        outcome.note = (
            f"raw HTTP/2: {stats.answered / elapsed:.0f} calls/s answered ({stats.sent / elapsed:.0f} sent"
            + (f", {stats.skipped} not sent at the in-flight or flow-control limit" if stats.skipped else "")
            + (f", {stats.reset} reset by the server" if stats.reset else "")
            + (", connection closed" if stats.closed else "")
            + f"), codes from {sampled.calls} calls through gRPC's client beside it; attacker {cpu / elapsed:.0%} "
            f"of a core ({stats.cpu_s / elapsed:.0%} the raw flood)"
        )
    finally:
        for channel in channels:
            channel.close()


def forged_pushes(rate: float, client: str = "grpc") -> Attack:
    def attack(cluster: Cluster, stop: threading.Event, outcome: Outcome) -> None:
        """Pushes for worker 0 at each shard's current version: NaN without a credential, garbage with a made-up one.

        gRPC's blocking client spends a short-lived thread per client-streaming call feeding its requests (the
        note's attacker CPU counts it). Its asyncio client would be cheaper, but it reports about 1% of these calls
        as INTERNAL ("Internal error from Core") when the shard's early refusal races its write of the payload,
        which would hide what the shard answered."""
        payloads = [  # encoded once: the attacker's CPU goes into sending, as a real flood's would
            [tuple(pb.PushRequest(chunk=c) for c in encode_chunks(torch.full((n,), v))) for v in (float("nan"), 1e6)]
            for n in cluster.numel
        ]
        made_up = ((HEADER, "worker:0:0:" + "ab" * 32),)

        def make_calls(stubs: list[Any], stop: threading.Event) -> Callable[[], Call]:
            versions = [
                Cached(lambda s=stub: s.GetShardStatus(pb.ShardStatusRequest(), timeout=10).version, stop)
                for stub in stubs
            ]

            @functools.lru_cache(maxsize=64)
            def push(shard: int, forged: int, step: int) -> Call:
                header = pb.PushHeader(
                    shard_id=shard,
                    worker_id=0,
                    step=step,
                    device_count=1,
                    dtype=pb.FLOAT32,
                    numel=cluster.numel[shard],
                )
                requests = (pb.PushRequest(header=header), *payloads[shard][forged])
                return Call(shard, "ParameterServer", "Push", requests, made_up if forged else ())

            turn = itertools.count()

            def next_call() -> Call:
                i = next(turn)
                shard = i % len(stubs)
                return push(shard, i // len(stubs) % 2, versions[shard]())

            return next_call

        flood(cluster.ps, pb_grpc.ParameterServerStub, rate, stop, outcome, client, make_calls)

    return attack


def forged_reports(rate: float, client: str = "grpc") -> Attack:
    def attack(cluster: Cluster, stop: threading.Event, outcome: Outcome) -> None:
        """ReportStep (loss NaN, samples -2000) and RequestDataShard for worker 0, without its credential."""
        shard_request = Call(0, "Coordinator", "RequestDataShard", (pb.DataShardRequest(worker_id=0),))

        def make_calls(stubs: list[Any], stop: threading.Event) -> Callable[[], Call]:
            step = Cached(lambda: stubs[0].GetJobStatus(pb.JobStatusRequest(), timeout=10).step, stop)

            @functools.lru_cache(maxsize=64)
            def report(at: int) -> Call:
                message = pb.StepReport(worker_id=0, step=at, loss=float("nan"), samples=-2000, step_s=0.1)
                return Call(0, "Coordinator", "ReportStep", (message,))

            turn = itertools.count()
            return lambda: shard_request if next(turn) % 2 else report(step())

        flood([cluster.coordinator], pb_grpc.CoordinatorStub, rate, stop, outcome, client, make_calls)

    return attack


def pull_flood(rate: float, client: str = "grpc") -> Attack:
    def attack(cluster: Cluster, stop: threading.Event, outcome: Outcome) -> None:
        """Pulls for version 10^9 on shard 0; each would wait (up to its 30 s deadline) if admitted."""
        call = Call(0, "ParameterServer", "Pull", (pb.PullRequest(shard_id=0, min_version=10**9),), timeout_s=30.0)
        flood(cluster.ps[:1], pb_grpc.ParameterServerStub, rate, stop, outcome, client, lambda *_: lambda: call)

    return attack


def oversized_uploads(rate: float) -> Attack:
    def attack(cluster: Cluster, stop: threading.Event, outcome: Outcome) -> None:
        """UploadBuffers: 64 MiB under an unknown name, and a claimed shape of 2^40, alternately (gRPC's client
        only: the raw client does not wait for flow control, and at 10/s what costs is the bytes, not the calls)."""
        before = cluster.coordinator_rss_mib()
        with open_channel(cluster.coordinator) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            big = list(encode_chunks(torch.zeros(16 * 1024 * 1024), 4 * 1024 * 1024, name="no_such_buffer"))
            claim = pb.TensorChunk(name="0.weight", dtype=pb.FLOAT32, shape=[2**40], offset=0, data=b"\0" * 4096)
            turn = itertools.count()

            def start() -> grpc.Future:
                return stub.UploadBuffers.future(iter(big if next(turn) % 2 else [claim]), timeout=30)

            Paced(rate, stop, outcome).run(start)
        outcome.note += f"; coordinator RSS {before:.0f} -> {cluster.coordinator_rss_mib():.0f} MiB"

    return attack


def status_load(rate: float, client: str = "grpc") -> Attack:
    def attack(cluster: Cluster, stop: threading.Event, outcome: Outcome) -> None:
        """GetJobStatus, a legitimate read, paced at ``rate``."""
        call = Call(0, "Coordinator", "GetJobStatus", (pb.JobStatusRequest(),))
        flood([cluster.coordinator], pb_grpc.CoordinatorStub, rate, stop, outcome, client, lambda *_: lambda: call)

    return attack


def steps_per_s(cluster: Cluster, seconds: float) -> float:
    first, started = cluster.steps(), time.monotonic()
    time.sleep(seconds)  # a measuring window, not a wait for a peer
    return (cluster.steps() - first) / (time.monotonic() - started)


def run_attack(cluster: Cluster, name: str, attack: Attack, phase_s: float) -> tuple[Outcome, float, float]:
    """Steps/s in a quiet phase, then during the attack (the attack's first second is not measured)."""
    before = steps_per_s(cluster, phase_s)
    stop = threading.Event()
    outcome = Outcome(name)
    errors: list[BaseException] = []

    def body() -> None:
        try:
            attack(cluster, stop, outcome)
        except BaseException as exc:  # noqa: BLE001 - reported in the table
            errors.append(exc)

    thread = threading.Thread(target=body, name=f"attack-{name}", daemon=True)
    thread.start()
    time.sleep(1.0)  # let the attack ramp up before measuring
    during = steps_per_s(cluster, phase_s)
    stop.set()
    thread.join(60)
    if errors:
        outcome.note = f"attack raised {errors[0]!r}"
    return outcome, before, during


def attacks(rates: list[float], clients: list[str]) -> list[tuple[str, Attack]]:
    chosen: list[tuple[str, Attack]] = []
    for client in clients:
        via = "raw HTTP/2" if client == "raw" else "gRPC client"
        for rate in rates:
            chosen += [
                (f"forged pushes (NaN / garbage for worker 0) at {rate:.0f}/s, {via}", forged_pushes(rate, client)),
                (f"forged ReportStep + RequestDataShard at {rate:.0f}/s, {via}", forged_reports(rate, client)),
                (f"pull flood (version 10^9) at {rate:.0f}/s, {via}", pull_flood(rate, client)),
                (f"GetJobStatus at {rate:.0f}/s, {via}", status_load(rate, client)),
            ]
    # 64 MiB each: the loopback carries about ten a second.
    return [*chosen, ("oversized UploadBuffers (64 MiB, 2^40) at 10/s, gRPC client", oversized_uploads(10.0))]


@dataclass
class Row:
    """One attack's figures: steps/s in the quiet phases around it and during it (quiet ``after`` is the next
    attack's ``before``; the last gets a quiet phase of its own)."""

    outcome: Outcome
    before: float
    during: float
    after: float = float("nan")
    load: float = float("nan")  # the 1-minute load average at the end of the attack

    @property
    def ratio(self) -> float:
        """During vs the mean of the quiet phases before and after: the baseline drifts with the machine's load."""
        quiet = [q for q in (self.before, self.after) if q == q]
        return self.during / (sum(quiet) / len(quiet)) if quiet and sum(quiet) > 0 else float("nan")


def iter_results(
    cluster: Cluster, rates: list[float], clients: list[str], phase_s: float, only: str = ""
) -> Iterator[Row]:
    previous: Row | None = None
    for name, attack in attacks(rates, clients):
        if only and only not in name:
            continue
        outcome, before, during = run_attack(cluster, name, attack, phase_s)
        row = Row(outcome, before, during, load=os.getloadavg()[0])
        if previous is not None:
            previous.after = before
            yield previous
        codes = ", ".join(f"{k} x{v}" for k, v in outcome.codes.most_common())
        print(f"{name}: {codes}; steps/s {before:.1f} -> {during:.1f} {outcome.note}", flush=True)
        previous = row
    if previous is not None:
        previous.after = steps_per_s(cluster, phase_s)
        yield previous


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=10.0, help="seconds of each quiet and each attack phase")
    p.add_argument("--rates", default="1000,100", help="calls per second each attacker is held to, comma-separated")
    p.add_argument(
        "--clients",
        default="raw,grpc",
        help="the attacker's clients, comma-separated: raw (pre-encoded HTTP/2, bench/h2_flood.py: almost no "
        "attacker CPU, as from another host) and grpc (gRPC's Python client)",
    )
    p.add_argument("--only", default="", help="run only the attacks whose name contains this")
    p.add_argument("--job-cpus", default="", help="CPUs the job's processes are pinned to (taskset's list: 0-11)")
    p.add_argument("--attacker-cpus", default="", help="CPUs the attacker is pinned to, disjoint from --job-cpus")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "abuse.md"))
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    clients = args.clients.split(",")
    if not set(clients) <= {"raw", "grpc"}:
        p.error(f"--clients: {args.clients!r}: each must be raw or grpc")
    if bool(args.job_cpus) != bool(args.attacker_cpus):
        p.error("--job-cpus and --attacker-cpus go together")
    job_cpus = attacker_cpus = None
    if args.job_cpus:
        try:
            job_cpus, attacker_cpus = parse_cpus(args.job_cpus), parse_cpus(args.attacker_cpus)
        except ValueError as exc:
            p.error(str(exc))
        if job_cpus & attacker_cpus:
            p.error(f"--job-cpus and --attacker-cpus share CPUs {sorted(job_cpus & attacker_cpus)}")
    if attacker_cpus is not None:  # every thread there is (torch starts one at import); later ones inherit it
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), attacker_cpus)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
        cluster = start_cluster(Path(tmp), job_cpus)
        try:
            job_sets = process_cpus(pids_with_marker(cluster.marker))
            results = list(iter_results(cluster, rates, clients, args.phase_s, args.only))
            alive = cluster.proc.poll() is None
            final_steps = cluster.steps()
            attacker_sets = process_cpus([int(t) for t in os.listdir("/proc/self/task")])
        finally:
            stop_local(cluster.proc, cluster.marker)
    load_after = os.getloadavg()
    threads = "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ)
    pinning = f" --job-cpus {args.job_cpus} --attacker-cpus {args.attacker_cpus}" if job_cpus else ""
    seen = (
        f"CPUs of the job's processes: {', '.join(sorted(format_cpus(set(c)) for c in job_sets))}; of the attacker's "
        f"threads at the end: {', '.join(sorted(format_cpus(set(c)) for c in attacker_sets))}."
    )
    where = (
        f"The job runs on CPUs {args.job_cpus} and the attacker on CPUs {args.attacker_cpus} (pinned, as from another "
        f"host: the attacker's own CPU is not the job's; {seen}) Its CPU is in"
        if job_cpus
        else f"The attacker runs on the same cores ({seen}) Its CPU is in"
    )
    lines = [
        "# Abuse benchmark (issue 8)",
        "",
        f"`{threads}python bench/abuse.py --phase-s {args.phase_s:g} --rates {args.rates} --clients {args.clients}"
        f"{pinning}` on {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
        f"Load average before {load_before[0]:.1f}, after {load_after[0]:.1f}.",
        "",
        "A `pstrain local` job (2 PS shards, 2 workers x 1 CPU device) trains while each attack runs from",
        f"127.0.0.1 for {args.phase_s:g} s; steps/s are measured in quiet phases just before and after it and during",
        f"it; the ratio is during / the mean of before and after. {where}",
        "the note, with the load average at the end of the attack. With the raw HTTP/2 client",
        "(`bench/h2_flood.py`) the attacker spends a few per cent of a core, about what an attacker on another host",
        "costs this one; its answers are counted, and their codes come from one call in",
        f"{RAW_SAMPLE} sent through gRPC's client beside it.",
        "",
        "| attack | codes returned | calls | steps/s before | during | after | ratio | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in results:
        codes = ", ".join(f"{k} x{v}" for k, v in row.outcome.codes.most_common())
        lines.append(
            f"| {row.outcome.attack} | {codes} | {row.outcome.calls} | {row.before:.1f} | {row.during:.1f} | "
            f"{row.after:.1f} | {row.ratio:.0%} | {row.outcome.note}; load {row.load:.1f} |"
        )
    lines += ["", f"The job was {'still training' if alive else 'NOT running'} at the end ({final_steps} steps)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
