"""Activation swap-out (``worker.offload``): what the saved-tensor hooks hold, and for how long.

A CPU stand-in runs the very code a GPU does (host-to-host copies), so the lifetimes and layouts checked here are
the ones a GPU run has; the subclass below only records what the real ``SwapToHost`` hands out.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pstrain.runtime.layout import ParamLayout
from pstrain.worker.offload import SwapToHost, apply_layer_policies
from pstrain.worker.probe import run_probe
from pstrain.worker.replicas import MemoryPolicy, ReplicaSet

MiB = 1 << 20


class Recording(SwapToHost):
    """The real hooks, with weak references to each host copy and each tensor brought back for backward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.hosts: list[weakref.ref[torch.Tensor]] = []
        self.brought: list[weakref.ref[torch.Tensor]] = []

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        host = super()._host_buffer(tensor)
        self.hosts.append(weakref.ref(host))
        return host

    def _bring_back(self, entry: Any, prefetch: bool = False) -> torch.Tensor:
        tensor = super()._bring_back(entry, prefetch)
        self.brought.append(weakref.ref(tensor))
        return tensor


class Transposed(nn.Module):
    """Saves non-contiguous tensors (a transposed output, a strided slice), a scalar, and one tensor twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).T
        return (y.sin() * y[:, ::2].sum()).sum() + torch.matmul(y, y.T).sum()


def pair(
    factory: Callable[[], nn.Module], policies: dict[str, str], offload: SwapToHost
) -> tuple[nn.Module, nn.Module]:
    """A plain model and the same one (same weights) under ``policies``."""
    torch.manual_seed(0)
    plain = factory()
    swapped = factory()
    swapped.load_state_dict(plain.state_dict())
    apply_layer_policies(swapped, policies, offload.ignore_parameters(swapped))
    offload.reset()
    return plain, swapped


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"{name}: {(p.grad - q.grad).abs().max().item()}"


def test_a_non_contiguous_saved_tensor_gives_bitwise_the_plain_gradient():
    """The host copy keeps the original's strides: a contiguous copy sent matmul down another kernel (off by 1e-7)."""
    plain, swapped = pair(lambda: nn.Sequential(Transposed()), {"0": "swap"}, SwapToHost())
    x = torch.randn(8, 8)
    plain(x).backward()
    swapped(x).backward()
    assert_same_grads(plain, swapped)


def test_a_tensor_backward_is_done_with_is_not_brought_back_again():
    """Backward's order is not strictly the save order: a tensor already consumed was prefetched a second time,
    and that device copy stayed until the next step."""
    offload = SwapToHost(prefetch=2)
    plain, swapped = pair(lambda: nn.Sequential(Transposed()), {"0": "swap"}, offload)
    x = torch.randn(8, 8)
    plain(x).backward()
    swapped(x).backward()
    assert offload.stats.swapped_in_bytes == offload.stats.swapped_out_bytes, "a tensor came back twice"
    assert_same_grads(plain, swapped)


def test_host_copies_are_freed_with_the_graph_not_at_the_next_forward():
    offload = Recording(prefetch=2)
    plain, swapped = pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), {"1": "swap"}, offload)
    x = torch.randn(32, 8)
    loss = swapped(x).sum()
    assert offload.hosts and all(ref() is not None for ref in offload.hosts)
    loss.backward()
    assert all(ref() is None for ref in offload.hosts), "a host copy outlived the backward that consumed it"
    plain(x).sum().backward()
    assert_same_grads(plain, swapped)


def test_a_retained_graph_backs_up_twice_and_lets_each_device_copy_go():
    offload = Recording(prefetch=2)
    plain, swapped = pair(lambda: nn.Sequential(Transposed(), nn.Tanh()), {"0": "swap"}, offload)
    x = torch.randn(8, 8)
    ref, ours = plain(x).sum(), swapped(x).sum()
    for _ in range(2):
        ref.backward(retain_graph=True)
        ours.backward(retain_graph=True)
        assert_same_grads(plain, swapped)
        assert all(t() is None for t in offload.brought), "a tensor brought back stayed after backward"
        assert all(h() is not None for h in offload.hosts), "the retained graph lost a host copy"
    ref.backward()
    ours.backward()
    assert_same_grads(plain, swapped)
    assert all(h() is None for h in offload.hosts)
    assert offload.stats.swapped_in_bytes == 3 * offload.stats.swapped_out_bytes


def test_a_graph_kept_past_the_next_reset_backs_up_from_its_own_tensors():
    """Two forwards before their backwards (the first's graph kept): the first's backward read the second's copies."""
    offload = SwapToHost(prefetch=2)
    factory = lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))  # noqa: E731
    plain, swapped = pair(factory, {"1": "swap", "3": "swap"}, offload)
    first, second = torch.ones(4, 8), torch.full((4, 8), -3.0)
    ref_first, ours_first = plain(first).sum(), swapped(first).sum()
    ref_second = plain(second).sum()
    offload.reset()  # what the replica does before each forward
    ours_second = swapped(second).sum()
    ref_first.backward()
    ours_first.backward()
    assert_same_grads(plain, swapped)
    ref_second.backward()
    ours_second.backward()
    assert_same_grads(plain, swapped)


def _swap_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 4))


def test_a_probe_of_a_swapped_model_after_another_reports_its_own_peak():
    """The previous iteration's host copies lived until the next forward's reset: on a CPU stand-in the next
    probe's RSS started that much higher and its device figure came out low by the swapped bytes."""
    memory = MemoryPolicy({str(i): "swap" for i in range(3)})
    replicas = ReplicaSet(_swap_model, [torch.device("cpu")], ParamLayout.of(_swap_model()), memory)
    try:
        x, y = torch.randn(1 << 15, 64), torch.randint(0, 4, (1 << 15,))  # each activation over 32 MiB
        offload = replicas.replicas[0].offload
        assert offload is not None
        first, _ = run_probe(replicas, x, y, nn.functional.cross_entropy)
        swapped = offload.stats.swapped_out_bytes
        second, _ = run_probe(replicas, x, y, nn.functional.cross_entropy)
    finally:
        replicas.close()
    assert swapped > 64 * MiB
    assert second > first - swapped // 2, f"{second >> 20} MiB after {first >> 20} MiB ({swapped >> 20} MiB swapped)"


class MaskAndGather(nn.Module):
    """Saves expanded tensors: a mask broadcast over the features and a gather index expanded over them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.arange(x.shape[1]) % 2 == 0).view(1, -1, 1).expand_as(x)
        index = torch.arange(4).view(1, 4, 1).expand(x.shape[0], 4, x.shape[2])
        return torch.gather(torch.where(keep, self.lin(x), 0.0), 1, index).sum()


def test_an_expanded_saved_tensor_is_copied_as_the_few_elements_it_repeats():
    """A (1, 32, 1) mask expanded to (64, 32, 16) was copied as 32768 booleans each way (the device got those back
    for backward, where plain autograd holds 32), and a gather index as 4096 int64s."""
    offload = Recording(prefetch=2)
    plain, swapped = pair(lambda: nn.Sequential(MaskAndGather()), {"0": "swap"}, offload)
    x = torch.randn(64, 32, 16)
    loss = swapped(x)
    small = [h() for h in offload.hosts if h() is not None and h().dtype in (torch.bool, torch.int64)]
    assert sorted(h.numel() for h in small) == [4, 32], [tuple(h.shape) for h in small]
    activations = 2 * x.numel() * x.element_size()  # the Linear's input and the masked output gather reads
    assert offload.stats.swapped_out_bytes == activations + 32 + 4 * 8
    loss.backward()
    plain(x).backward()
    assert_same_grads(plain, swapped)
