"""``pstrain local``: a whole cluster as separate OS processes on 127.0.0.1.

The launcher starts the coordinator, waits for its port file, starts the PS shards and the
workers (each binds a free port and registers itself), follows progress over the
coordinator's WatchProgress stream, and tears everything down when the job ends, when any
process but a worker dies, or on Ctrl-C, SIGTERM or SIGHUP (exit 128 + the signal). A process
that exits before the job finished is dead whatever its exit code, 0 included. A dead worker is
restarted alone (S2.5, with ``fault.replace_timeout_s`` > 0): it replaces itself in its slot while
the step waits for it.
A coordinator killed by a signal is restarted alone on its address (``--recover auto``): it takes
the job back from its journal while the PS shards and workers ride out the outage, and the
progress stream reconnects from the next step. A whole-cluster (re)start passes ``--recover
never``: its members are new processes, so the job resumes from the last committed checkpoint.
With ``cluster.min_workers`` below ``cluster.workers``, a worker that used up ``fault.max_restarts``
(or any, with 0) is left dead instead, as long as that many workers remain: the coordinator goes on
without it after ``fault.replace_timeout_s`` (issue 11). A whole-cluster restart starts it again.
Children live in their own session (the terminal's Ctrl-C
reaches only the launcher, which drains them in order) and get SIGKILL if the launcher
itself is killed (PR_SET_PDEATHSIG), so no process outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from tqdm import tqdm

from pstrain.coordinator.config import JobConfig
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.ports import free_port
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.transport import open_channel

log = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1
ERROR_LINE = re.compile(r"^\S+ \S+ (?:ERROR|CRITICAL) \S+ \S+: (.*)$")
"""A child's ERROR line (``runtime.logs``: date, time, level, service[pid], logger): the message."""


def user_code_paths() -> list[str]:
    """Where job files' factories import from in every process ``pstrain local`` runs, the launcher included
    (ahead of ``PYTHONPATH``): the current directory, then pstrain's source root when pstrain runs from a
    checkout (its ``examples`` and ``tests`` factories).

    The current directory comes first so that the user's own module wins over a pstrain folder of the same
    name (``nn``, ``runtime``, ``worker``). An installed pstrain's folder (``site-packages/pstrain``) is left
    out: it holds only pstrain's own subpackages, which would shadow the user's modules and which nobody
    imports by those bare names."""
    paths = [os.getcwd()]
    if (SOURCE_ROOT / "pyproject.toml").is_file() and str(SOURCE_ROOT) not in paths:
        paths.append(str(SOURCE_ROOT))
    return paths


class ClusterFailure(RuntimeError):
    """A process of the local cluster died or the job failed."""


class ProcessDied(ClusterFailure):
    """A child exited unexpectedly: the cluster is restarted from the last committed checkpoint.

    ``last_error``: the child's last ERROR line, what ``pstrain local`` shows when the exit code says a
    restart cannot help (a bad setting only the child could check): one line, not a traceback."""

    def __init__(self, name: str, exit_code: int, tail: str, last_error: str = "") -> None:
        when = " before the job finished" if exit_code == 0 else ""
        super().__init__(f"{name} exited with code {exit_code}{when}; last log lines:\n{tail}")
        self.name = name
        self.exit_code = exit_code
        self.last_error = last_error


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP to ``pstrain local``: the cluster is drained as on Ctrl-C; exit 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


class SignalGate:
    """Turns SIGTERM and SIGHUP into ``Interrupted`` while the cluster runs, and ignores them while it drains.

    ``systemctl stop`` or a closed terminal then drain the cluster like Ctrl-C instead of killing the launcher
    (and, by PR_SET_PDEATHSIG, every child) at once. One is enough: a signal that arrives while the cluster is
    draining (after Ctrl-C, after an earlier signal, or after the job finished) is ignored, so the drain ends."""

    def __init__(self) -> None:
        self.draining = False

    def handler(self, signum: int, frame: object) -> None:
        if not self.draining:
            self.draining = True
            raise Interrupted(signum)


@contextlib.contextmanager
def interrupt_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[SignalGate]:
    """A ``SignalGate`` for ``signals``, installed in the main thread for the ``with`` block (elsewhere, signals
    cannot be handled: the gate is inert)."""
    gate = SignalGate()
    if threading.current_thread() is not threading.main_thread():
        yield gate
        return
    previous = {signum: signal.signal(signum, gate.handler) for signum in signals}
    try:
        yield gate
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@dataclass(frozen=True)
class RestartPolicy:
    """How ``pstrain local`` supervises its children, like systemd's ``Restart=on-failure``.

    A child that dies (killed, crashed, exit 1) takes the cluster down; it is started again
    after ``backoff_s`` (doubling each time, up to ``max_backoff_s``) and resumes from the
    newest committed checkpoint, at most ``max_restarts`` times. Exit codes 2 (a bad job file
    or flag) and 3 (the job failed for a reason a restart would repeat, e.g. a NaN with
    ``fault.on_nonfinite: stop``) are never retried.
    """

    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    NOT_RETRIED = (2, 3)

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)


@dataclass(frozen=True)
class Supervision:
    """What to do about the children that died at one look: restart the cluster (``cluster``: the
    death that explains it, name and exit code), or restart each of ``alone`` by itself."""

    cluster: tuple[str, int] | None
    alone: tuple[tuple[str, int], ...] = ()
    left: tuple[tuple[str, int], ...] = ()  # workers left dead: the coordinator drops their slots (min_workers)


def supervise(
    dead: list[tuple[str, int]],
    replaces_workers: bool,
    max_restarts: int,
    worker_restarts: dict[str, int],
    coordinator_restarts: int,
    spare_workers: int = 0,
) -> Supervision:
    """The restart decision for the children seen dead together (name, exit code), without side effects.

    A worker is restarted alone (S2.5) unless it exited 2 or 3 or used up ``max_restarts``; the
    coordinator alone when a signal killed it (it takes the job back from its journal). Any other
    death restarts the whole cluster, and then nobody is restarted alone: the whole-cluster restart
    starts everyone anew. Deaths seen together are often one fault and its echoes (a PS shard killed,
    and a member that lost it and exited); the restart is decided by a death a restart can mend,
    so an echo that exited 2 or 3 does not end a job a cluster restart would save.

    A worker that may not be restarted alone any more (``max_restarts`` used up, or 0) is ``left`` dead
    while ``spare_workers`` (``cluster.workers`` - ``cluster.min_workers`` - those left dead already) allows:
    the coordinator drops its slot after ``fault.replace_timeout_s`` and the job goes on with fewer workers.
    """
    alone: list[tuple[str, int]] = []
    left: list[tuple[str, int]] = []
    others: list[tuple[str, int]] = []
    for name, code in dead:
        coordinator_alone = name == "coordinator" and code < 0 and coordinator_restarts < max_restarts
        mendable_worker = name.startswith("worker") and replaces_workers and code not in RestartPolicy.NOT_RETRIED
        worker_alone = mendable_worker and worker_restarts.get(name, 0) < max_restarts
        if mendable_worker and not worker_alone and len(left) < spare_workers:
            left.append((name, code))
            continue
        (alone if coordinator_alone or worker_alone else others).append((name, code))
    if not others:
        return Supervision(None, tuple(alone), tuple(left))
    mendable = [death for death in others if death[1] not in RestartPolicy.NOT_RETRIED]
    return Supervision((mendable or others)[0])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    exited_at: float | None = None  # when an exit 0 was first seen while the job was not known to be over

    def tail(self, lines: int = 15) -> str:
        self.log_file.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"    {line}" for line in text[-lines:])

    def last_error(self) -> str:
        """The message of the last ERROR (or CRITICAL) line of the log, without the traceback after it."""
        self.log_file.flush()
        for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
            if found := ERROR_LINE.match(line):
                return found.group(1)
        return ""


@dataclass
class LocalCluster:
    config_path: Path
    cfg: JobConfig
    out_dir: Path
    steps: int | None = None
    log_level: str = "INFO"
    fresh: bool = False  # the first start discards committed checkpoints; restarts always resume
    start_timeout_s: float = 120.0
    grace_s: float = 10.0
    processes: list[ManagedProcess] = field(default_factory=list)
    coordinator_address: str = ""
    worker_restarts: dict[str, int] = field(default_factory=dict)  # per worker process, over the whole run
    coordinator_restarts: int = 0  # the coordinator restarted alone (taking the job back from its journal)
    left_dead: list[str] = field(default_factory=list)  # workers left dead since the last (re)start (min_workers)
    clean_exit_grace_s: float = 10.0
    """How long an exit 0 may wait for the progress stream to show the job's last step before it counts as a
    death: a worker exits 0 once it pushed the last step, maybe before the others' reports complete it."""
    _last_step_seen: bool = False  # the progress stream showed the job's last step: exits 0 are the job's end
    _member_args: list[str] = field(default_factory=list)
    _coordinator_args: list[str] = field(default_factory=list)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [*user_code_paths(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, module: str, args: list[str]) -> ManagedProcess:
        log_path = self.out_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in shutdown(); appends across restarts
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--log-level", self.log_level, *self.cfg.security.flags()],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        proc = ManagedProcess(name, popen, log_path, log_file)
        self.processes.append(proc)
        return proc

    def start(self) -> None:
        """Spawn every process at once. No gRPC runs in this process before the last fork.

        The coordinator gets a free port picked here, so the PS shards and workers start beside
        it instead of after it (they wait until it is reachable): on 2 cores this halves the
        time to the first step, and the time a restart after a crash takes.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.left_dead = []  # every worker is started again
        self._last_step_seen = False
        port_file = self.out_dir / "coordinator.port"
        port_file.unlink(missing_ok=True)
        self.coordinator_address = f"127.0.0.1:{free_port()}"
        args = ["--config", str(self.config_path), "--bind", self.coordinator_address, "--out", str(self.out_dir)]
        args += ["--port-file", str(port_file), "--grace-s", str(self.grace_s), "--colocated"]  # all on this host
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        self._coordinator_args = [*args, "--recover", "auto"]  # a restart of the coordinator alone
        if self.fresh:
            args.append("--fresh")
            self.fresh = False
        coordinator = self._spawn("coordinator", "pstrain.coordinator", [*args, "--recover", "never"])
        common = ["--coordinator", self.coordinator_address, "--bind", "127.0.0.1:0", "--grace-s", str(self.grace_s)]
        self._member_args = common
        for shard_id in range(self.cfg.cluster.ps_shards):
            self._spawn(f"ps-{shard_id}", "pstrain.ps_server", [*common, "--shard-id", str(shard_id)])
        for index in range(self.cfg.cluster.workers):
            self._spawn(f"worker-{index}", "pstrain.worker", common)
        deadline = time.monotonic() + self.start_timeout_s
        while not port_file.exists():
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise ClusterFailure(
                    f"coordinator did not start within {self.start_timeout_s:.0f}s\n{coordinator.tail()}"
                )
            # Waits on the coordinator process itself, so its death is seen at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                coordinator.popen.wait(timeout=0.05)

    def _raise_if_dead(self) -> None:
        """While the cluster starts, any exit is a death, exit 0 included: nobody may be done yet."""
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise ProcessDied(proc.name, code, proc.tail(), proc.last_error())

    def _replaces_workers(self) -> bool:
        return self.cfg.fault.replace_timeout_s > 0

    def _supervise(self, job_over: bool = False) -> None:
        """Act on the children that died since the last look (``supervise``): restart a worker or the
        coordinator alone, or raise ``ProcessDied`` for the cluster restart (or the end).

        ``job_over`` (the coordinator announced that the job finished): a restart could only rejoin a
        job that is gone (a worker killed while it exited would wait for a coordinator that never comes
        back), so the dead are let go.

        An exit 0 before the job is over is a death too (a member stopped by someone else, user code that
        called ``sys.exit(0)``): nothing would replace it and the job would wait for it. Only it waits
        ``clean_exit_grace_s`` for the progress stream to show the last step, the end a worker exits 0 at."""
        dead = [(proc.name, code) for proc in self.processes if (code := self._exit_code(proc, job_over)) is not None]
        if not dead:
            return
        by_name = {proc.name: proc for proc in self.processes}
        if job_over:
            for name, code in dead:
                self._drop(by_name[name], f"{name} exited with code {code} after the job ended; not restarted")
            return
        decision = supervise(
            dead,
            self._replaces_workers(),
            self.cfg.fault.max_restarts,
            self.worker_restarts,
            self.coordinator_restarts,
            self.cfg.cluster.workers - self.cfg.cluster.least_workers - len(self.left_dead),
        )
        if decision.cluster is not None:
            name, code = decision.cluster
            raise ProcessDied(name, code, by_name[name].tail(), by_name[name].last_error())
        for name, code in decision.left:
            self.left_dead.append(name)
            self._drop(
                by_name[name],
                f"{name} exited with code {code} and is not restarted (restarts used: "
                f"{self.worker_restarts.get(name, 0)} of {self.cfg.fault.max_restarts}); the job goes on with "
                f"{self.cfg.cluster.workers - len(self.left_dead)} workers once the coordinator drops its slot "
                f"(after fault.replace_timeout_s {self.cfg.fault.replace_timeout_s:g}s; cluster.min_workers "
                f"{self.cfg.cluster.least_workers})",
            )
        for name, code in decision.alone:
            proc = by_name[name]
            if name == "coordinator":
                self._restart_coordinator(proc, code)
                continue
            restarts = self.worker_restarts.get(name, 0)
            self.worker_restarts[name] = restarts + 1
            self._drop(
                proc,
                f"{name} exited with code {code}; restarting it alone to take its slot back "
                f"(restart {restarts + 1} of {self.cfg.fault.max_restarts})",
            )
            self._spawn(name, "pstrain.worker", self._member_args)

    def _exit_code(self, proc: ManagedProcess, job_over: bool) -> int | None:
        """``proc``'s exit code if it counts as dead now (see ``_supervise``), else None."""
        code = proc.popen.poll()
        if code != 0:
            return code
        if job_over or self._last_step_seen:
            return None  # the job's end
        now = time.monotonic()
        if proc.exited_at is None:
            proc.exited_at = now
        return 0 if now - proc.exited_at >= self.clean_exit_grace_s else None

    def _drop(self, proc: ManagedProcess, why: str) -> None:
        """Forget a dead child (saying why on stderr): it is let go, or started anew under the same name."""
        print(f"pstrain local: {why}", file=sys.stderr, flush=True)
        self.processes.remove(proc)
        proc.log_file.close()

    def _restart_coordinator(self, proc: ManagedProcess, code: int) -> None:
        """The coordinator was killed: start it again alone, on its address; it takes the job back."""
        self.coordinator_restarts += 1
        self._drop(
            proc,
            f"the coordinator was killed (signal {-code}); restarting it alone to take the job back "
            f"from its journal (restart {self.coordinator_restarts} of {self.cfg.fault.max_restarts})",
        )
        self._spawn("coordinator", "pstrain.coordinator", self._coordinator_args)

    def run(self) -> int:
        """Follow the job to its end; returns the number of steps recorded."""
        steps = self.steps or self.cfg.job.steps
        sec = self.cfg.security
        channel = open_channel(
            self.coordinator_address, TransportSecurity.load(sec.tls_ca, sec.tls_cert, sec.tls_key, sec.token_file)
        )
        stub = pb_grpc.CoordinatorStub(channel)
        final: list[pb.ProgressEvent] = []
        watcher_error: list[BaseException] = []
        bar = tqdm(total=steps, unit="step", dynamic_ncols=True, disable=None)

        def follow() -> None:
            next_step = 0
            try:
                while True:
                    try:
                        for event in stub.WatchProgress(
                            pb.WatchProgressRequest(from_step=next_step), timeout=7 * 24 * 3600, wait_for_ready=True
                        ):
                            if event.state in (pb.FINISHED, pb.FAILED) and event.global_batch == 0:
                                final.append(event)
                                return
                            next_step = event.step + 1
                            self._last_step_seen = self._last_step_seen or next_step >= steps
                            bar.update(1)
                            bar.set_postfix(
                                loss=f"{event.loss:.4f}", lr=f"{event.lr:.3g}", samples_s=f"{event.samples_per_s:.0f}"
                            )
                            if bar.disable and (event.step + 1) % max(1, steps // 10) == 0:
                                print(
                                    f"step {event.step + 1}/{steps} loss {event.loss:.4f} lr {event.lr:.3g} "
                                    f"{event.samples_per_s:.0f} samples/s",
                                    flush=True,
                                )
                        return
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        time.sleep(0.2)  # the coordinator is restarting: follow it again from the next step
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                watcher_error.append(exc)

        watcher = threading.Thread(target=follow, name="progress", daemon=True)
        watcher.start()
        over_since = 0.0  # when the job was seen finished and the coordinator gone
        try:
            while True:
                finished = bool(final) and final[0].state == pb.FINISHED  # a failed job may still be restarted
                self._supervise(job_over=finished)
                if all(p.popen.poll() is not None for p in self.processes):
                    watcher.join(timeout=5.0)  # the last events, if the stream still brings them
                    break
                if finished and any(p.name == "coordinator" and p.popen.poll() == 0 for p in self.processes):
                    over_since = over_since or time.monotonic()
                    if time.monotonic() - over_since > self.grace_s:
                        break  # a member left waiting for the coordinator that is gone: shutdown() stops it
                watcher.join(timeout=0.2)
        finally:
            bar.close()
            channel.close()
        if not final:
            detail = f": {watcher_error[0]}" if watcher_error else ""
            raise ClusterFailure(f"lost the coordinator's progress stream{detail}")
        if final[0].state != pb.FINISHED:
            raise ClusterFailure(f"job failed: {final[0].message}")
        return final[0].step

    def shutdown(self, kill: bool = False) -> None:
        """SIGTERM everyone (workers first), wait the grace period, SIGKILL whoever is left.

        With ``kill`` (a restart after a crash) everyone gets SIGKILL at once: the state that
        matters is in the committed checkpoint, and survivors blocked on the dead peer would
        only use up their grace period.
        """
        order = sorted(self.processes, key=lambda p: (not p.name.startswith("worker"), p.name == "coordinator"))
        self.processes = []
        for proc in order:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + 5
        for proc in order:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", proc.name)
                proc.popen.kill()
                proc.popen.wait()
            proc.log_file.close()


def run_local(cluster: LocalCluster, policy: RestartPolicy | None = None) -> int:
    """Run the cluster to the job's end, restarting it after a child dies (see ``RestartPolicy``).

    The exit code: 0 when the job finished; 2 or 3 when a child exited so (a bad setting only it could
    check, a job that would fail again), with its last ERROR line; 1 after the last restart; 128 + the
    signal after Ctrl-C, SIGTERM or SIGHUP, once the cluster is drained."""
    policy = policy or RestartPolicy()
    attempt = 0
    with interrupt_on_signals() as gate:
        while True:
            try:
                cluster.start()
                steps = cluster.run()
                print(f"trained {steps} steps; model written to {cluster.out_dir / 'model.pt'}")
                return 0
            except ProcessDied as exc:
                cluster.shutdown(kill=True)
                if exc.exit_code in policy.NOT_RETRIED:
                    why = exc.last_error or "no ERROR line in its log"
                    print(f"pstrain local: {exc.name} exited with code {exc.exit_code}: {why}", file=sys.stderr)
                    return exc.exit_code
                if attempt >= policy.max_restarts:
                    print(f"pstrain local: {exc}", file=sys.stderr)
                    print(f"pstrain local: gave up after {attempt} restart(s)", file=sys.stderr)
                    return 1
                delay = policy.delay(attempt)
                attempt += 1
                print(
                    f"pstrain local: {exc.name} exited with code {exc.exit_code}; restarting the cluster from the "
                    f"last committed checkpoint in {delay:.1f}s (restart {attempt} of {policy.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
            except ClusterFailure as exc:
                print(f"pstrain local: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt as exc:
                print(f"pstrain local: interrupted ({_signal_name(exc)}); stopping the cluster", file=sys.stderr)
                return interrupted_exit_code(exc)
            finally:
                gate.draining = True  # the drain runs to its end, whatever signal comes now
                cluster.shutdown()
            gate.draining = False
            try:
                time.sleep(delay)  # restart backoff, not a wait for a peer
            except KeyboardInterrupt as exc:
                return interrupted_exit_code(exc)


def _signal_name(exc: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


def last_metrics(out_dir: Path) -> dict[str, float] | None:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else None
