"""What OpenMP's passive wait policy costs a process that trains on the CPU by itself.

pstrain's services start with ``OMP_WAIT_POLICY=PASSIVE`` (``runtime/openmp.py``): on a host where a worker and
shards share the cores, spinning pools cost the shards 4x the CPU per GPU step (``results/step_cuda.md``). The
policy's price falls on a worker that trains on CPU devices: its forward and backward are parallel regions back to
back, and a passive pool sleeps between them, so each region starts with a wake-up instead of a spinning thread.
This bench measures that price: the same forward + backward + zero_grad loop of an 8 x Linear(1024) MLP at every
CPU this process may use, in a fresh process per policy (libgomp reads the variable once, at load), the policies
alternating over the rounds. Results go to ``bench/results/openmp.md``. About a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("default", "PASSIVE")  # default: the variable unset (libgomp spins a while, then sleeps)
BATCHES = (64, 256)


def child(batch: int, steps: int) -> dict[str, float]:
    """In the measuring process: per-step times of the loop, and this process's CPU time per step."""
    import time

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    x, y = torch.randn(batch, 1024), torch.randint(0, 1024, (batch,))

    def step() -> None:
        model.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()

    for _ in range(5):
        step()
    times = []
    cpu = time.process_time()
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {
        "step_ms": 1e3 * statistics.median(times),
        "cpu_ms": 1e3 * (time.process_time() - cpu) / steps,
        "threads": torch.get_num_threads(),
    }


def measure(policy: str, batch: int, steps: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child", str(batch), "--steps", str(steps)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def _each(runs: list[dict[str, float]]) -> str:
    return ", ".join(f"{f['step_ms']:.1f}" for f in runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="runs of each policy per batch, alternating (default 3)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per run (default 30)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "openmp.md")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # internal: measure one batch size here
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps)))
        return 0
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for batch in BATCHES:
        for r in range(args.rounds):
            order = POLICIES if r % 2 == 0 else tuple(reversed(POLICIES))
            for policy in order:
                figures = measure(policy, batch, args.steps)
                runs.setdefault((policy, batch), []).append(figures)
                print(f"batch {batch} round {r + 1} {policy:8s}: {figures['step_ms']:.1f} ms", flush=True)
    threads = int(next(iter(runs.values()))[0]["threads"])
    rows = []
    for batch in BATCHES:
        spin, passive = (runs[(policy, batch)] for policy in POLICIES)
        s_ms, p_ms = (statistics.median(f["step_ms"] for f in fs) for fs in (spin, passive))
        s_cpu, p_cpu = (statistics.fmean(f["cpu_ms"] for f in fs) for fs in (spin, passive))
        rows.append(
            f"| {batch} | {s_ms:.1f} ({_each(spin)}) | {p_ms:.1f} ({_each(passive)}) | **{p_ms / s_ms:.2f}x** "
            f"| {s_cpu:.1f} | {p_cpu:.1f} |"
        )
    import torch

    text = f"""# OpenMP's passive wait policy on a CPU training loop (bench/openmp.py)

- Run {started}; {platform.machine()}, {os.cpu_count()} CPUs, **{threads} intra-op threads** (every CPU this process
  may use); Python {platform.python_version()}, torch {torch.__version__}; load average at the start
  {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}.
- Loop: zero_grad + forward + backward of an 8 x Linear(1024) MLP (8.4M parameters), cross-entropy; 5 warm-up and
  {args.steps} measured steps per run, a fresh process per run; {args.rounds} runs per policy and batch, alternating.
- default: `OMP_WAIT_POLICY` unset (libgomp spins a while after a region, then sleeps); PASSIVE: what pstrain's
  services set (`runtime/openmp.py`).

| batch | default step ms (runs) | PASSIVE step ms (runs) | PASSIVE / default | default CPU ms | PASSIVE CPU ms |
|---|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

Step: the median over a run's steps, then over the runs. CPU: the process's CPU time per measured step, mean over
the runs (a spinning pool shows as CPU beyond the step's own work).
"""
    print("\n" + text)
    args.out.write_text(text)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
