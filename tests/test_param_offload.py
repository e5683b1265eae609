"""Whole-layer offload (S1.4, ``memory.offload_params``): bitwise the same training, one layer on the device."""

import threading
import weakref

import pytest
import torch
from torch import nn

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.runtime.layout import ParamLayout
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.param_offload import offload_layers
from pstrain.worker.replicas import MemoryPolicy, Replica, ReplicaSet
from pstrain.worker.trainer import Trainer
from tests.test_overlap import SMALL_BUCKETS, build_shards
from tests.test_trainer import (
    DATA,
    DEVICES,
    LAYOUT,
    NO_WAIT,
    PER_DEVICE,
    STEPS,
    ListSource,
    Reporter,
    final_parameters,
    seeded_model,
    start,
    worker_samples,
)

CE = nn.functional.cross_entropy


def model(seed=0, width=32, depth=4):
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.LayerNorm(width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 5))


def batches(steps, n=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 16, generator=gen), torch.randint(0, 5, (n,), generator=gen)) for _ in range(steps)]


def train(replica: Replica, steps: int, lr: float = 0.1) -> list[torch.Tensor]:
    """SGD on the replica's flat buffers, as the worker and PS do; returns every step's gradient."""
    grads = []
    for x, y in batches(steps):
        replica.forward_backward(x, y, CE)
        if replica.device.type == "cuda":  # the device->host copy into staging is asynchronous (ReplicaSet waits)
            torch.cuda.synchronize(replica.device)
        grads.append(replica.staging.detach().clone())
        with torch.no_grad():
            replica.flat_params.sub_(lr * replica.staging.to(replica.flat_params.device))
    return grads


@pytest.mark.parametrize("policies", [{}, {"3": "swap", "5": "recompute"}])
def test_training_with_offload_is_bitwise_identical_on_cpu(policies):
    layout = ParamLayout.of(model())
    plain = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy(dict(policies)))
    offloaded = Replica.build(
        model(), torch.device("cpu"), layout, False, MemoryPolicy(dict(policies), 1, 4 << 30, True)
    )
    ours, theirs = train(offloaded, 4), train(plain, 4)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(offloaded.flat_params, plain.flat_params)
    assert offloaded.staging is offloaded.flat_grads  # the gradient is written straight into the host buffer


def test_a_kept_layer_shares_what_a_swap_layer_sent_to_the_host():
    """The ReLU (swap) and the next Linear (kept, its parameters offloaded) save one tensor: it leaves the device."""
    layout = ParamLayout.of(model())
    replica = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy({"2": "swap"}, 1, 4 << 30, True))
    outputs = []
    replica.model[2].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    x, y = batches(1)[0]
    loss = replica.forward(x, y, CE)
    assert len(outputs) == 1 and outputs[0]() is None, "the swapped output stayed alive for the next layer"
    replica.backward(loss)
    reference = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    reference.forward_backward(x, y, CE)
    assert torch.equal(replica.staging, reference.staging)


@pytest.mark.parametrize("policies", [{"3": "swap"}, {"4": "swap", "5": "swap"}], ids=["linear", "tanh-and-linear"])
def test_a_swap_layer_with_offloaded_parameters_swaps_its_activations_and_not_its_weights(policies):
    """Layer 3 is a Linear: its input goes to the host; its weight, already a copy of the host buffer, does not."""
    layout = ParamLayout.of(model())
    replica = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy(policies, 1, 4 << 30, True))
    x, y = batches(1)[0]
    replica.forward_backward(x, y, CE)
    assert replica.offload is not None
    assert replica.offload.stats.swapped_out_bytes == replica.offload.stats.swapped_in_bytes == len(x) * 32 * 4
    reference = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    reference.forward_backward(x, y, CE)
    assert torch.equal(replica.staging, reference.staging)


def test_a_swap_block_with_offloaded_parameters_swaps_what_its_layers_save():
    """A block marked swap: its Linears' own hooks are innermost, and their inputs still go to the host."""

    def blocks():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 32), nn.Sequential(nn.Tanh(), nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 5)
        )

    layout = ParamLayout.of(blocks())
    replica = Replica.build(blocks(), torch.device("cpu"), layout, False, MemoryPolicy({"1": "swap"}, 1, 4 << 30, True))
    x, y = batches(1)[0]
    replica.forward_backward(x, y, CE)
    assert replica.offload is not None  # the block's Tanh, Linear (the same tensor) and Tanh save two tensors
    assert replica.offload.stats.swapped_out_bytes == replica.offload.stats.swapped_in_bytes == 2 * len(x) * 32 * 4
    reference = Replica.build(blocks(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    reference.forward_backward(x, y, CE)
    assert torch.equal(replica.staging, reference.staging)


def test_a_copy_that_fails_before_forward_leaves_no_stale_parameters_on_the_device():
    layout = ParamLayout.of(model())
    replica = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    params = replica.param_offload
    assert params is not None
    calls = []

    def fail_second(positions):
        calls.append(positions)
        if len(calls) == 2:  # layer 0's own copy went; the prefetch of the next one fails
            raise RuntimeError("copy failed")

    params.before_fetch = fail_second
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="copy failed"):
        replica.forward(x, y, CE)
    params.before_fetch = None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    host = replica.flat_params.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == host for p in replica.model.parameters())
    with torch.no_grad():
        replica.flat_params.add_(0.5)  # the next pull: a copy left on the device would be stale
    replica.forward_backward(x, y, CE)
    reference = Replica.build(model(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    with torch.no_grad():
        reference.flat_params.add_(0.5)
    reference.forward_backward(x, y, CE)
    assert torch.equal(replica.staging, reference.staging)


def test_a_sparse_saved_tensor_passes_whole_layer_offload():
    class Propagate(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.adjacency = torch.eye(8).to_sparse()
            self.weight = nn.Parameter(torch.randn(16, 5))  # its own: the layer's hooks see the sparse tensor

        def forward(self, x):
            return torch.sparse.mm(self.adjacency, x @ self.weight)

    layout = ParamLayout.of(Propagate())
    for policies in ({}, {"": "swap"}):
        replica = Replica.build(
            Propagate(), torch.device("cpu"), layout, False, MemoryPolicy(policies, 1, 4 << 30, True)
        )
        x, y = batches(1)[0]
        replica.forward_backward(x, y, CE)
        reference = Replica.build(Propagate(), torch.device("cpu"), layout, False, MemoryPolicy({}))
        reference.forward_backward(x, y, CE)
        assert torch.equal(replica.staging, reference.staging), policies


def test_only_the_running_layer_points_away_from_the_host_buffer():
    m = model()
    layout = ParamLayout.of(m)
    flat_params, flat_grads, offload = offload_layers(m, torch.device("cpu"), layout, False, prefetch=1)
    host = flat_params.untyped_storage().data_ptr()
    away: list[int] = []

    def count(module, args):
        away.append(sum(p.untyped_storage().data_ptr() != host for p in m.parameters()))

    for layer in m:
        if list(layer.parameters()):
            layer.register_forward_pre_hook(count)  # after offload's own pre-hook
    x, y = batches(1)[0]
    CE(m(x), y).backward()
    n_params = {len(list(layer.parameters(recurse=False))) for layer in m if list(layer.parameters())}
    assert away and all(a in n_params for a in away)  # exactly that layer's weight and bias
    assert all(p.untyped_storage().data_ptr() == host and p.grad is None for p in m.parameters())
    assert flat_grads.abs().sum() > 0 and offload.stats.prefetched > 0
    assert offload.stats.grad_bytes == layout.total * 4
    assert offload.stats.fetched_bytes == 2 * layout.total * 4  # once for forward, once for backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_matches_and_holds_about_one_layer():
    device = torch.device("cuda", 0)
    layout = ParamLayout.of(model(width=1024, depth=8))
    plain = Replica.build(model(width=1024, depth=8), device, layout, True, None)
    # cuBLAS takes its workspaces (tens of MiB on an H100) from torch's allocator at the first matrix product of
    # each thread, here and in autograd's thread: take them before the baseline, not inside the measured peak.
    warm = torch.ones(8, 16, device=device, requires_grad=True)
    (warm @ torch.ones(16, 16, device=device)).sum().backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    offloaded = Replica.build(model(width=1024, depth=8), device, layout, True, MemoryPolicy({}, 1, 4 << 30, True))
    torch.cuda.reset_peak_memory_stats(device)
    ours = train(offloaded, 3)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    theirs = train(plain, 3)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0)
    assert peak < layout.total * 4  # less than the parameters alone, let alone parameters + gradients


# ---------------------------------------------------------------- one host copy for all of a host's replicas


def test_replicas_of_a_host_share_one_host_copy_and_sum_bitwise_in_device_order():
    layout = ParamLayout.of(model())
    devices = [torch.device("cpu")] * 3
    plain = ReplicaSet(lambda: model(), devices, layout)
    shared = ReplicaSet(lambda: model(), devices, layout, MemoryPolicy({"3": "swap"}, 1, 4 << 30, True))
    for r in shared.replicas:  # the parameters and gradients of every replica are the host's buffers
        assert r.flat_params.data_ptr() == shared.host_params.data_ptr()
        assert r.flat_grads.data_ptr() == shared.host_grads.data_ptr()
    assert len(shared.staging) == 1 and len(plain.staging) == 3
    plain.host_params.copy_(layout.flatten(model()))  # what the first pull brings (the buffer starts uninitialised)
    try:
        for step, (x, y) in enumerate(batches(4, n=12)):
            a = shared.forward_backward(list(x.chunk(3)), list(y.chunk(3)), CE)
            b = plain.forward_backward(list(x.chunk(3)), list(y.chunk(3)), CE)
            assert a == b
            assert torch.equal(shared.sum_gradients(), plain.sum_gradients()), f"step {step}"
            new = plain.host_params - 0.1 * plain.host_grads  # what a pull brings
            plain.host_params.copy_(new)
            plain.load_parameters()
            shared.host_params.copy_(new)  # the pull writes the one copy ...
            shared.load_parameters()  # ... and loading is nothing more
        for r in plain.replicas:
            assert torch.equal(r.flat_params, shared.host_params)
    finally:
        plain.close()
        shared.close()


def test_a_parameter_unused_in_a_step_gets_a_zero_in_the_sum_and_does_not_stall_the_next():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = nn.Linear(16, 5), nn.Linear(16, 5)

        def forward(self, x):
            return self.used(x)

    layout = ParamLayout.of(Skips())
    shared = ReplicaSet(Skips, [torch.device("cpu")] * 2, layout, MemoryPolicy({}, 1, 4 << 30, True))
    try:
        shared.host_grads.fill_(7.0)
        for x, y in batches(3):
            shared.forward_backward(list(x.chunk(2)), list(y.chunk(2)), CE)
            grads = shared.sum_gradients()
            unused = layout.views(grads)[2:]
            assert all(torch.count_nonzero(g) == 0 for g in unused)
            assert all(torch.count_nonzero(g) > 0 for g in layout.views(grads)[:2])
    finally:
        shared.close()


class Gated(nn.Module):
    """A layer whose second parameter its forward does not use (its backward runs, that parameter gets no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.extra = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Detached(nn.Module):
    """``a``'s output reaches the loss only through a ``detach``: backward prefetches ``a`` and never runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).detach()))


@pytest.mark.parametrize("case", ["a parameter without a gradient", "a layer backward never reaches"])
def test_each_forward_computes_on_the_parameters_the_host_buffer_holds_then(case):
    """A layer's device copy never outlives its step: the next forward fetches what the pull wrote, as a replica
    without offload reads it, even for a layer whose backward left a parameter without a gradient, or one that
    backward prefetched and never reached."""

    def build():
        torch.manual_seed(0)
        if case == "a parameter without a gradient":
            return nn.Sequential(nn.Linear(16, 16), Gated(), nn.Linear(16, 5))
        return Detached()

    watched = "1.weight" if case == "a parameter without a gradient" else "a.weight"
    layout = ParamLayout.of(build())
    start = layout.offsets[layout.names.index(watched)]
    numel = int(torch.Size(layout.shapes[layout.names.index(watched)]).numel())
    for offload in (False, True):
        replica = Replica.build(build(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, offload))
        owner = replica.model.get_submodule(watched.rpartition(".")[0])
        seen: list[float] = []

        def record(module: nn.Module, args: object, seen: list[float] = seen) -> None:
            seen.append(float(module.weight.detach().flatten()[0]))

        owner.register_forward_pre_hook(record)
        for step, (x, y) in enumerate(batches(3)):
            with torch.no_grad():
                replica.flat_params[start : start + numel].fill_(float(step + 1))  # what a pull of a version writes
            replica.forward_backward(x, y, CE)
        assert seen == [1.0, 2.0, 3.0], f"offload={offload}"
        if offload:
            host = replica.flat_params.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == host for p in replica.model.parameters())


class Skippable(nn.Module):
    """``b`` runs only when ``use_b`` is set: a forward that skips it leaves the copy ``a`` prefetched for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return self.c(self.b(x) if self.use_b else x)


def test_a_copy_prefetched_in_a_step_without_backward_is_not_used_in_the_next():
    """A step whose loss is not finite ends after forward (no backward, so no ``finish_step``): a layer forward
    prefetched but did not run must not keep its copy, or the next forward that runs it computes on old values."""
    torch.manual_seed(0)
    layout = ParamLayout.of(Skippable())
    torch.manual_seed(0)
    replica = Replica.build(Skippable(), torch.device("cpu"), layout, False, MemoryPolicy({}, 1, 4 << 30, True))
    start = layout.offsets[layout.names.index("b.weight")]
    seen: list[float] = []
    replica.model.b.register_forward_pre_hook(lambda module, args: seen.append(float(module.weight.detach()[0, 0])))
    x, y = batches(1)[0]
    replica.forward(x, y, CE)  # ``a`` prefetches ``b``, which does not run; the step is dropped here
    with torch.no_grad():
        replica.flat_params[start : start + 256].fill_(2.0)  # the next version's ``b``, as a pull writes it
    replica.model.use_b = True
    replica.forward_backward(x, y, CE)
    assert seen == [2.0]


def test_offloaded_workers_train_bitwise_like_plain_ones_through_per_bucket_pushes():
    results = []
    for offload in (False, True):
        shards = build_shards(workers=2)
        trainers = [_trainer(w, shards, offload, SMALL_BUCKETS) for w in (0, 1)]
        runs = [start(t) for t in trainers]
        try:
            for thread, _ in runs:
                thread.join(120)
                assert not thread.is_alive(), "a trainer hung"
            assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
        finally:
            for t in trainers:
                t.ps.close(cancel=True)
                t.replicas.close()
        results.append(final_parameters(shards))
        if offload:
            assert trainers[0].replicas.shared and len(trainers[0].replicas) == DEVICES
    assert torch.equal(results[0], results[1])


def _trainer(worker_id, shards, offload, bucket_bytes):
    job = pb.JobSpec(steps=STEPS, per_device_batch=PER_DEVICE, total_params=LAYOUT.total, bucket_bytes=bucket_bytes)
    memory = MemoryPolicy({}, 1, 4 << 30, True) if offload else None
    replicas = ReplicaSet(seeded_model, [torch.device("cpu")] * DEVICES, LAYOUT, memory)
    feed = DataFeed(DATA, ListSource(worker_id, worker_samples(worker_id)))
    ps = LocalPsClient(shards, pull_timeout_s=60)
    return Trainer(worker_id, job, replicas, ps, feed, CE, Reporter(), threading.Event(), NO_WAIT)
