"""Swap or recompute per layer, and the largest per-device minibatch (SPEC S1.4-S1.5, S3.2-S3.4).

Memory model of one training step at per-device batch B (bytes on the device):

    resident   parameters + gradients (the optimizer state lives on the PS, not the device)
    kept       saved tensors of "keep" layers, all alive from their forward to their backward,
               and what the profile found outside every layer (no policy can move it)
    held       the inputs of "recompute" layers, which ``torch.utils.checkpoint`` keeps from the
               forward to the backward, unless a kept layer saves that input anyway
    swapped    of "swap" layers, the one in flight plus the prefetch window (largest ones)
    recompute  one "recompute" layer's saved tensors at a time, rebuilt during backward
    temporary  gradient buffers in flight in backward: about twice the largest layer output
    peak = (resident + kept + held + swapped + recompute + temporary) / (1 - margin)

So recomputing a layer frees its saved bytes less its input: nothing for a Linear or a ReLU,
which save exactly their input or output, much for a block (a transformer block keeps one
input and rebuilds everything its forward saved).

Whole-layer offload (S1.4 in full, ``offload_params``): parameters and gradients leave the
device too, so "resident" becomes the layers in flight: the running layer's parameters plus the
prefetch window's (the largest ones), and one layer's gradient on its way to the host.

Host memory (the whole host: D devices and the worker's own buffers):

    swapped activations   per device: the saved tensors of "swap" layers, all alive between
                          forward and backward
    staging               per device, without offload: the pinned buffer its gradient lands in
    worker                once per host: the host-sum buffer and the pulled parameters
    host = D * (swapped + staging) + 2P      (P: parameter bytes)

With whole-layer offload the replicas have no host buffers of their own: they all read the
worker's one parameter copy and sum their gradients straight into its host-sum buffer
(``worker.param_offload.HostGradSum``), so offload costs no host memory beyond the worker's 2P.

Pinned host memory is capped (``pinned_limit_bytes`` per device); bytes past the cap are copied
at ``PAGEABLE_FRACTION`` of the bandwidth, which raises the swap cost the greedy weighs.

Costs (S3.3): swapping a layer costs its saved bytes / PCIe bandwidth; recomputing it costs
its forward time; swaps are free while their summed cost stays under the step's forward +
backward time, because the copies run on a side stream behind compute.

Greedy (S3.4): if everything fits kept, keep everything. Otherwise sort layers by
swap cost / recompute cost, ascending (the layers that are relatively cheapest to swap
first), ties broken by more bytes first (more memory freed per decision), and mark them
"swap" while the summed swap cost stays under the overlap budget. If memory still does not
fit, mark the remaining kept layers "recompute", most bytes freed (saved bytes less the input
it then holds) per second of recompute first, and only layers that free anything, until it
fits. If even that does not fit, the batch is too large (``fits`` is False).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pstrain.planner.profiler import LayerInput, LayerProfile, ModelProfile


class Policy(str, enum.Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


PAGEABLE_FRACTION = 0.5
"""Pageable host memory copies at about half the pinned rate (a staging copy through a pinned bounce buffer)."""


@dataclass(frozen=True)
class MemoryBudget:
    device_bytes: int
    bandwidth_bytes_per_s: float  # device <-> host
    margin: float = 0.1  # fraction of device memory left free (fragmentation, CUDA context, workspace)
    prefetch: int = 2
    host_bytes: int | None = None  # host memory the offload may use, for the whole host (None: unlimited)
    devices_per_host: int = 1
    pinned_limit_bytes: int = 1 << 62  # per device; past it, pageable memory at PAGEABLE_FRACTION of the rate
    offload_params: bool = False  # whole-layer offload: parameters and gradients live on the host

    def __post_init__(self) -> None:
        if self.device_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or not 0 <= self.margin < 1:
            raise ValueError(f"impossible memory budget {self}")
        if self.devices_per_host < 1 or (self.host_bytes is not None and self.host_bytes <= 0):
            raise ValueError(f"impossible memory budget {self}")

    def copy_s(self, nbytes: float, total_bytes: float) -> float:
        """Seconds to copy ``nbytes`` of ``total_bytes`` swapped in all: the share over the pinned cap is slower."""
        pageable = max(0.0, total_bytes - self.pinned_limit_bytes) / max(total_bytes, 1.0)
        rate = self.bandwidth_bytes_per_s
        return nbytes * (1 - pageable) / rate + nbytes * pageable / (rate * PAGEABLE_FRACTION)


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
    host_bytes: float = 0.0  # the whole host's offload memory at this batch (all its devices + the worker)

    @property
    def fits_device(self) -> bool:
        return self.peak_bytes <= self.budget.device_bytes

    @property
    def fits_host(self) -> bool:
        return self.budget.host_bytes is None or self.host_bytes <= self.budget.host_bytes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

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
    # Parameters of modules that are not layers stay on the device, whole-layer offload or not.
    resident = 2 * profile.unprofiled_param_bytes
    if budget.offload_params:
        layer_params = sorted((layer.param_bytes for layer in profile.layers), reverse=True)
        resident += sum(layer_params[: budget.prefetch + 1]) + max(layer_params, default=0)
    else:
        resident += 2 * profile.param_bytes
    kept = sum(by_policy[Policy.KEEP]) + profile.unprofiled_saved(batch)
    held = held_inputs(profile, batch, policies)
    swapped = sum(sorted(by_policy[Policy.SWAP], reverse=True)[: budget.prefetch + 1])
    recompute = max(by_policy[Policy.RECOMPUTE], default=0.0)
    temporary = 2 * max((layer.output_bytes_per_sample * batch for layer in profile.layers), default=0.0)
    return (resident + kept + held + swapped + recompute + temporary) / (1 - budget.margin)


def held_inputs(profile: ModelProfile, batch: int, policies: dict[str, Policy]) -> float:
    """Inputs left on the device that no kept layer's saved bytes count (see ``_holds``), each storage once: a
    tensor two layers take (a fan-out, a view such as a Flatten's) is one tensor on the device."""
    held: dict[tuple[str, int], float] = {}
    for layer in profile.layers:
        for index, each in enumerate(layer.inputs):
            if _holds(layer, each, policies):
                held[("", each.storage) if each.storage >= 0 else (layer.name, index)] = each.nbytes(batch)
    return sum(held.values())


def _input_held(layer: LayerProfile, batch: int, policies: dict[str, Policy]) -> float:
    """What ``layer``'s inputs add to the device beyond the kept layers' saved bytes, as if no other layer held
    them (the greedy's estimate; ``held_inputs`` counts a storage two layers hold once)."""
    return sum(each.nbytes(batch) for each in layer.inputs if _holds(layer, each, policies))


def _holds(layer: LayerProfile, each: LayerInput, policies: dict[str, Policy]) -> bool:
    """Whether ``layer`` holds its input ``each`` on the device where no kept layer's saved bytes count it.

    A recompute layer's checkpoint holds each of its inputs, unless the kept layer that saved that input first (a
    ReLU saving its output, the next Linear's input) holds it anyway. And a kept layer that saves an input after
    another layer did (the Linear: the profile counts the bytes once, for the ReLU) holds it when that layer
    recomputes, so recomputing the ReLU frees nothing. A swap layer's copy is on the host: a kept layer that saves
    the same tensor shares the host copy (``worker.offload``), but a checkpoint holds the device tensor.
    """
    mine = policies.get(layer.name, Policy.KEEP)
    first = policies.get(each.saved_by, Policy.KEEP) if each.saved_by else None
    by_checkpoint = mine == Policy.RECOMPUTE and first != Policy.KEEP
    by_a_kept_saver = mine == Policy.KEEP and each.saved_here and first == Policy.RECOMPUTE
    return by_checkpoint or by_a_kept_saver


def _relying(profile: ModelProfile) -> dict[str, tuple[LayerProfile, ...]]:
    """For each layer, the layers with an input it saved first: whose held inputs change with its policy."""
    relying: dict[str, list[LayerProfile]] = {}
    for layer in profile.layers:
        for name in {each.saved_by for each in layer.inputs if each.saved_by}:
            relying.setdefault(name, []).append(layer)
    return {name: tuple(layers) for name, layers in relying.items()}


def saved_on_device(profile: ModelProfile, batch: int, policies: dict[str, Policy]) -> float:
    """The saved bytes of the kept layers and the inputs held beyond them: what recompute decisions change."""
    kept = sum(la.saved_bytes(batch) for la in profile.layers if policies.get(la.name, Policy.KEEP) == Policy.KEEP)
    return kept + held_inputs(profile, batch, policies)


def host_bytes(profile: ModelProfile, batch: int, policies: dict[str, Policy], budget: MemoryBudget) -> float:
    """The whole host's memory for offload at ``batch``: see the module docstring."""
    swapped = sum(la.saved_bytes(batch) for la in profile.layers if policies.get(la.name) == Policy.SWAP)
    staging = 0 if budget.offload_params else profile.total_param_bytes  # offload: the host's buffers are shared
    return (swapped + staging) * budget.devices_per_host + 2 * profile.total_param_bytes


def plan_for_batch(
    profile: ModelProfile, batch: int, budget: MemoryBudget, allow_swap: bool = True, swap_all: bool = False
) -> MemoryPlan:
    """The plan at ``batch``: the greedy (``allow_swap``), everything kept, or (``swap_all``, ``memory.policy:
    swap``) every layer that saves anything swapped, whether or not it needs to be."""
    scale = _scale(profile, batch)
    overlap = profile.step_s() * scale
    all_saved = sum(layer.saved_bytes(batch) for layer in profile.layers)
    swap_s = {layer.name: budget.copy_s(layer.saved_bytes(batch), all_saved) for layer in profile.layers}
    recompute_s = {layer.name: layer.forward_s * scale for layer in profile.layers}
    policies = {layer.name: Policy.KEEP for layer in profile.layers}

    def fits() -> bool:
        return peak_bytes(profile, batch, policies, budget) <= budget.device_bytes

    if swap_all:
        policies.update({la.name: Policy.SWAP for la in profile.layers if la.saved_bytes(batch) > 0})
    elif allow_swap and not fits():
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

        relying = _relying(profile)

        def freed(layer: LayerProfile) -> float:
            """What recomputing ``layer`` (kept) frees, the other layers' policies as they stand: its saved bytes,
            less the inputs its checkpoint and the layers relying on it then hold (only those change: O(degree))."""
            touched = (layer, *relying.get(layer.name, ()))
            before = sum(_input_held(la, batch, policies) for la in touched)
            policies[layer.name] = Policy.RECOMPUTE
            after = sum(_input_held(la, batch, policies) for la in touched)
            policies[layer.name] = Policy.KEEP
            return layer.saved_bytes(batch) - (after - before)

        kept = [la for la in candidates if policies[la.name] == Policy.KEEP]
        for layer in sorted(kept, key=lambda la: -freed(la) / max(recompute_s[la.name], 1e-9)):
            if fits():
                break
            if freed(layer) > 0:  # a Linear or a ReLU alone frees nothing: its input stays
                policies[layer.name] = Policy.RECOMPUTE
    decisions = tuple(
        LayerDecision(la.name, policies[la.name], la.saved_bytes(batch), swap_s[la.name], recompute_s[la.name])
        for la in profile.layers
    )
    return MemoryPlan(
        batch,
        decisions,
        peak_bytes(profile, batch, policies, budget),
        budget,
        overlap,
        host_bytes(profile, batch, policies, budget),
    )


def max_batch(
    profile: ModelProfile, budget: MemoryBudget, allow_swap: bool, upper: int = 1 << 40, swap_all: bool = False
) -> int:
    """The largest batch whose plan fits the device and the host (0 if not even one sample fits)."""
    return _largest(lambda b: plan_for_batch(profile, b, budget, allow_swap, swap_all).fits, upper)


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= upper and fits(high):
        low, high = high, high * 2
    high = min(high, upper + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True)
class BatchLimits:
    """The largest batch by each limit alone, and which one binds (the smaller)."""

    device: int  # fits the device, host unlimited
    host: int  # fits the host, device unlimited (at the device-fitting plan's policies)
    both: int

    @property
    def binding(self) -> str:
        if self.both >= self.device and self.both >= self.host:
            return "neither"
        return "host" if self.host < self.device else "device"


def batch_limits(
    profile: ModelProfile, budget: MemoryBudget, allow_swap: bool, upper: int = 1 << 40, swap_all: bool = False
) -> BatchLimits:
    """Each limit of the plan the workers will run: the greedy's, or with ``swap_all`` the all-swap plan's."""
    device_only = replace(budget, host_bytes=None)
    device = max_batch(profile, device_only, allow_swap, upper, swap_all)
    host = _largest(lambda b: plan_for_batch(profile, b, budget, allow_swap, swap_all).fits_host, upper)
    return BatchLimits(device, host, max_batch(profile, budget, allow_swap, upper, swap_all))


def largest_model(profile: ModelProfile, budget: MemoryBudget, allow_swap: bool, batch: int = 1) -> float:
    """The parameter bytes of the largest model of this shape (every layer's parameters scaled alike) that
    still plans at ``batch``: how far each policy stretches the device (and the host)."""
    if profile.total_param_bytes == 0:
        return 0.0

    def fits(k: int) -> bool:
        layers = tuple(replace(la, param_bytes=la.param_bytes * k // 64) for la in profile.layers)
        scaled = replace(profile, layers=layers, unprofiled_param_bytes=profile.unprofiled_param_bytes * k // 64)
        return plan_for_batch(scaled, batch, budget, allow_swap).fits

    return _largest(fits, 1 << 40) / 64 * profile.total_param_bytes


def s15_max_batch(profile: ModelProfile, device_bytes: int) -> int:
    """S1.5 as written: GPU memory / the per-sample data size of the layer that needs the most."""
    largest = profile.largest_layer().saved_bytes_per_sample
    return math.floor(device_bytes / largest) if largest > 0 else 0
