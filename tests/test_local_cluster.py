"""``pstrain local`` as a user runs it: success, failures and Ctrl-C, never an orphan process."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from pstrain.coordinator.config import parse_config
from pstrain.launcher.local_cluster import (
    LocalCluster,
    ManagedProcess,
    ProcessDied,
    RestartPolicy,
    Supervision,
    supervise,
)
from pstrain.launcher.local_cluster import run_local as run_local_in_process
from tests.helpers import (
    communicate_or_dump,
    metrics_lines,
    pids_with_marker,
    run_local,
    start_local,
    wait_for,
    write_job,
)


def test_outputs_and_buffers(tmp_path):
    job = write_job(
        tmp_path / "job.yaml",
        model={"factory": "tests.helpers:bn_mlp"},
        data={"factory": "tests.helpers:classification_set", "kwargs": {"n": 32}, "shard_size": 8},
        job={"steps": 5, "seed": 0},
        cluster={"ps_shards": 2, "workers": 2, "devices_per_worker": 1},
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker, extra=["--steps", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 4 steps" in result.stdout
    # Off a terminal, the progress lines say what the README promises: step, loss, LR, samples/s.
    assert re.search(r"^step 4/4 loss \d+\.\d{4} lr [0-9.e-]+ \d+ samples/s$", result.stdout, re.M), result.stdout
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert {"step", "loss", "lr", "global_batch", "samples_per_s", "step_s"} <= set(lines[0])
    assert all(m["global_batch"] == 8 and m["samples_per_s"] > 0 for m in lines)
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert int(state["1.num_batches_tracked"]) == 4, "BatchNorm buffers come from worker 0's first replica"
    assert not torch.equal(state["1.running_mean"], torch.zeros(6))
    for name in ("coordinator", "ps-0", "ps-1", "worker-0", "worker-1"):
        assert (tmp_path / "out" / "logs" / f"{name}.log").exists()
    assert not pids_with_marker(marker)


def test_a_crashing_worker_stops_the_cluster(tmp_path):
    job = write_job(
        tmp_path / "job.yaml",
        data={"factory": "tests.helpers:failing_set", "kwargs": {"n": 64, "fail_at": 10}, "shard_size": 8},
        job={"steps": 50, "seed": 0},
        fault={"max_restarts": 1, "restart_backoff_s": 0.1},
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker)
    assert result.returncode == 1
    assert "exited with code 1" in result.stderr and "injected failure reading sample 10" in result.stderr
    assert "restart 1 of 1" in result.stderr and "gave up after 1 restart(s)" in result.stderr
    assert not pids_with_marker(marker)


def test_a_killed_parameter_server_stops_the_cluster_when_restarts_are_off(tmp_path):
    job = write_job(tmp_path / "job.yaml", job={"steps": 100000, "seed": 0}, fault={"max_restarts": 0})
    marker = uuid.uuid4().hex
    proc = start_local(job, tmp_path / "out", marker)
    try:
        wait_for(lambda: metrics_lines(tmp_path / "out") >= 2, 120, "training to start")
        ps = [p for p in pids_with_marker(marker) if b"ps_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ps) == 3
        os.kill(ps[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "exited with code -9" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not pids_with_marker(marker), 10, "every child to be gone")


def test_ctrl_c_drains_and_exits_130(tmp_path):
    job = write_job(tmp_path / "job.yaml", job={"steps": 100000, "seed": 0})
    marker = uuid.uuid4().hex
    proc = start_local(job, tmp_path / "out", marker)
    try:
        wait_for(lambda: metrics_lines(tmp_path / "out") >= 2, 120, "training to start")
        proc.send_signal(signal.SIGINT)
        _, stderr = communicate_or_dump(proc, 120)
        assert proc.returncode == 130 and "interrupted" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not pids_with_marker(marker)


def test_killing_the_launcher_takes_its_children_along(tmp_path):
    job = write_job(tmp_path / "job.yaml", job={"steps": 100000, "seed": 0})
    marker = uuid.uuid4().hex
    proc = start_local(job, tmp_path / "out", marker)
    try:
        wait_for(lambda: metrics_lines(tmp_path / "out") >= 1, 120, "training to start")
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not pids_with_marker(marker), 30, "orphans to die with the launcher (PDEATHSIG)")


def test_bad_config_exits_2_naming_the_key(tmp_path):
    job = write_job(tmp_path / "job.yaml", optimizer={"name": "sgd", "lr": -0.1})
    result = run_local(job, tmp_path / "out", uuid.uuid4().hex)
    assert result.returncode == 2 and "optimizer.lr: must be positive" in result.stderr
    job = write_job(tmp_path / "job.yaml", model={"factory": "tests.helpers:no_such_model"})
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker)
    assert result.returncode == 2 and "no attribute 'no_such_model'" in result.stderr
    assert "model.factory: module 'tests.helpers' has no attribute 'no_such_model'" in result.stderr
    assert not (tmp_path / "out" / "logs" / "coordinator.log").exists(), "refused before starting anything"
    assert not pids_with_marker(marker)


def test_children_that_die_after_the_job_finished_are_let_go_not_restarted(tmp_path, capsys):
    """A worker killed while it exits after the last step must not come back: it would wait for a coordinator
    that is gone, and ``pstrain local`` would never end."""
    cfg = parse_config(yaml.safe_load(write_job(tmp_path / "job.yaml").read_text()))
    cluster = LocalCluster(tmp_path / "job.yaml", cfg, tmp_path / "out")
    done = cluster._spawn("coordinator", "tests.helpers", [])  # exits 0 at once: no __main__ runs anything
    log_path = tmp_path / "worker-1.log"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    killed = ManagedProcess("worker-1", sleeper, log_path, open(log_path, "ab"))  # noqa: SIM115 - closed by it
    cluster.processes.append(killed)
    killed.popen.kill()
    for proc in (done, killed):
        proc.popen.wait(30)
    cluster._supervise(job_over=True)
    assert cluster.processes == [done] and cluster.worker_restarts == {}
    assert "worker-1 exited with code -9 after the job ended; not restarted" in capsys.readouterr().err
    done.log_file.close()


# ------------------------------------------------------------------ the restart decision, without processes


def test_supervise_restarts_a_worker_or_a_killed_coordinator_alone():
    decision = supervise([("worker-1", -9)], True, 3, {}, 0)
    assert decision == Supervision(None, (("worker-1", -9),))
    assert supervise([("coordinator", -9)], True, 3, {}, 0) == Supervision(None, (("coordinator", -9),))
    assert supervise([("coordinator", -9), ("worker-0", 1)], True, 3, {}, 0).alone == (
        ("coordinator", -9),
        ("worker-0", 1),
    )


def test_supervise_restarts_the_cluster_past_the_limits_or_without_replacement():
    assert supervise([("worker-1", -9)], True, 3, {"worker-1": 3}, 0).cluster == ("worker-1", -9)
    assert supervise([("worker-1", -9)], False, 3, {}, 0).cluster == ("worker-1", -9)
    assert supervise([("coordinator", -9)], True, 3, {}, 3).cluster == ("coordinator", -9)
    assert supervise([("coordinator", 1)], True, 3, {}, 0).cluster == ("coordinator", 1)  # it failed the job


def test_supervise_a_ps_kill_seen_with_its_echoes_restarts_the_cluster_and_nobody_alone():
    """A PS shard killed while a worker is replaced or the coordinator restarts alone: the members that
    lost it exit too, some with 2 or 3; the killed shard decides, so the job is not given up."""
    for echoes in ([("worker-0", 3)], [("coordinator", 3)], [("coordinator", -9), ("worker-1", 2)]):
        dead = [*echoes, ("ps-1", -9)]  # in the launcher's process order, the PS shard last
        assert supervise(dead, True, 3, {}, 0) == Supervision(("ps-1", -9))


def test_supervise_gives_up_only_when_every_death_is_final():
    assert supervise([("worker-0", 3), ("worker-1", 3)], True, 3, {}, 0).cluster == ("worker-0", 3)
    assert supervise([("ps-0", 3)], True, 3, {}, 0).cluster == ("ps-0", 3)  # its checkpoint cannot be loaded
    assert supervise([("coordinator", -9), ("worker-1", 3)], True, 3, {}, 0).cluster == ("worker-1", 3)


def test_supervise_leaves_a_worker_dead_when_min_workers_allows_it():
    """cluster.min_workers below cluster.workers: a worker past its restarts (or any, with max_restarts 0)
    stays dead while enough remain; the coordinator drops its slot, the cluster is not restarted."""
    assert supervise([("worker-1", -9)], True, 0, {}, 0, spare_workers=1) == Supervision(None, (), (("worker-1", -9),))
    assert supervise([("worker-1", 1)], True, 3, {"worker-1": 3}, 0, spare_workers=1).left == (("worker-1", 1),)
    assert supervise([("worker-1", -9)], True, 3, {}, 0, spare_workers=1).alone == (("worker-1", -9),)  # restarts left
    two = supervise([("worker-0", -9), ("worker-1", -9)], True, 0, {}, 0, spare_workers=1)
    assert two.cluster == ("worker-1", -9) and two.left == ()  # one too many: the cluster restarts
    assert supervise([("worker-1", -9)], True, 0, {}, 0, spare_workers=0).cluster == ("worker-1", -9)
    assert supervise([("worker-1", -9)], False, 0, {}, 0, spare_workers=1).cluster == ("worker-1", -9)  # no drops
    assert supervise([("worker-1", 3)], True, 0, {}, 0, spare_workers=1).cluster == ("worker-1", 3)  # job failed


def test_a_child_that_exits_0_before_the_job_finished_counts_as_dead(tmp_path):
    """A member stopped by someone else (SIGTERM: exit 0) or user code calling ``sys.exit(0)``: nothing would
    replace it and the job would wait for it. Only the job's end, shown on the progress stream, explains an
    exit 0; the grace period covers a worker that finished before the others' reports completed the last step."""
    cfg = parse_config(yaml.safe_load(write_job(tmp_path / "job.yaml", fault={"replace_timeout_s": 0}).read_text()))
    cluster = LocalCluster(tmp_path / "job.yaml", cfg, tmp_path / "out", clean_exit_grace_s=30.0)
    quit_ = cluster._spawn("worker-1", "tests.helpers", [])  # exits 0 at once: no __main__ runs anything
    try:
        quit_.popen.wait(30)
        cluster._supervise()  # within the grace period: maybe the job's end
        cluster.clean_exit_grace_s = 0.0
        cluster._last_step_seen = True
        cluster._supervise()  # the job's last step was seen: the job's end
        cluster._last_step_seen = False
        with pytest.raises(ProcessDied) as died:
            cluster._supervise()
        assert died.value.name == "worker-1" and died.value.exit_code == 0
        assert "worker-1 exited with code 0 before the job finished" in str(died.value)
    finally:
        cluster.shutdown()


def test_the_last_error_line_is_what_a_child_that_cannot_be_restarted_is_reported_by(tmp_path):
    log_path = tmp_path / "coordinator.log"
    log_path.write_text(
        "2026-01-01 10:00:00,001 INFO pstrain-coordinator[7] pstrain.coordinator.main: starting\n"
        "2026-01-01 10:00:00,002 ERROR pstrain-coordinator[7] pstrain.coordinator.main: cannot start job j.yaml: "
        "checkpoint.dir: holds checkpoints of another job file\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "pstrain.coordinator.checkpoints.CheckpointMismatch: ERROR x y: not a log line\n"
    )
    sleeper = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper.wait(30)
    with open(log_path, "ab") as log_file:
        proc = ManagedProcess("coordinator", sleeper, log_path, log_file)
        assert proc.last_error() == "cannot start job j.yaml: checkpoint.dir: holds checkpoints of another job file"


class Interrupting:
    """A stand-in cluster whose start is interrupted by ``signum`` sent to this process; a second one arrives
    while it drains."""

    def __init__(self, out_dir: Path, signum: int) -> None:
        self.out_dir, self.signum = out_dir, signum
        self.drained = 0

    def start(self) -> None:
        os.kill(os.getpid(), self.signum)
        threading.Event().wait(10)  # the handler interrupts this wait
        raise AssertionError(f"{signal.Signals(self.signum).name} did not interrupt the launcher")

    def run(self) -> int:
        raise AssertionError("never reached")

    def shutdown(self, kill: bool = False) -> None:
        os.kill(os.getpid(), self.signum)  # systemd's second SIGTERM: the drain goes on
        threading.Event().wait(0.2)
        self.drained += 1


class NotHandled(Exception):
    pass


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_drain_the_cluster_like_ctrl_c(tmp_path, capsys, signum, code):
    """``systemctl stop`` or a closed terminal: an orderly drain and exit 128 + the signal, not a launcher
    killed at once (its children with it, by PR_SET_PDEATHSIG, with no drain)."""

    def unhandled(signum: int, frame: object) -> None:
        raise NotHandled(signal.Signals(signum).name)  # instead of this test process dying

    previous = signal.signal(signum, unhandled)
    try:
        cluster = Interrupting(tmp_path, signum)
        assert run_local_in_process(cluster, RestartPolicy(max_restarts=0)) == code  # type: ignore[arg-type]
        assert cluster.drained == 1
        assert signal.getsignal(signum) is unhandled, "the launcher's handler is gone once it returns"
    finally:
        signal.signal(signum, previous)
    assert f"interrupted ({signal.Signals(signum).name}); stopping the cluster" in capsys.readouterr().err


class CtrlCThenSigterm(Interrupting):
    """Ctrl-C while the cluster starts, then ``systemctl stop`` (SIGTERM) while it drains."""

    def start(self) -> None:
        raise KeyboardInterrupt


@pytest.mark.parametrize("finished", [False, True], ids=["after-ctrl-c", "after-the-job-finished"])
def test_a_sigterm_while_the_cluster_drains_lets_the_drain_end(tmp_path, capsys, finished):
    """A signal during a drain (one Ctrl-C started, or the end of a finished job) is ignored: the drain ends and the
    exit code is the first cause's, not 143 with children killed halfway through their grace period."""

    def unhandled(signum: int, frame: object) -> None:
        raise NotHandled(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        cluster = CtrlCThenSigterm(tmp_path, signal.SIGTERM)
        if finished:
            cluster.start = lambda: None  # type: ignore[method-assign]
            cluster.run = lambda: 3  # type: ignore[method-assign]
        assert run_local_in_process(cluster, RestartPolicy(max_restarts=0)) == (0 if finished else 130)  # type: ignore[arg-type]
        assert cluster.drained == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_child_that_cannot_be_restarted_gives_its_exit_code_and_its_error_in_one_line(tmp_path):
    """A setting only the children check (here an empty token file): exit 2 with the child's own message, as a
    bad job file does, not exit 1 with a log tail holding a traceback."""
    token = tmp_path / "token"
    token.write_text("")
    job = write_job(
        tmp_path / "job.yaml",
        security={"token_file": str(token)},
        cluster={"ps_shards": 1, "workers": 1, "devices_per_worker": 1},
    )
    marker = uuid.uuid4().hex
    result = run_local(job, tmp_path / "out", marker, timeout_s=120)
    assert result.returncode == 2, result.stderr[-3000:]
    first = result.stderr.strip().splitlines()[0]
    assert re.fullmatch(rf"pstrain local: \S+ exited with code 2: .*the token in {token} is empty", first), first
    assert "Traceback" not in result.stderr and "last log lines" not in result.stderr
    wait_for(lambda: not pids_with_marker(marker), 10, "every child to be gone")
