"""Chaos benchmark: a long `pstrain local` job with N random kill -9s of random processes.

Prints and records (bench/results/chaos.md): faults injected, faults survived, jobs lost, steps
redone, the time from each kill to the next completed step (median, max), whether the final
model equals a fault-free run of the same job, and the checkpoint cost: training time held per
checkpoint (the snapshot under the shard's lock) against the background time to write it.

Everything runs on 127.0.0.1; every loop is bounded in count and time.

    python bench/chaos.py [--kills 20] [--steps 600] [--hidden 512]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import child_env, pids_with_marker  # noqa: E402

MODULES = ("pstrain.worker", "pstrain.ps_server", "pstrain.coordinator")


def write_job(path: Path, steps: int, hidden: int, every: int, kills: int) -> Path:
    job = {
        "model": {"factory": "tests.helpers:odd_mlp", "kwargs": {"inputs": 64, "hidden": hidden, "classes": 10}},
        "data": {
            "factory": "tests.helpers:classification_set",
            "kwargs": {"n": 2000, "inputs": 64, "classes": 10},
            "shard_size": 50,
        },
        "optimizer": {"name": "adam", "lr": 0.001},
        "batch": {"per_device": 16, "lr_scaling": "sqrt"},
        "job": {"steps": steps, "seed": 5, "name": "chaos"},
        "cluster": {"ps_shards": 2, "workers": 2, "devices_per_worker": ["cpu", "cpu"]},
        "transport": {"heartbeat_s": 0.5, "heartbeat_timeout_s": 30.0},
        "checkpoint": {"every_steps": every, "keep": 2},
        "fault": {"max_restarts": kills + 5, "restart_backoff_s": 0.0},
    }
    path.write_text(yaml.safe_dump(job))
    return path


def lines(out: Path) -> int:
    try:
        return (out / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def launch(job: Path, out: Path, marker: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "pstrain.launcher.cli", "local", "--config", str(job), "--out", str(out)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=child_env(marker), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def victim(marker: str, rng: random.Random) -> tuple[int, str] | None:
    found = []
    for pid in pids_with_marker(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for module in MODULES:
            if module.encode() in argv:
                found.append((pid, module))
    return rng.choice(found) if found else None


def rejoins(out: Path) -> int:
    """Replacements that took a dead worker's slot back (the coordinator logs each one)."""
    try:
        return (out / "logs" / "coordinator.log").read_text(errors="replace").count("resumes its slot at step")
    except FileNotFoundError:
        return 0


def _median_max(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s / {max(values):.1f} s" if values else "-"


def checkpoint_costs(logs: Path) -> tuple[list[float], list[float]]:
    held = [float(m) for m in re.findall(r"held training for ([0-9.]+)s", _read_logs(logs))]
    written = [float(m) for m in re.findall(r"checkpoint of step \d+ written in ([0-9.]+)s", _read_logs(logs))]
    return held, written


def _read_logs(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("ps-*.log")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.md"))
    parser.add_argument("--keep-logs", metavar="DIR", help="copy every process's log here, lost job or not")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pstrain-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        job = write_job(tmp / "job.yaml", args.steps, args.hidden, args.every, args.kills)
        print(f"fault-free reference run of {args.steps} steps ...", flush=True)
        started = time.monotonic()
        ref = launch(job, tmp / "ref", uuid.uuid4().hex)
        _, ref_err = ref.communicate(timeout=args.timeout_s)
        if ref.returncode != 0:
            print(ref_err[-3000:], file=sys.stderr)
            return 1
        fault_free_s = time.monotonic() - started

        out = tmp / "chaos"
        marker = uuid.uuid4().hex
        started = time.monotonic()
        proc = launch(job, out, marker)
        kills: list[dict[str, object]] = []
        stderr = ""
        deadline = time.monotonic() + args.timeout_s
        try:
            while len(kills) < args.kills and proc.poll() is None and time.monotonic() < deadline:
                target = lines(out) + rng.randint(2, 2 * args.every)
                if target >= args.steps - 2:
                    break
                while lines(out) < target and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.02)  # polling a file another process appends to; bounded by the deadline
                chosen = victim(marker, rng)
                if chosen is None or proc.poll() is not None:
                    break
                pid, module = chosen
                before = lines(out)
                port_file = out / "coordinator.port"
                old_port = port_file.stat().st_mtime_ns
                old_rejoins = rejoins(out)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                # A worker is replaced in place: wait for its replacement to rejoin. Otherwise the restarted
                # coordinator (alone after a coordinator kill, with the cluster after a PS shard kill) writes
                # a new port file; after a rollback it has first truncated metrics.jsonl to its checkpoint.
                while time.monotonic() < deadline and proc.poll() is None:
                    if module == "pstrain.worker" and rejoins(out) > old_rejoins:
                        break
                    try:
                        if port_file.stat().st_mtime_ns != old_port:
                            break
                    except FileNotFoundError:
                        pass
                    time.sleep(0.01)
                low = lines(out)
                while lines(out) <= low and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.01)
                recovery_s = time.monotonic() - killed_at
                kills.append({"module": module, "at_step": before, "resumed_from": low, "recovery_s": recovery_s})
                print(
                    f"kill {len(kills):2d}: {module:20s} at step {before:4d}, resumed from {low:4d}, "
                    f"next step after {recovery_s:5.1f}s",
                    flush=True,
                )
            _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in pids_with_marker(marker):
                os.kill(pid, signal.SIGKILL)
        chaos_s = time.monotonic() - started
        finished = proc.returncode == 0
        if args.keep_logs:
            shutil.copytree(out / "logs", Path(args.keep_logs) / "logs", dirs_exist_ok=True)
        if not finished:  # keep what explains it: the launcher's stderr and every process's log
            kept = Path(tempfile.mkdtemp(prefix="pstrain-chaos-lost-"))
            shutil.copytree(out / "logs", kept / "logs", dirs_exist_ok=True)
            (kept / "launcher.stderr").write_text(stderr)
            print(f"job lost (exit {proc.returncode}); logs kept in {kept}:\n{stderr[-3000:]}", file=sys.stderr)
        same = False
        if finished:
            a = torch.load(tmp / "ref" / "model.pt", weights_only=True)
            b = torch.load(out / "model.pt", weights_only=True)
            same = all(torch.equal(a[k], b[k]) for k in a)
        held, written = checkpoint_costs(out / "logs")
        steps_redone = sum(max(0, int(k["at_step"]) - int(k["resumed_from"])) for k in kills)  # type: ignore[call-overload]
        recoveries = [float(k["recovery_s"]) for k in kills]  # type: ignore[arg-type]
        model = __import__("tests.helpers", fromlist=["odd_mlp"]).odd_mlp(64, args.hidden, 10)
        params = sum(p.numel() for p in model.parameters())

    def ms(values: list[float], digits: int) -> str:
        return f"{statistics.median(values) * 1e3:.{digits}f} / {max(values) * 1e3:.{digits}f} ms" if values else "-"

    by_kind = ", ".join(f"{m.split('.')[-1]} {sum(1 for k in kills if k['module'] == m)}" for m in MODULES)
    rows = [
        ("faults injected", f"{len(kills)} ({by_kind})"),
        ("faults survived", str(len(kills)) if finished else "job lost"),
        ("jobs lost", "0" if finished else "1"),
        ("final model equals the fault-free run", "bitwise" if same else "NO"),
        ("steps redone (trained again after a rollback)", str(steps_redone)),
        ("kill -> next completed step, median", f"{statistics.median(recoveries):.1f} s" if recoveries else "-"),
        ("kill -> next completed step, max", f"{max(recoveries):.1f} s" if recoveries else "-"),
        (
            "worker kill -> next step, median / max",
            _median_max([r for k, r in zip(kills, recoveries, strict=True) if k["module"] == "pstrain.worker"]),
        ),
        (
            "PS shard kill (rollback) -> next step, median / max",
            _median_max([r for k, r in zip(kills, recoveries, strict=True) if k["module"] == "pstrain.ps_server"]),
        ),
        (
            "coordinator kill (taken back from its journal) -> next step, median / max",
            _median_max([r for k, r in zip(kills, recoveries, strict=True) if k["module"] == "pstrain.coordinator"]),
        ),
        (
            "coordinator restarts alone / whole-cluster restarts (launcher)",
            f"{stderr.count('restarting it alone to take the job back')} / {stderr.count('restarting the cluster')}",
        ),
        ("wall time: fault-free / with kills", f"{fault_free_s:.0f} s / {chaos_s:.0f} s"),
        ("checkpoints written (all shards)", str(len(written))),
        ("training held per checkpoint, median / max", ms(held, 2)),
        ("background write per checkpoint, median / max", ms(written, 1)),
    ]
    width = max(len(r[0]) for r in rows)
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    Path(args.out).write_text(
        f"# Chaos benchmark (`bench/chaos.py`)\n\n"
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
        f"`pstrain local` job: 2 workers x 2 CPU devices, 2 PS shards, MLP 64-{args.hidden}-10 "
        f"({params / 1e6:.2f}M parameters, Adam), {args.steps} steps, `checkpoint.every_steps: {args.every}`; "
        f"{len(kills)} kill -9s of a random process (worker, PS shard or coordinator) at random steps "
        f"(seed {args.seed}). Recovery: a dead worker is restarted alone and replaces itself in its slot while the "
        f"step waits for it (S2.5: kill -> its replacement rejoined -> the next step completed); a dead "
        f"coordinator is restarted alone and takes the job back from its journal while the PS shards and workers "
        f"ride out the outage (no rollback); a dead PS shard restarts the whole cluster, which resumes from the "
        f"newest committed checkpoint.\n\n"
        f"| measure | value |\n|---|---|\n{table}\n\n"
        + "\n".join(
            f"- kill {i + 1}: {k['module']} at step {k['at_step']}, resumed from {k['resumed_from']}, "
            f"next step after {float(k['recovery_s']):.1f} s"  # type: ignore[arg-type]
            for i, k in enumerate(kills)
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0 if finished and same else 1


if __name__ == "__main__":
    sys.exit(main())
