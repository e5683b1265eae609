"""One owner per directory: one ``pstrain local`` run per ``--out``, one coordinator per ``--out`` and per
``checkpoint.dir``, one PS shard per id in ``checkpoint.dir`` on its host. A second fails at once (exit 2; a shard 3)
naming the holder; a dead holder's lock (SIGKILL) never blocks, since the kernel drops an ``flock`` with its holder."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pstrain.coordinator import main as coordinator_main
from pstrain.runtime.dir_lock import LOCAL_RUN as LOCK_NAME
from pstrain.runtime.dir_lock import DirectoryBusy, hold_directory, ps_shard_lock
from tests.helpers import REPO_ROOT, child_env, start_local, stop_local, wait_for, write_job

HOLD = "import sys; from pathlib import Path; from pstrain.runtime.dir_lock import hold_directory\n" + (
    "with hold_directory(Path(sys.argv[1]), 'pstrain.lock', '--out', 'run'):\n    sys.stdin.read()"  # until killed
)


def hold_out_dir(out: Path):
    return hold_directory(out, LOCK_NAME, "--out", "pstrain local run")


def start_coordinator(job: Path, out: Path, port_file: Path, marker: str, stderr: int) -> subprocess.Popen:
    """A coordinator process on an ephemeral port of 127.0.0.1, its port written to ``port_file``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pstrain.coordinator", "--config", str(job), "--out", str(out)]
        + ["--bind", "127.0.0.1:0", "--port-file", str(port_file)],
        cwd=REPO_ROOT,
        env=child_env(marker),
        stderr=stderr,
        text=True,
    )


def lock_holder(out: Path) -> int | None:
    """The pid written into ``<out>/pstrain.lock``, once a holder has written it."""
    text = (out / LOCK_NAME).read_text().strip() if (out / LOCK_NAME).exists() else ""
    return int(text) if text.isdigit() else None


def test_a_second_local_run_into_the_same_out_fails_at_once_naming_the_holder(tmp_path):
    job = write_job(
        tmp_path / "job.yaml",
        job={"steps": 100000, "seed": 3},  # still training when the second run starts; stopped below
        cluster={"ps_shards": 1, "workers": 1, "devices_per_worker": 1},
    )
    out = tmp_path / "out"
    first_marker, second_marker = uuid.uuid4().hex, uuid.uuid4().hex
    first = start_local(job, out, first_marker)
    second = None
    try:
        wait_for(lambda: (out / "coordinator.port").exists(), 120, "the first run's cluster to start")
        second = start_local(job, out, second_marker)
        try:
            _, stderr = second.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the second run into the same --out was not refused") from None
        assert second.returncode == 2, stderr[-3000:]
        assert f"--out {out} is in use by another pstrain local run (pid {first.pid})" in stderr
        assert "Traceback" not in stderr
        assert first.poll() is None, "the refused run must leave the first one alone"
        assert lock_holder(out) == first.pid
    finally:
        if second is not None:
            stop_local(second, second_marker)
        stop_local(first, first_marker)


def test_a_killed_runs_lock_does_not_block_the_next_run(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], cwd=REPO_ROOT, env=child_env(uuid.uuid4().hex), stdin=subprocess.PIPE
    )
    try:
        wait_for(lambda: lock_holder(out) == holder.pid, 60, "the holder to lock --out")
        with pytest.raises(DirectoryBusy, match=f"pid {holder.pid}"), hold_out_dir(out):
            pass
        holder.kill()  # SIGKILL: no clean-up runs, the lock file and its stale pid stay
        holder.wait(30)
        assert lock_holder(out) == holder.pid
        with hold_out_dir(out) as path:
            assert path == out / LOCK_NAME
            assert lock_holder(out) == os.getpid()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


@pytest.mark.parametrize("shared", ["--out", "checkpoint.dir"])
def test_a_second_coordinator_on_the_same_out_or_checkpoint_dir_exits_2_and_leaves_the_first_alone(
    tmp_path, caplog, shared
):
    """Two coordinators on one journal or one set of manifests would append to and prune each other's files."""
    job = write_job(
        tmp_path / "job.yaml",
        job={"steps": 100000, "seed": 3},
        checkpoint={"every_steps": 2, "dir": str(tmp_path / "checkpoints")},
    )
    marker = uuid.uuid4().hex
    port_file = tmp_path / "first.port"
    first = start_coordinator(job, tmp_path / "out1", port_file, marker, subprocess.PIPE)
    try:
        wait_for(lambda: port_file.exists() or first.poll() is not None, 120, "the first coordinator to serve")
        assert first.poll() is None, first.communicate()[1][-3000:]
        second_out = tmp_path / ("out1" if shared == "--out" else "out2")
        args = ["--config", str(job), "--out", str(second_out), "--bind", "127.0.0.1:0"]
        with caplog.at_level(logging.ERROR):
            assert coordinator_main.run(coordinator_main.parse_args(args)) == 2
        directory = second_out if shared == "--out" else tmp_path / "checkpoints"
        message = f"{shared} {directory} is in use by another coordinator (pid {first.pid})"
        assert any(message in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert first.poll() is None, "the refused coordinator must leave the first one alone"
        assert not (tmp_path / "out2" / "job.key").exists()  # it wrote nothing
    finally:
        first.terminate()
        first.communicate(timeout=60)


def test_a_shard_whose_checkpoint_files_another_live_shard_holds_exits_3_and_touches_nothing(tmp_path):
    """On a host of its own, a PS shard writes and prunes ``shard-<id>/`` in ``checkpoint.dir``, out of reach of the
    coordinator's lock on its host: a shard of another job pointed at the same directory with the same id would
    prune this one's snapshots. Here the test process stands in for that other shard: it holds ``ps-0.lock``, which
    the coordinator's own ``coordinator.lock`` in the same directory does not conflict with."""
    checkpoints = tmp_path / "checkpoints"
    theirs = checkpoints / "shard-0" / "step-000000004.pt"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"the other job's snapshot")
    job = write_job(
        tmp_path / "job.yaml",
        job={"steps": 100000, "seed": 3},
        cluster={"ps_shards": 1, "workers": 1, "devices_per_worker": 1},
        checkpoint={"every_steps": 2, "dir": str(checkpoints)},
    )
    marker = uuid.uuid4().hex
    port_file = tmp_path / "coordinator.port"
    coordinator = start_coordinator(job, tmp_path / "out", port_file, marker, subprocess.DEVNULL)
    shard = None
    try:
        with hold_directory(checkpoints, ps_shard_lock(0), "checkpoint.dir", "PS shard 0"):
            wait_for(lambda: port_file.exists() or coordinator.poll() is not None, 120, "the coordinator to serve")
            assert coordinator.poll() is None
            address = f"127.0.0.1:{int(port_file.read_text())}"
            shard = subprocess.Popen(
                [sys.executable, "-m", "pstrain.ps_server", "--coordinator", address, "--shard-id", "0"]
                + ["--bind", "127.0.0.1:0"],
                cwd=REPO_ROOT,
                env=child_env(marker),
                stderr=subprocess.PIPE,
                text=True,
            )
            _, stderr = shard.communicate(timeout=180)
        assert shard.returncode == 3, stderr[-3000:]
        assert f"checkpoint.dir {checkpoints} is in use by another PS shard 0 (pid {os.getpid()})" in stderr
        assert "Traceback" not in stderr, stderr[-3000:]
        assert theirs.read_bytes() == b"the other job's snapshot"
        assert not (checkpoints / "sparse-0").exists()
    finally:
        for proc in (shard, coordinator):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)
