"""Largest per-device batch without swap vs with the memory plan, and the step-time cost of swap.

For a deep MLP (24 x Linear+ReLU) and a small transformer (6 encoder layers, each planned as
one block) the script profiles the model, plans for ``--device-memory``, and reports the
largest batch without swap, with the plan (keep/swap/recompute per layer) and by S1.5's
formula. It then times training steps at a batch that fits both ways, with every layer kept
and with every layer swapped to host memory, and reports the overhead: on CUDA when a GPU is
present (side-stream copies overlapping compute), else on the CPU (where the "copy" is a
host-to-host memcpy that cannot overlap, i.e. the worst case). Results go to
``bench/results/memory.md``.

Issue 10 adds, per model and policy (keep / swap activations / whole-layer offload): the
largest batch by the device alone, by the host alone (``--host-memory`` shared by
``--devices-per-host`` devices) and both, the host memory needed at that batch and which limit
binds; the step time with whole-layer offload; and a wide MLP whose parameters alone exceed
``--big-device-memory``, planned from the measured 24 x 1024 profile scaled to its width
(parameters grow with width squared, activations with width).
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
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pstrain.planner.memory_plan import (  # noqa: E402
    MemoryBudget,
    Policy,
    batch_limits,
    max_batch,
    plan_for_batch,
    s15_max_batch,
    saved_on_device,
)
from pstrain.planner.profiler import ModelProfile, forward_saved_bytes, profile_model  # noqa: E402
from pstrain.runtime.layout import ParamLayout  # noqa: E402
from pstrain.runtime.units import parse_bytes  # noqa: E402
from pstrain.worker.offload import SwapToHost, apply_layer_policies  # noqa: E402
from pstrain.worker.param_offload import ParamOffload, offload_layers  # noqa: E402

CE = nn.functional.cross_entropy


def deep_mlp(width: int = 1024, depth: int = 24) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class SmallTransformer(nn.Module):
    def __init__(self, d_model: int = 256, layers: int = 6, seq: int = 64) -> None:
        super().__init__()
        self.seq = seq
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def time_steps(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    offload: SwapToHost | None,
    steps: int,
    device: torch.device,
    layered: ParamOffload | None = None,
) -> float:
    """Median step time; ``layered`` (whole-layer offload) sums into the host buffer and ends each step as
    ``ReplicaSet.forward_backward`` does (``finish_step``), and its gradients are not zeroed (the sum overwrites)."""
    x, y = batch[0].to(device), batch[1].to(device)
    times = []
    for i in range(steps + 1):
        if offload is not None:
            offload.reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        if layered is None:
            model.zero_grad(set_to_none=True)
        CE(model(x), y).backward()
        if layered is not None:
            layered.finish_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_model(
    name: str,
    build: Callable[[], nn.Module],
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    blocks: list[str],
    budget: MemoryBudget,
    timing_batch: int,
    steps: int,
    device: torch.device,
) -> dict:
    torch.manual_seed(0)
    profile = profile_model(build(), sample, CE, batches=(4, 8), blocks=blocks)
    no_swap = max_batch(profile, budget, allow_swap=False)
    with_plan = max_batch(profile, budget, allow_swap=True)
    s15 = s15_max_batch(profile, budget.device_bytes)
    torch.manual_seed(0)
    plain = build().to(device)
    kept_s = time_steps(plain, sample(timing_batch), None, steps, device)
    torch.manual_seed(0)
    swapped = build().to(device)
    offload = SwapToHost(prefetch=budget.prefetch).ignore_parameters(swapped)
    apply_layer_policies(swapped, {la.name: "swap" for la in profile.layers if la.saved_bytes_per_sample > 0}, offload)
    swap_s = time_steps(swapped, sample(timing_batch), offload, steps, device)
    torch.manual_seed(0)
    layered = build()
    _, _, hooks = offload_layers(layered, device, ParamLayout.of(layered), device.type == "cuda", budget.prefetch)
    offload_s = time_steps(layered, sample(timing_batch), None, steps, device, hooks)
    row = dict(
        model=name,
        layers=len(profile.layers),
        no_swap=no_swap,
        with_plan=with_plan,
        s15=s15,
        ratio=with_plan / max(no_swap, 1),
        batch=timing_batch,
        kept_s=kept_s,
        swap_s=swap_s,
        overhead=swap_s / kept_s - 1,
        swapped_mb=offload.stats.swapped_out_bytes / 1e6,
        offload_s=offload_s,
        offload_overhead=offload_s / kept_s - 1,
        limits=policy_limits(profile, budget),
        profile=profile,
        recompute=recompute_rows(profile, build, sample, budget),
    )
    print(
        f"{name:<28} no swap {no_swap:>8}  with plan {with_plan:>8}  ({row['ratio']:.1f}x)  S1.5 {s15:>9}  | "
        f"batch {timing_batch}: kept {kept_s * 1e3:.1f} ms, swapped {swap_s * 1e3:.1f} ms "
        f"({row['overhead']:+.0%}, {row['swapped_mb']:.0f} MB out)",
        flush=True,
    )
    return row


def saved_by_forward(model: nn.Module, policies: dict[str, str], inputs: torch.Tensor) -> int:
    apply_layer_policies(model, policies, SwapToHost())
    return forward_saved_bytes(model, inputs)


def without_inputs(profile: ModelProfile) -> ModelProfile:
    """The profile as the planner read it before 2026-11-27: a recompute layer held nothing."""
    layers = tuple(replace(la, inputs=()) for la in profile.layers)
    return replace(profile, layers=layers)


def recompute_rows(
    profile: ModelProfile,
    build: Callable[[], nn.Module],
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    budget: MemoryBudget,
) -> list[dict]:
    """Recompute alone (a link too slow for any swap to hide): the largest batch each planner chose, and whether
    it fits once the saved bytes are what the real forward under its policies leaves (per sample, as a slope)."""
    slow = replace(budget, bandwidth_bytes_per_s=1.0, host_bytes=None)
    rows = []
    for planner, planned in (
        ("counts what a checkpoint keeps", profile),
        ("before: a checkpoint keeps nothing", without_inputs(profile)),
    ):
        batch = max_batch(planned, slow, allow_swap=True)
        plan = plan_for_batch(planned, batch, slow)
        policies = plan.policies()
        torch.manual_seed(0)
        real = [saved_by_forward(build(), policies, sample(n)[0]) for n in (4, 8)]
        real_per_sample = (real[1] - real[0]) / 4
        real_at = real[0] + real_per_sample * (batch - 4)
        said = saved_on_device(planned, batch, {n: Policy(p) for n, p in policies.items()})
        real_peak = plan.peak_bytes + (real_at - said) / (1 - slow.margin)
        rows.append(
            dict(
                planner=planner,
                batch=batch,
                recomputed=len(policies),
                said_per_sample=said / batch,
                real_per_sample=real_per_sample,
                real_peak_gib=real_peak / 2**30,
                fits=real_peak <= slow.device_bytes,
            )
        )
    return rows


POLICIES = (("keep", False, False), ("swap activations", True, False), ("whole-layer offload", True, True))


def policy_limits(profile: ModelProfile, budget: MemoryBudget) -> list[dict]:
    """Per policy: largest batch by device, by host, both; host memory needed at it; which binds."""
    rows = []
    for policy, allow_swap, offload in POLICIES:
        b = replace(budget, offload_params=offload)
        lim = batch_limits(profile, b, allow_swap, upper=1 << 24)
        host = plan_for_batch(profile, max(lim.both, 1), b, allow_swap).host_bytes
        rows.append(
            dict(
                policy=policy, device=lim.device, host=lim.host, both=lim.both, host_gib=host / 2**30, binds=lim.binding
            )
        )
    return rows


def scaled_mlp(profile: ModelProfile, factor: int) -> ModelProfile:
    """The 24 x 1024 MLP's profile at width 1024 * factor: parameters x factor^2, activations and times x factor."""
    layers = tuple(
        replace(
            la,
            param_bytes=la.param_bytes * factor * factor,
            saved_bytes_per_sample=la.saved_bytes_per_sample * factor,
            saved_bytes_fixed=la.saved_bytes_fixed * factor,
            output_bytes_per_sample=la.output_bytes_per_sample * factor,
            inputs=tuple(
                replace(i, bytes_per_sample=i.bytes_per_sample * factor, bytes_fixed=i.bytes_fixed * factor)
                for i in la.inputs
            ),
            forward_s=la.forward_s * factor * factor,
            backward_s=la.backward_s * factor * factor,
        )
        for la in profile.layers
    )
    return replace(profile, layers=layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device-memory", default="16GiB", help="device memory to plan for")
    parser.add_argument("--bandwidth", default="12GB/s", help="device<->host bandwidth for the plan")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--host-memory", default="64GiB", help="host memory shared by the host's devices")
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--pinned-limit", default="4GiB", help="pinned host memory per device")
    parser.add_argument("--big-device-memory", default="2GiB", help="device memory for the wide-MLP row")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.md"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    budget = MemoryBudget(
        parse_bytes(args.device_memory),
        float(parse_bytes(args.bandwidth)),
        host_bytes=parse_bytes(args.host_memory),
        devices_per_host=args.devices_per_host,
        pinned_limit_bytes=parse_bytes(args.pinned_limit),
    )
    rows = [
        bench_model(
            "deep MLP (24 x 1024)",
            deep_mlp,
            lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))),
            [],
            budget,
            256,
            args.steps,
            device,
        ),
        bench_model(
            "transformer (6 x d256, seq 64)",
            SmallTransformer,
            lambda n: (torch.randn(n, 64, 256), torch.randint(0, 10, (n,))),
            [f"blocks.{i}" for i in range(6)],
            budget,
            32,
            args.steps,
            device,
        ),
    ]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    big_budget = replace(budget, device_bytes=parse_bytes(args.big_device_memory))
    big = scaled_mlp(rows[0]["profile"], 6)
    big_rows = policy_limits(big, big_budget)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [
        "# Memory planner (bench/memory.py)",
        "",
        f"Load average at the start of the write-up: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (shared machine).",
        "",
        f"Run {when}; profiles on the CPU, plan for {args.device_memory} of device memory at {args.bandwidth} "
        f"device<->host, margin {budget.margin:.0%}, prefetch {budget.prefetch}; step times on {where}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, median of {args.steps} steps.",
        "",
        "| model | planned layers | max batch without swap | with the plan | ratio | S1.5 formula |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {r['model']} | {r['layers']} | {r['no_swap']} | {r['with_plan']} | {r['ratio']:.1f}x | {r['s15']} |"
            for r in rows
        ],
        "",
        "S1.5's formula (memory / the largest layer's per-sample bytes) ignores every other layer, the resident "
        "parameters and gradients and the backward temporaries, so it overstates what fits; the planner's figure "
        "is the honest one.",
        "",
        "| model | batch | step, all kept | step, all swapped | swap overhead | swapped out per step |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {r['model']} | {r['batch']} | {r['kept_s'] * 1e3:.1f} ms | {r['swap_s'] * 1e3:.1f} ms | "
            f"{r['overhead']:+.0%} | {r['swapped_mb']:.0f} MB |"
            for r in rows
        ],
        "",
    ]
    lines += [
        f"## Which limit binds: {args.device_memory} device, {args.host_memory} host shared by "
        f"{args.devices_per_host} devices, pinned {args.pinned_limit}/device",
        "",
        "Host memory counts every device's swapped activations, its offloaded parameters and gradients (or its "
        "pinned gradient staging), and the worker's own sum buffers. The largest batch is the smaller of the two.",
        "",
        "| model | policy | device-fit batch | host-fit batch | largest batch | host memory at it | binds |",
        "|---|---|---:|---:|---:|---:|---|",
        *[
            f"| {r['model']} | {lim['policy']} | {lim['device']} | {lim['host']} | {lim['both']} | "
            f"{lim['host_gib']:.1f} GiB | {lim['binds']} |"
            for r in rows
            for lim in r["limits"]
        ],
        "",
        "| model | batch | step, all kept | step, whole-layer offload | offload overhead |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {r['model']} | {r['batch']} | {r['kept_s'] * 1e3:.1f} ms | {r['offload_s'] * 1e3:.1f} ms | "
            f"{r['offload_overhead']:+.0%} |"
            for r in rows
        ],
        "",
        f"## A model larger than the device: 24 x 6144 MLP ({big.param_bytes / 2**30:.1f} GiB of parameters) on "
        f"{args.big_device_memory} devices",
        "",
        "Planned from the measured 24 x 1024 profile scaled to width 6144 (parameters x36, activations x6).",
        "",
        "| policy | device-fit batch | host-fit batch | largest batch | host memory at it | binds |",
        "|---|---:|---:|---:|---:|---|",
        *[
            f"| {lim['policy']} | {lim['device']} | {lim['host']} | {lim['both']} | {lim['host_gib']:.1f} GiB | "
            f"{lim['binds']} |"
            for lim in big_rows
        ],
        "",
    ]
    lines += [
        f"## Recompute alone: what a checkpoint keeps ({args.device_memory} device, no swap can hide)",
        "",
        "`torch.utils.checkpoint` keeps a recomputed layer's input until its backward, and a Linear or a ReLU saves "
        "exactly its input or output, so recomputing one alone frees nothing. The planner now counts each recompute "
        "layer's input (unless a kept layer saves it anyway) and the input a kept layer saves after a recomputed "
        "one saved it first. Below, the plan when the link is too slow for any swap to hide (recompute only), "
        "by this planner and by the one before it; *saved per sample, real*: what the forward under that plan "
        "leaves for backward, measured with saved-tensor hooks at batches 4 and 8; *real peak*: the plan's peak "
        "with those bytes in place of the planned ones.",
        "",
        "| model | planner | largest batch | layers recomputed | saved per sample, planned | saved per sample, real "
        "| real peak | fits |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *[
            f"| {r['model']} | {c['planner']} | {c['batch']} | {c['recomputed']} | {c['said_per_sample'] / 1024:.1f} "
            f"KiB | {c['real_per_sample'] / 1024:.1f} KiB | {c['real_peak_gib']:.1f} GiB | "
            f"{'yes' if c['fits'] else '**no**'} |"
            for r in rows
            for c in r["recompute"]
        ],
        "",
    ]
    if device.type == "cpu":
        lines += [
            "No GPU on this machine: the swap overhead above is the CPU copy cost (host-to-host, no overlap "
            "with compute), an upper bound for what the side-stream copies cost on a GPU.",
            "",
        ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
