"""Speed of a PS shard's optimizer update vs. a bare ``p.add_(g)`` pass and torch's own kernels, same run.

The update is an elementwise pass over the shard's range, so its bound is memory bandwidth:
each case is reported as the bytes it must read and write per second (parameters, gradient,
optimizer state: 12 bytes per element for ``add_``, 20 for SGD with momentum, 28 for Adam and
AdamW) and as a ratio to the ``add_`` pass. Cases:

* ``p.add_(g)``: the bound (read two tensors, write one);
* the shard's step (``build_optimizer`` + ``step_on_mean``: fused kernel, the division by the
  device count folded in), the step before this change (``div_`` pass + for-loop kernel), and
  plain ``torch.optim`` (for-loop, foreach, fused) stepping on the already-divided mean;
* the shard's whole ``_apply_update`` timed by the shard itself (``PushResult.update_s``): the
  step plus publishing the parameters for pulls (a copy into the spare of two buffers);
* a thread sweep of ``add_`` and the shard's steps, which the shard's thread count rests on.

Cases run interleaved (one timing of every case per round) so a neighbour's burst of CPU use
lands on all of them alike; each figure is the median over the rounds after warm-up. Results
go to ``bench/results/update.md``. About a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pstrain.protos import pstrain_pb2 as pb  # noqa: E402
from pstrain.ps_server.optimizer import build_optimizer, step_on_mean, update_threads  # noqa: E402
from pstrain.ps_server.shard import ParameterShard  # noqa: E402

DEVICES = 2  # the shard's gradient is a sum over this many devices (two workers, one device each)
LR = 1e-3
SPECS = {
    "sgd": pb.OptimizerSpec(name="sgd", momentum=0.9),
    "adam": pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8),
    "adamw": pb.OptimizerSpec(name="adamw", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
}
TORCH = {
    "sgd": lambda p, **k: torch.optim.SGD([p], lr=LR, momentum=0.9, **k),
    "adam": lambda p, **k: torch.optim.Adam([p], lr=LR, betas=(0.9, 0.999), eps=1e-8, **k),
    "adamw": lambda p, **k: torch.optim.AdamW([p], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **k),
}
BYTES_PER_ELEMENT = {"add": 12, "sgd": 20, "adam": 28, "adamw": 28, "copy": 8, "sgd+copy": 28, "adam+copy": 36}
"""What a pass must read and write per element: parameter (r+w), gradient (r), each state tensor (r+w),
and for the shard's whole update the published copy (r+w)."""


@dataclass
class Case:
    label: str
    kind: str  # a key of BYTES_PER_ELEMENT
    run: Callable[[], float | None]  # returns its own time when it measures itself (the shard), else None
    prepare: Callable[[], None] = lambda: None  # untimed, before each run
    times: list[float] = field(default_factory=list)

    def once(self) -> float:
        self.prepare()
        started = time.perf_counter()
        own = self.run()
        return own if own is not None else time.perf_counter() - started

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def filled(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def add_case(numel: int) -> Case:
    p, g = filled(numel, 0), filled(numel, 1)

    def run() -> None:
        p.add_(g, alpha=1e-6)  # a small alpha keeps p's values where they are over the rounds

    return Case("p.add_(g)", "add", run)


def shard_step_case(name: str, numel: int) -> Case:
    """What ``ParameterShard._apply_update`` runs before publishing: the fused step on the device sum."""
    param = torch.nn.Parameter(filled(numel, 2))
    opt = build_optimizer(param, SPECS[name], LR)
    total = filled(numel, 3) * DEVICES
    grad = torch.empty_like(total)
    param.grad = grad

    def refill() -> None:  # the kernel stores the mean back into the accumulator; a shard refills it each step
        grad.copy_(total)

    return Case(f"{name}: shard step (fused, /devices folded in)", name, lambda: step_on_mean(opt, DEVICES), refill)


def old_shard_step_case(name: str, numel: int) -> Case:
    """The shard's step before this change: a division pass, then the default (for-loop) kernel."""
    param = torch.nn.Parameter(filled(numel, 2))
    opt = TORCH[name](param)
    total = filled(numel, 3) * DEVICES
    grad = torch.empty_like(total)

    def run() -> None:
        param.grad = grad.div_(DEVICES)
        opt.step()

    def refill() -> None:
        grad.copy_(total)

    return Case(f"{name}: before (div_ pass + for-loop)", name, run, refill)


def torch_case(name: str, numel: int, kernel: str) -> Case:
    """Plain torch.optim on the already-divided mean: no division to do."""
    param = torch.nn.Parameter(filled(numel, 2))
    options = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kernel]
    opt = TORCH[name](param, **options)
    param.grad = filled(numel, 3)

    def run() -> None:
        opt.step()

    return Case(f"{name}: torch.optim {kernel} (on the mean)", name, run)


def whole_update_case(name: str, numel: int) -> Case:
    """The shard's own ``_apply_update`` (step + publish), timed by the shard, driven by two real pushes."""
    spec = SPECS[name]
    shard = ParameterShard(0, 0, numel, filled(numel, 2), spec, pb.LrSchedule(scaled_lr=LR), workers=DEVICES)
    grads = [filled(numel, 10 + w) for w in range(DEVICES)]

    def run() -> float:
        step = shard.version
        for worker, grad in enumerate(grads):
            result = shard.push(worker, step, grad, device_count=1)
        assert result.completed
        return result.update_s

    return Case(f"{name}: shard _apply_update (step + publish copy)", f"{name}+copy", run)


def publish_case(numel: int) -> Case:
    """What ``ParameterShard._publish`` copies: into a spare buffer it reuses (a fresh one per step would add
    page faults on new memory, about as much again on this machine)."""
    p, spare = filled(numel, 4), torch.empty(numel)

    def run() -> None:
        spare.copy_(p.detach())

    return Case("publish copy alone (into the spare buffer)", "copy", run)


def measure(cases: list[Case], warmup: int, rounds: int) -> None:
    for _ in range(warmup):
        for case in cases:
            case.once()
    for _ in range(rounds):
        for case in cases:
            case.times.append(case.once())


def gbps(case: Case, numel: int) -> float:
    return BYTES_PER_ELEMENT[case.kind] * numel / case.median_s / 1e9


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(cases: list[Case], numel: int, add_gbps: float) -> list[str]:
    lines = [
        "| case | bytes/elem | median | GB/s | × add_ bandwidth | best (min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        bw = gbps(case, numel)
        lines.append(
            f"| {case.label} | {BYTES_PER_ELEMENT[case.kind]} | {case.median_s * 1e3:.1f} ms | {bw:.1f} | "
            f"{bw / add_gbps:.2f} | {min(case.times) * 1e3:.1f} ms |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=25_000_000, help="shard size in float32 elements")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (median) after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "update.md")
    args = parser.parse_args(argv)
    numel = args.params
    threads = update_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    started = time.perf_counter()

    cases = [add_case(numel)]
    for name in ("sgd", "adam", "adamw"):
        cases += [
            shard_step_case(name, numel),
            old_shard_step_case(name, numel),
            torch_case(name, numel, "fused"),
            torch_case(name, numel, "foreach"),
            torch_case(name, numel, "for-loop"),
        ]
    cases += [whole_update_case("sgd", numel), whole_update_case("adam", numel), publish_case(numel)]
    measure(cases, args.warmup, args.rounds)
    by_label = {case.label: case for case in cases}
    add_gbps = gbps(cases[0], numel)

    # Thread sweep: the same passes at each thread count up to the CPUs this process may use.
    sweep: dict[int, list[float]] = {}  # threads -> GB/s of add_, sgd step, adam step
    for n in sorted({1, threads, len(os.sched_getaffinity(0))}):
        torch.set_num_threads(n)
        trio = [add_case(numel), shard_step_case("sgd", numel), shard_step_case("adam", numel)]
        measure(trio, 1, max(3, args.rounds // 2))
        sweep[n] = [gbps(case, numel) for case in trio]
        del trio  # free the tensors before the next count
    torch.set_num_threads(threads)
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started

    def speed(faster: str, slower: str) -> float:
        return by_label[slower].median_s / by_label[faster].median_s

    ours = "{}: shard step (fused, /devices folded in)"
    summary = [
        "| target | value | goal |",
        "|---|---:|---|",
        f"| sgd shard step bandwidth / p.add_(g) bandwidth | {gbps(by_label[ours.format('sgd')], numel) / add_gbps:.2f}"
        " | ≥ 0.8 |",
    ]
    for name in ("adam", "adamw"):
        value = speed(ours.format(name), f"{name}: torch.optim fused (on the mean)")
        summary.append(f"| {name} shard step speed / torch fused {name} speed | {value:.2f} | ≥ 1.0 |")
    for name in ("sgd", "adam", "adamw"):
        value = speed(ours.format(name), f"{name}: before (div_ pass + for-loop)")
        summary.append(f"| {name} shard step speed-up over the step before this change | {value:.1f}× | |")
    sweep_lines = [
        "| intra-op threads | p.add_(g) GB/s | sgd shard step GB/s | adam shard step GB/s |",
        "|---:|---:|---:|---:|",
    ] + [f"| {n} | {a:.1f} | {b:.1f} | {c:.1f} |" for n, (a, b, c) in sweep.items()]

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"Run {when} on {platform.machine()}, {cpu_model()}, nproc {os.cpu_count()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}. Shard: {numel:,} float32 parameters "
        f"({numel * 4 / 1e6:.0f} MB); the gradient is a sum over {DEVICES} devices. Intra-op threads: {threads} "
        f"(`update_threads()`, what a shard sets). Median of {args.rounds} interleaved rounds after "
        f"{args.warmup} warm-up rounds; bandwidth = bytes the pass must read and write / time. "
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (above 0 means other processes shared the "
        f"{os.cpu_count()} cores). Whole run: {elapsed:.0f} s."
    )
    lines = [
        "# PS update speed (bench/update.py)",
        "",
        header,
        "",
        *table(cases, numel, add_gbps),
        "",
        *summary,
        "",
        "The shard's step does the division torch's fused reference is spared (it steps on the mean): the",
        "kernel divides as it reads and stores the divided gradient back, 4 bytes per element more than",
        "the reference's traffic, so parity with torch fused Adam/AdamW is what to expect, and a ratio a",
        "few percent either side of 1.0 is noise. Publishing copies the parameters into the spare of two",
        "buffers (pulls read the other), so ``_apply_update`` is the step plus one copy pass.",
        "",
        "Thread sweep (same passes, fewer rounds):",
        "",
        *sweep_lines,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
