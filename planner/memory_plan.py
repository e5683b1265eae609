"""Swap or recompute per layer, and the largest per-device minibatch (SPEC S1.4-S1.5, S3.2-S3.4).

Memory model of one training step at per-device batch B (bytes on the device):

    resident   parameters + gradients (the optimizer state lives on the PS, not the device)
    kept       saved tensors of "keep" layers, all alive from their forward to their backward
    swapped    of "swap" layers, the one in flight plus the prefetch window (largest ones)
    recompute  one "recompute" layer's saved tensors at a time, rebuilt during backward
    temporary  gradient buffers in flight in backward: about twice the largest layer output
    peak = (resident + kept + swapped + recompute + temporary) / (1 - margin)

Costs (S3.3): swapping a layer costs its saved bytes / PCIe bandwidth; recomputing it costs
its forward time; swaps are free while their summed cost stays under the step's forward +
backward time, because the copies run on a side stream behind compute.

Greedy (S3.4): if everything fits kept, keep everything. Otherwise sort layers by
swap cost / recompute cost, ascending (the layers that are relatively cheapest to swap
first), ties broken by more bytes first (more memory freed per decision), and mark them
"swap" while the summed swap cost stays under the overlap budget. If memory still does not
fit, mark the remaining kept layers "recompute", most bytes freed per second of recompute
first, until it fits. If even that does not fit, the batch is too large (``fits`` is False).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pstrain.planner.profiler import LayerProfile, ModelProfile


class Policy(str, enum.Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class MemoryBudget:
    device_bytes: int
    bandwidth_bytes_per_s: float  # device <-> host
    margin: float = 0.1  # fraction of device memory left free (fragmentation, CUDA context, workspace)
    prefetch: int = 2

    def __post_init__(self) -> None:
        if self.device_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or not 0 <= self.margin < 1:
            raise ValueError(f"impossible memory budget {self}")


@dataclass(frozen=True)
class LayerDecision:
    name: str
    policy: Policy
    saved_bytes: float  # at the plan's batch
    swap_s: float
    recompute_s: float


@dataclass(frozen=True)
class MemoryPlan:
    batch: int
    decisions: tuple[LayerDecision, ...]
    peak_bytes: float
    budget: MemoryBudget
    overlap_budget_s: float

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget.device_bytes

    @property
    def swap_s(self) -> float:
        return sum(d.swap_s for d in self.decisions if d.policy == Policy.SWAP)

    @property
    def recompute_s(self) -> float:
        return sum(d.recompute_s for d in self.decisions if d.policy == Policy.RECOMPUTE)

    def policies(self) -> dict[str, str]:
        return {d.name: d.policy.value for d in self.decisions if d.policy != Policy.KEEP}


def _scale(profile: ModelProfile, batch: int) -> float:
    return batch / profile.batch


def peak_bytes(profile: ModelProfile, batch: int, policies: dict[str, Policy], budget: MemoryBudget) -> float:
    def saved(layer: LayerProfile) -> float:
        return layer.saved_bytes(batch)

    by_policy: dict[Policy, list[float]] = {p: [] for p in Policy}
    for layer in profile.layers:
        by_policy[policies.get(layer.name, Policy.KEEP)].append(saved(layer))
    resident = 2 * profile.param_bytes
    kept = sum(by_policy[Policy.KEEP])
    swapped = sum(sorted(by_policy[Policy.SWAP], reverse=True)[: budget.prefetch + 1])
    recompute = max(by_policy[Policy.RECOMPUTE], default=0.0)
    temporary = 2 * max((layer.output_bytes_per_sample * batch for layer in profile.layers), default=0.0)
    return (resident + kept + swapped + recompute + temporary) / (1 - budget.margin)


def plan_for_batch(profile: ModelProfile, batch: int, budget: MemoryBudget, allow_swap: bool = True) -> MemoryPlan:
    scale = _scale(profile, batch)
    overlap = profile.step_s() * scale
    swap_s = {layer.name: layer.saved_bytes(batch) / budget.bandwidth_bytes_per_s for layer in profile.layers}
    recompute_s = {layer.name: layer.forward_s * scale for layer in profile.layers}
    policies = {layer.name: Policy.KEEP for layer in profile.layers}

    def fits() -> bool:
        return peak_bytes(profile, batch, policies, budget) <= budget.device_bytes

    if allow_swap and not fits():
        candidates = [layer for layer in profile.layers if layer.saved_bytes(batch) > 0]
        ratio = {layer.name: swap_s[layer.name] / max(recompute_s[layer.name], 1e-9) for layer in candidates}
        spent = 0.0
        for layer in sorted(candidates, key=lambda la: (ratio[la.name], -la.saved_bytes(batch))):
            if spent + swap_s[layer.name] > overlap:
                continue
            policies[layer.name] = Policy.SWAP
            spent += swap_s[layer.name]
            if fits():
                break
        kept = [la for la in candidates if policies[la.name] == Policy.KEEP]
        for layer in sorted(kept, key=lambda la: -la.saved_bytes(batch) / max(recompute_s[la.name], 1e-9)):
            if fits():
                break
            policies[layer.name] = Policy.RECOMPUTE
    decisions = tuple(
        LayerDecision(la.name, policies[la.name], la.saved_bytes(batch), swap_s[la.name], recompute_s[la.name])
        for la in profile.layers
    )
    return MemoryPlan(batch, decisions, peak_bytes(profile, batch, policies, budget), budget, overlap)


def max_batch(profile: ModelProfile, budget: MemoryBudget, allow_swap: bool, upper: int = 1 << 40) -> int:
    """The largest batch whose plan fits (0 if not even one sample fits)."""
    if not plan_for_batch(profile, 1, budget, allow_swap).fits:
        return 0
    low, high = 1, 2
    while high <= upper and plan_for_batch(profile, high, budget, allow_swap).fits:
        low, high = high, high * 2
    high = min(high, upper + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if plan_for_batch(profile, mid, budget, allow_swap).fits:
            low = mid
        else:
            high = mid
    return low


def s15_max_batch(profile: ModelProfile, device_bytes: int) -> int:
    """S1.5 as written: GPU memory / the per-sample data size of the layer that needs the most."""
    largest = profile.largest_layer().saved_bytes_per_sample
    return math.floor(device_bytes / largest) if largest > 0 else 0
