"""S4.2: choose the gradient bucket size from profiled backward times and the PS update rate.

A bucket leaves when backward has produced all its gradients; its push, the shards' update and
its pull then run while backward goes on with earlier layers. What the step waits for is what
is left after backward ends: the last bucket's push + update + pull, and the queue in front of
it. Small buckets leave early but each costs a fixed per-message overhead (an RPC per piece and
direction, an update call per piece); one big bucket pays the overhead once but overlaps
nothing. The chooser replays one step on a model of that pipeline for each candidate size and
takes the one with the least exposed communication.

The model, per bucket ``b`` in backward order (``R_b``: backward has produced its last gradient):

    push_b   = max(R_b, push_{b-1})     + message_s + bytes_b * push_ratio * fan_in / network
    update_b = max(push_b, update_{b-1}) + update_call_s + bytes_b / (update_rate * ps_shards)
    pull_b   = max(update_b, pull_{b-1}) + message_s + bytes_b * fan_in / network

``fan_in = max(1, workers / ps_shards)``: every worker sends a shard its part, so a shard's link
carries that many times a worker's bytes. The next forward needs the buckets in forward order
(the last one pulled first), so the exposed time is how much later the forward ends than it
would with every pull done when backward ended.

The product has one knob, ``transport.bucket_bytes``: buckets of whole parameters filled in
backward order to about that size. The chooser evaluates that rule (at layer granularity: the
profile's unit) for sizes from 64 KiB to 64 MiB and one bucket, and also searches the boundaries
freely (a layer-boundary hill climb) to tell whether non-uniform buckets would be worth having.
They are only reported: ``runtime.buckets`` derives the buckets on the workers and the shards
from the one size, so explicit boundaries would have to travel in the job spec, and so far the
gain has not paid for that (``pstrain plan`` prints it when it would).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pstrain.planner.profiler import ModelProfile
from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.optimizer import build_optimizer, step_on_mean

CANDIDATE_BYTES = tuple(1 << k for k in range(16, 27))  # 64 KiB .. 64 MiB; 0 (one bucket) is tried as well
NETWORK_BYTES_S = 1.25e9  # a 10 Gb/s link, when the job gives no figure
MESSAGE_S = 1e-3  # fixed cost of one bucket's RPCs in one direction (gRPC in Python, per piece)
UPDATE_CALL_S = 1e-4  # fixed cost of one piece's optimizer call
TIE = 0.01  # candidates within 1% of the best count as equal; the larger bucket (fewer messages) wins


@dataclass(frozen=True)
class Layer:
    """One profiled layer: its parameters' bytes (float32) and its backward time."""

    name: str
    param_bytes: int
    backward_s: float
    forward_s: float = 0.0


@dataclass(frozen=True)
class CommModel:
    """The rates and fixed costs the pipeline model uses (see the module doc)."""

    network_bytes_s: float = NETWORK_BYTES_S
    update_bytes_s: float = 1e9  # one shard's optimizer: parameter bytes updated per second
    message_s: float = MESSAGE_S
    update_call_s: float = UPDATE_CALL_S
    workers: int = 1
    ps_shards: int = 1
    push_ratio: float = 1.0  # push bytes per float32 byte: 0.5 with transport.push_dtype: bfloat16

    def __post_init__(self) -> None:
        if self.network_bytes_s <= 0 or self.update_bytes_s <= 0 or self.workers < 1 or self.ps_shards < 1:
            raise ValueError(f"a communication model needs positive rates and counts, got {self}")


@dataclass(frozen=True)
class BucketChoice:
    """The chooser's answer: ``bucket_bytes`` for the job file, and what it and its rivals would cost."""

    bucket_bytes: int  # 0: one bucket
    exposed_s: float
    buckets: tuple[int, ...]  # bucket sizes in bytes, backward order, with bucket_bytes
    one_bucket_s: float  # exposed with one bucket (no overlap)
    candidates: tuple[tuple[int, float], ...]  # (bucket_bytes, exposed_s) for every size tried
    free_exposed_s: float  # the best boundaries found without the one-size rule
    free_buckets: tuple[int, ...]
    backward_s: float

    @property
    def free_gain_s(self) -> float:
        return self.exposed_s - self.free_exposed_s


def layers_of(profile: ModelProfile) -> list[Layer]:
    """The profile's layers (forward order); layers without parameters keep their time in the pipeline."""
    return [Layer(p.name, p.param_bytes, p.backward_s, p.forward_s) for p in profile.layers]


def exposed_s(layers: Sequence[Layer], groups: Sequence[int], model: CommModel) -> float:
    """Exposed communication when the layers (forward order) leave in ``groups`` (layer counts, backward order)."""
    if sum(groups) != len(layers) or any(g < 1 for g in groups):
        raise ValueError(f"groups {list(groups)} do not cover {len(layers)} layers")
    backward = list(reversed(layers))
    fan_in = max(1.0, model.workers / model.ps_shards)
    wire = fan_in / model.network_bytes_s
    rate = model.update_bytes_s * model.ps_shards
    clock = push = update = pull = 0.0
    pulled: list[tuple[float, float]] = []  # per group: (pull end, its forward time)
    at = 0
    for count in groups:
        group = backward[at : at + count]
        at += count
        clock += sum(layer.backward_s for layer in group)
        size = sum(layer.param_bytes for layer in group)
        if size == 0:  # nothing to send: the forward of these layers waits for nobody
            pulled.append((0.0, sum(layer.forward_s for layer in group)))
            continue
        push = max(clock, push) + model.message_s + size * model.push_ratio * wire
        update = max(push, update) + model.update_call_s + size / rate
        pull = max(update, pull) + model.message_s + size * wire
        pulled.append((pull, sum(layer.forward_s for layer in group)))
    forward = ideal = clock
    for ready, forward_s in reversed(pulled):  # the next forward, first layers first
        forward = max(forward, ready) + forward_s
        ideal += forward_s
    return forward - ideal


def uniform_groups(layers: Sequence[Layer], bucket_bytes: int) -> list[int]:
    """``runtime.buckets``' one-size rule at layer granularity: layer counts per bucket, backward order."""
    if bucket_bytes <= 0:
        return [len(layers)] if layers else []
    groups: list[int] = []
    count = held = 0
    for layer in reversed(layers):
        if layer.param_bytes > bucket_bytes and held:  # bigger than the target: a bucket alone
            groups.append(count)
            count = held = 0
        count += 1
        held += layer.param_bytes
        if held >= bucket_bytes:
            groups.append(count)
            count = held = 0
    if count:
        if groups and held == 0:
            groups[-1] += count  # layers without parameters join the last bucket
        else:
            groups.append(count)
    return groups


def sizes_of(layers: Sequence[Layer], groups: Sequence[int]) -> tuple[int, ...]:
    backward = list(reversed(layers))
    out, at = [], 0
    for count in groups:
        out.append(sum(layer.param_bytes for layer in backward[at : at + count]))
        at += count
    return tuple(out)


def free_groups(layers: Sequence[Layer], model: CommModel, start: Sequence[int], passes: int = 50) -> list[int]:
    """Hill-climb the bucket boundaries (a cut or not after each layer) from ``start``: best toggle per pass."""
    cuts = [False] * max(0, len(layers) - 1)
    at = 0
    for count in start[:-1]:
        at += count
        cuts[at - 1] = True
    best = exposed_s(layers, _groups(cuts), model)
    for _ in range(passes):
        move, value = -1, best
        for i in range(len(cuts)):
            cuts[i] = not cuts[i]
            tried = exposed_s(layers, _groups(cuts), model)
            cuts[i] = not cuts[i]
            if tried < value - 1e-12:
                move, value = i, tried
        if move < 0:
            break
        cuts[move] = not cuts[move]
        best = value
    return _groups(cuts)


def _groups(cuts: Sequence[bool]) -> list[int]:
    groups, count = [], 1
    for cut in cuts:
        if cut:
            groups.append(count)
            count = 0
        count += 1
    groups.append(count)
    return groups


def choose_bucket_bytes(
    layers: Sequence[Layer], model: CommModel, candidates: Sequence[int] = CANDIDATE_BYTES
) -> BucketChoice:
    """The size (or 0, one bucket) whose buckets leave the least communication exposed; ties go to the larger."""
    if not layers:
        raise ValueError("no layers to plan buckets for")
    tried = [(size, exposed_s(layers, uniform_groups(layers, size), model)) for size in (0, *sorted(candidates))]
    best = min(value for _, value in tried)
    # Among the near-best, the fewest messages: one bucket (0) first, then the largest size.
    near = [size for size, value in tried if value <= best * (1 + TIE) + 1e-9]
    chosen = 0 if 0 in near else max(near)
    chosen_s = dict(tried)[chosen]
    groups = uniform_groups(layers, chosen)
    free = free_groups(layers, model, groups)
    free_s = exposed_s(layers, free, model)
    return BucketChoice(
        bucket_bytes=chosen,
        exposed_s=chosen_s,
        buckets=sizes_of(layers, groups),
        one_bucket_s=dict(tried)[0],
        candidates=tuple(tried),
        free_exposed_s=min(free_s, chosen_s),
        free_buckets=sizes_of(layers, free) if free_s < chosen_s else sizes_of(layers, groups),
        backward_s=sum(layer.backward_s for layer in layers),
    )


def measure_update_rate(optimizer: pb.OptimizerSpec, numel: int = 1 << 22, repeats: int = 3) -> float:
    """Parameter bytes per second of the shard's optimizer step (the same ``build_optimizer``) on one tensor."""
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = build_optimizer(param, optimizer, 1e-3)
    param.grad = torch.full((numel,), 1e-3)
    step_on_mean(opt, 1)  # warm-up: state allocation
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step_on_mean(opt, 1)
        times.append(time.perf_counter() - started)
    return numel * 4 / max(sorted(times)[len(times) // 2], 1e-9)


def describe(choice: BucketChoice, model: CommModel) -> str:
    """The plan as ``pstrain plan`` prints it."""
    size = "0 (one bucket)" if choice.bucket_bytes == 0 else _mib(choice.bucket_bytes)
    lines = [
        f"gradient buckets (S4.2): transport.bucket_bytes {size} -> {len(choice.buckets)} bucket(s); "
        f"modelled exposed communication {choice.exposed_s * 1e3:.2f} ms after a {choice.backward_s * 1e3:.2f} ms "
        f"backward (one bucket: {choice.one_bucket_s * 1e3:.2f} ms)",
        f"  model: network {model.network_bytes_s / 1e9:.2f} GB/s, PS update {model.update_bytes_s / 1e9:.2f} GB/s "
        f"per shard, {model.message_s * 1e3:.2f} ms per message, {model.workers} worker(s), "
        f"{model.ps_shards} shard(s), push bytes x{model.push_ratio:g}",
        "  tried: " + ", ".join(f"{'one' if s == 0 else _mib(s)} {v * 1e3:.2f}ms" for s, v in choice.candidates),
    ]
    if choice.free_gain_s > max(1e-4, 0.02 * choice.exposed_s):  # worth a line: 2% of the exposed time
        lines.append(
            f"  non-uniform buckets ({', '.join(_mib(b) for b in choice.free_buckets)}, backward order) would "
            f"expose {choice.free_exposed_s * 1e3:.2f} ms; pstrain uses one size (transport.bucket_bytes)"
        )
    return "\n".join(lines)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.3g} MiB"
