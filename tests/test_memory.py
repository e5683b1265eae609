"""The memory planner: profile, swap-out/in, recompute, swap-or-recompute plan, largest batch."""

import logging
import math
import random
import weakref
from dataclasses import replace

import pytest
import torch
from torch import nn

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.plan import make_plan
from pstrain.coordinator.planning import describe, plan_job
from pstrain.planner.memory_estimate import EstimateMode, EstimatePolicy, IterativeEstimate, Probe
from pstrain.planner.memory_plan import (
    MemoryBudget,
    Policy,
    host_bytes,
    max_batch,
    peak_bytes,
    plan_for_batch,
    s15_max_batch,
    saved_on_device,
)
from pstrain.planner.profiler import LayerProfile, ModelProfile, forward_saved_bytes, profile_model
from pstrain.runtime.units import parse_bytes
from pstrain.worker.offload import SwapToHost, apply_layer_policies
from tests.helpers import classification_set

CE = nn.functional.cross_entropy


def mlp(d_in=32, hidden=48, classes=5, depth=2):
    torch.manual_seed(0)
    layers = [nn.Linear(d_in, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


def conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


def mlp_batch(n):
    return torch.randn(n, 32), torch.randint(0, 5, (n,))


def conv_batch(n):
    return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))


# ------------------------------------------------------------------ profiler


def test_mlp_profile_matches_closed_form():
    profile = profile_model(mlp(), mlp_batch, CE, batches=(3, 7))
    per_layer = {layer.name: layer.saved_bytes_per_sample for layer in profile.layers}
    # Linear saves its input; ReLU its output; the next Linear's input is that same storage (counted once)
    assert per_layer == {"0": 32 * 4, "1": 48 * 4, "2": 0, "3": 48 * 4, "4": 0}
    assert all(layer.saved_bytes_fixed == 0 for layer in profile.layers)
    assert [layer.param_bytes for layer in profile.layers] == [
        (32 * 48 + 48) * 4,
        0,
        (48 * 48 + 48) * 4,
        0,
        (48 * 5 + 5) * 4,
    ]
    assert [layer.output_bytes_per_sample for layer in profile.layers] == [192, 192, 192, 192, 20]
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)


def test_conv_profile_matches_closed_form():
    profile = profile_model(conv(), conv_batch, CE, batches=(2, 5))
    per_layer = {layer.name: layer.saved_bytes_per_sample for layer in profile.layers}
    assert per_layer == {
        "0": 3 * 16 * 16 * 4,  # conv input
        "1": 8 * 16 * 16 * 4,  # relu output
        "2": 8 * 8 * 8 * 8,  # max-pool indices (int64); its input is the relu output, already counted
        "3": 0,  # flatten is a view
        "4": 8 * 8 * 8 * 4,  # linear input: the pooled map
    }


def test_profile_per_sample_is_a_slope_independent_of_the_batches():
    a = profile_model(mlp(), mlp_batch, CE, batches=(2, 5))
    b = profile_model(mlp(), mlp_batch, CE, batches=(4, 16))
    assert [la.saved_bytes_per_sample for la in a.layers] == [lb.saved_bytes_per_sample for lb in b.layers]


def test_blocks_are_profiled_as_one_layer():
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 48), nn.ReLU()), nn.Linear(48, 5))
    profile = profile_model(model, mlp_batch, CE, blocks=["0"])
    assert [layer.name for layer in profile.layers] == ["0", "1"]
    assert profile.layers[0].saved_bytes_per_sample == (32 + 48) * 4
    with pytest.raises(ValueError, match="unknown block"):
        profile_model(model, mlp_batch, CE, blocks=["nope"])


class InlineAttention(nn.Module):
    """Computes in its own forward and owns a parameter of its own: neither is any leaf layer's."""

    def __init__(self, d: int = 16, seq: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.q, self.k, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)  # (B, seq, seq), saved outside
        return self.head((scores @ x).mean(1))


def attention_batch(n):
    return torch.randn(n, 12, 16), torch.randint(0, 5, (n,))


def test_the_profile_names_what_no_layer_holds_and_the_plan_warns():
    profile = profile_model(InlineAttention(), attention_batch, CE, batches=(2, 4))
    assert profile.unprofiled_param_bytes == 12 * 16 * 4  # pos
    assert profile.unprofiled_saved(4) >= 4 * 12 * 12 * 4  # at least the softmax output at batch 4
    assert "memory.blocks" in profile.unprofiled()
    assert not profile.unprofiled(share=1.0)  # a share the profile stays under: no warning
    wrapped = nn.Sequential(InlineAttention())  # as a model that holds it would name it: memory.blocks: ["0"]
    as_block = profile_model(wrapped, attention_batch, CE, batches=(2, 4), blocks=["0"])
    assert as_block.unprofiled_param_bytes == 0 and as_block.unprofiled_saved(4) == 0 and not as_block.unprofiled()


def test_the_plan_counts_what_no_layer_holds_as_kept():
    profile = profile_model(InlineAttention(), attention_batch, CE, batches=(2, 4))
    bare = replace(profile, unprofiled_param_bytes=0, unprofiled_saved_per_sample=0.0, unprofiled_saved_fixed=0.0)
    budget = MemoryBudget(device_bytes=10**9, bandwidth_bytes_per_s=1e10, host_bytes=10**9)
    for batch in (1, 7, 300):
        extra = peak_bytes(profile, batch, {}, budget) - peak_bytes(bare, batch, {}, budget)
        expected = (2 * profile.unprofiled_param_bytes + profile.unprofiled_saved(batch)) / (1 - budget.margin)
        assert extra == pytest.approx(expected) and extra > 0
        # the host's staging buffer and the worker's sum and parameters hold every parameter, a layer's or not
        more_host = host_bytes(profile, batch, {}, budget) - host_bytes(bare, batch, {}, budget)
        assert more_host == 3 * profile.unprofiled_param_bytes
    assert max_batch(profile, budget, allow_swap=True) < max_batch(bare, budget, allow_swap=True)


@pytest.mark.parametrize("model, batch", [(mlp, mlp_batch), (conv, conv_batch)], ids=["mlp", "conv"])
def test_a_model_of_layers_alone_leaves_nothing_out(model, batch):
    profile = profile_model(model(), batch, CE, batches=(2, 5))  # the loss's own saved input is not counted
    assert profile.unprofiled_param_bytes == 0 and profile.unprofiled_saved(5) == 0 and not profile.unprofiled()


# ------------------------------------------------------------------ swap and recompute


def gradients(model, x, y):
    CE(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "policies",
    [
        {str(i): "swap" for i in range(9)},
        {str(i): "recompute" for i in range(0, 9, 2)},
        {"0": "swap", "1": "swap", "2": "recompute", "4": "recompute", "5": "swap", "8": "swap"},
    ],
)
def test_swap_and_recompute_give_bitwise_identical_gradients(policies):
    x, y = mlp_batch(16)
    reference = gradients(mlp(depth=4), x, y)
    model = mlp(depth=4)
    offload = SwapToHost(prefetch=2).ignore_parameters(model)
    apply_layer_policies(model, policies, offload)
    offload.reset()
    assert torch.equal(gradients(model, x, y), reference)
    if "swap" in policies.values():
        assert offload.stats.swapped_out_bytes > 0
        assert offload.stats.swapped_in_bytes == offload.stats.swapped_out_bytes, "each storage comes back once"
        assert offload.stats.prefetched > 0


def test_saved_tensors_do_not_stay_on_the_device_during_forward():
    """Without swap autograd keeps every saved activation alive; with it, at most the window does."""
    x, y = mlp_batch(64)

    def alive_after_forward(swap: bool) -> tuple[int, int]:
        model = mlp(depth=6)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        refs: list[tuple[weakref.ref, int]] = []

        def watch(tensor):
            if tensor.untyped_storage().data_ptr() not in params:
                refs.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
            return tensor

        offload = SwapToHost(prefetch=2).ignore_parameters(model)
        if swap:
            apply_layer_policies(model, {name: "swap" for name, _ in model.named_children()}, offload)
            offload.reset()
        with torch.autograd.graph.saved_tensors_hooks(watch, lambda t: t):
            out = model(x)
        alive = sum(size for ref, size in refs if ref() is not None and ref() is not out)
        total = sum(size for _, size in refs)
        return alive, total

    alive_plain, total = alive_after_forward(swap=False)
    alive_swap, _ = alive_after_forward(swap=True)
    one_layer = 64 * 48 * 4
    assert alive_plain >= total - 64 * 32 * 4  # everything but the caller's own input stays alive
    assert alive_swap <= one_layer * (1 + 2), f"{alive_swap} bytes of saved tensors stayed behind"


def test_a_swapped_tensor_that_the_next_kept_layer_saves_too_leaves_the_device():
    """A ReLU marked swap saves its output; the next Linear, kept, saves the same tensor as its input.

    The profile counts that tensor for the ReLU, so the plan expects the swap to free it. Before the kept
    layers followed the swap, the Linear's reference held it for backward: on an H100 the planned batch
    ran out of memory at the seventh layer. Here a CPU stand-in shows the same through the tensors' lives.
    """
    x, y = mlp_batch(64)
    model = mlp(depth=6)
    relus = [name for name, module in model.named_children() if isinstance(module, nn.ReLU)]
    outputs: list[weakref.ref] = []
    for name in relus:
        model.get_submodule(name).register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    offload = SwapToHost(prefetch=2).ignore_parameters(model)
    apply_layer_policies(model, dict.fromkeys(relus, "swap"), offload)
    offload.reset()
    loss = CE(model(x), y)
    assert len(outputs) == len(relus) and all(ref() is None for ref in outputs), "a swapped output stayed alive"
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert torch.equal(torch.cat([g.reshape(-1) for g in grads]), gradients(mlp(depth=6), x, y))
    assert offload.stats.swapped_in_bytes == offload.stats.swapped_out_bytes == len(relus) * 64 * 48 * 4


class ThreeD(nn.Module):
    """A Linear on a 3-D input saves a 2-D view of it; a Flatten hands the next Linear a view."""

    def __init__(self, flatten: bool):
        super().__init__()
        torch.manual_seed(0)
        self.flatten = flatten
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(6 * 16, 5)) if flatten else nn.Linear(16, 5)

    def forward(self, x):
        out = self.head(self.body(x))
        return out if self.flatten else out.mean(dim=1)


@pytest.mark.parametrize("flatten", [False, True], ids=["linear-on-3d", "flatten-linear"])
def test_a_kept_layer_that_saves_a_view_of_a_swapped_tensor_lets_the_device_copy_go(flatten):
    x, y = torch.randn(4, 6, 8), torch.randint(0, 5, (4,))
    model = ThreeD(flatten)
    outputs: list[weakref.ref] = []
    model.body[1].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    offload = SwapToHost(prefetch=2).ignore_parameters(model)
    apply_layer_policies(model, {"body.1": "swap"}, offload)
    offload.reset()
    loss = CE(model(x), y)
    assert len(outputs) == 1 and outputs[0]() is None, "a view of the swapped output held it on the device"
    loss.backward()
    plain = ThreeD(flatten)
    CE(plain(x), y).backward()
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    assert offload.stats.swapped_out_bytes == offload.stats.swapped_in_bytes == 4 * 6 * 16 * 4


def test_a_conjugate_view_of_a_swapped_tensor_keeps_its_own_values():
    """A conjugate view shares the storage but not the values: sharing the plain copy gave a wrong gradient."""

    class Conj(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Parameter(torch.randn(6, dtype=torch.cfloat))

        def forward(self, z):
            return (z.conj() * self.w).abs().sum() + (z.view(-1).conj()[:6] * self.w).abs().sum()

    model = nn.Sequential(nn.Tanh(), Conj())
    offload = SwapToHost().ignore_parameters(model)
    apply_layer_policies(model, {"0": "swap"}, offload)
    offload.reset()
    z = torch.randn(4, 6, dtype=torch.cfloat, requires_grad=True)  # so that the Tanh saves its output
    model(z).backward()
    assert offload.stats.swapped_out_bytes == 4 * 6 * 8
    plain = nn.Sequential(nn.Tanh(), Conj())
    plain(z).backward()
    assert torch.allclose(model[1].w.grad, plain[1].w.grad)


def test_a_sparse_saved_tensor_stays_where_it_is():
    class Propagate(nn.Module):
        def __init__(self):
            super().__init__()
            self.adjacency = torch.eye(6).to_sparse()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            return torch.sparse.mm(self.adjacency, self.linear(x)).relu()

    model = nn.Sequential(Propagate(), nn.Linear(3, 2))
    offload = SwapToHost().ignore_parameters(model)
    apply_layer_policies(model, {"0": "swap"}, offload)
    offload.reset()
    x = torch.randn(6, 3)
    model(x).sum().backward()
    grad = model[0].linear.weight.grad.clone()
    plain = nn.Sequential(Propagate(), nn.Linear(3, 2))
    plain.load_state_dict(model.state_dict())
    plain(x).sum().backward()
    assert torch.equal(grad, plain[0].linear.weight.grad)
    assert offload.stats.swapped_out_bytes > 0  # the dense tensors it saved were swapped


def test_a_forward_that_raises_leaves_no_swap_hooks_behind():
    model = mlp(depth=2)
    offload = SwapToHost(prefetch=2).ignore_parameters(model)
    apply_layer_policies(model, {"0": "swap"}, offload)
    offload.reset()
    for _ in range(2):  # the wrong width fails inside layer 0's swap hooks and the root's follower hooks
        with pytest.raises(RuntimeError, match="mat1 and mat2"):
            model(torch.randn(4, 7))
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    before = offload.stats.swapped_out_bytes
    x = torch.randn(8, 8, requires_grad=True)
    (x.relu() * 2).sum().backward()  # outside the model: nothing may be packed by its hooks
    assert offload.stats.swapped_out_bytes == before
    offload.reset()
    x, y = mlp_batch(16)
    assert torch.equal(gradients(model, x, y), gradients(mlp(depth=2), x, y))


def test_unknown_layer_or_policy_is_rejected():
    with pytest.raises(ValueError, match="does not have"):
        apply_layer_policies(mlp(), {"9": "swap"}, SwapToHost())
    with pytest.raises(ValueError, match="unknown policy"):
        apply_layer_policies(mlp(), {"0": "offload"}, SwapToHost())


# ------------------------------------------------------------------ planner


def synthetic(layers=24, per_sample=1000.0, forward_s=1e-3, params=4000):
    return ModelProfile(
        tuple(
            LayerProfile(str(i), params, per_sample, 0.0, per_sample, forward_s, 2 * forward_s) for i in range(layers)
        ),
        batch=32,
        device="cpu",
    )


def test_plan_fits_the_budget_and_the_next_batch_does_not():
    profile = synthetic()
    budget = MemoryBudget(device_bytes=50_000_000, bandwidth_bytes_per_s=1e12)
    best = max_batch(profile, budget, allow_swap=True)
    assert plan_for_batch(profile, best, budget).fits and not plan_for_batch(profile, best + 1, budget).fits
    no_swap = max_batch(profile, budget, allow_swap=False)
    assert plan_for_batch(profile, no_swap, budget, allow_swap=False).fits
    assert not plan_for_batch(profile, no_swap + 1, budget, allow_swap=False).fits
    assert best / no_swap >= 4, "a 24-layer model must gain at least 4x from swapping"
    assert s15_max_batch(profile, budget.device_bytes) == 50_000


def test_everything_is_kept_when_it_fits():
    plan = plan_for_batch(synthetic(), 8, MemoryBudget(10**9, 1e10))
    assert plan.fits and plan.policies() == {}


def test_swap_is_preferred_while_it_hides_behind_compute():
    profile = synthetic()
    plan = plan_for_batch(profile, 1000, MemoryBudget(10_000_000, bandwidth_bytes_per_s=1e12))
    assert plan.fits and set(plan.policies().values()) == {"swap"}
    assert plan.swap_s <= plan.overlap_budget_s


def test_recompute_takes_over_when_swapping_would_not_hide():
    profile = synthetic()
    slow = MemoryBudget(10_000_000, bandwidth_bytes_per_s=1e6)  # a swap costs far more than the whole step
    plan = plan_for_batch(profile, 1000, slow)
    assert plan.fits and Policy.RECOMPUTE.value in plan.policies().values()
    assert plan.swap_s <= plan.overlap_budget_s or "swap" not in plan.policies().values()


class Residual(nn.Module):
    """A transformer-style feed-forward block: recomputing it keeps its input and rebuilds four saved tensors."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def residual_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Residual(), Residual(), Residual(), MeanPool(), nn.Linear(32, 5))


def residual_batch(n):
    return torch.randn(n, 8, 16), torch.randint(0, 5, (n,))


class Mix(nn.Module):
    """A block of two inputs: ``h`` (a kept ReLU's output, which the ReLU saves) and ``z`` (which only it saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(24, 32)

    def forward(self, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.p(z))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.act, self.b, self.blk, self.head = (
            nn.Linear(16, 32),
            nn.ReLU(),
            nn.Linear(16, 24),
            Mix(),
            nn.Linear(32, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(self.act(self.a(x)), self.b(x)))


def two_input_batch(n):
    return torch.randn(n, 16), torch.randint(0, 5, (n,))


def graph_saved_bytes(model: nn.Module, policies: dict[str, str], inputs: torch.Tensor) -> int:
    apply_layer_policies(model, policies, SwapToHost())
    return forward_saved_bytes(model, inputs)


@pytest.mark.parametrize(
    "model, batch, blocks",
    [
        (lambda: mlp(depth=4), mlp_batch, []),
        (residual_net, residual_batch, []),
        (residual_net, residual_batch, ["1", "2", "3"]),
        (TwoInputs, two_input_batch, ["blk"]),  # each input on its own: h is held anyway, z is not; x feeds two
        (conv, conv_batch, []),  # Flatten's input is the next Linear's (a view): one storage, counted once
    ],
    ids=["mlp", "residual layers", "residual blocks", "two inputs", "conv"],
)
def test_the_plan_counts_what_recompute_leaves_on_the_device(model, batch, blocks):
    """Under any mix of keep and recompute, the plan's saved bytes are what the real forward leaves."""
    profile = profile_model(model(), batch, CE, batches=(2, 5), blocks=blocks)
    inputs, _ = batch(6)
    names = [layer.name for layer in profile.layers]
    rng = random.Random(0)
    mixes: list[dict[str, str]] = [{}, dict.fromkeys(names, "recompute")]
    mixes += [{n: rng.choice(["keep", "recompute"]) for n in names} for _ in range(40)]
    for mix in mixes:
        recompute = {n: p for n, p in mix.items() if p == "recompute"}
        real = graph_saved_bytes(model(), recompute, inputs)
        planned = saved_on_device(profile, 6, {n: Policy(p) for n, p in mix.items()}) + profile.unprofiled_saved(6)
        assert planned == pytest.approx(real), mix


def test_recomputing_a_lone_linear_or_relu_frees_nothing_so_the_plan_does_not():
    profile = profile_model(mlp(hidden=256, depth=6), mlp_batch, CE, batches=(2, 5))
    slow = MemoryBudget(device_bytes=4 * profile.param_bytes, bandwidth_bytes_per_s=1e3)  # no swap can hide
    keep_only = max_batch(profile, slow, allow_swap=False)
    assert max_batch(profile, slow, allow_swap=True) == keep_only > 0
    beyond = plan_for_batch(profile, keep_only + 1, slow)
    assert not beyond.fits and beyond.policies() == {}  # nothing recomputed for nothing


def test_recomputing_a_block_frees_what_it_saves_less_its_input():
    profile = profile_model(residual_net(), residual_batch, CE, batches=(2, 5), blocks=["1", "2", "3"])
    block = next(la for la in profile.layers if la.name == "2")
    # its input is block 1's sum (which saves nothing), saved by its own LayerNorm first
    (only,) = block.inputs
    assert only.bytes_per_sample == 8 * 32 * 4 and only.saved_by == "" and only.saved_here
    assert block.saved_bytes_per_sample > 4 * only.bytes_per_sample
    slow = MemoryBudget(device_bytes=4 * profile.param_bytes + 400_000, bandwidth_bytes_per_s=1e3)
    keep_only = max_batch(profile, slow, allow_swap=False)
    best = max_batch(profile, slow, allow_swap=True)
    plan = plan_for_batch(profile, best, slow)
    assert best > 2 * keep_only and set(plan.policies().values()) == {"recompute"}
    assert plan.peak_bytes == pytest.approx(
        peak_bytes(profile, best, {n: Policy.RECOMPUTE for n in plan.policies()}, slow)
    )


def test_nothing_fits_reports_zero():
    assert max_batch(synthetic(params=10**9), MemoryBudget(10**6, 1e10), allow_swap=True) == 0


def test_parse_bytes_units_are_decimal_for_gb_and_binary_for_gib():
    assert parse_bytes("16GB") == 16_000_000_000 and parse_bytes("16GiB") == 16 * 1024**3
    assert parse_bytes("512mb") == 512 * 10**6 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes("2TB") == 2 * 10**12 and parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError):
        parse_bytes("16Gb!")


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("12GB/s") == 12 * 10**9 and parse_bytes("1e3") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize("text", ["1e400", "1e999GiB", float("inf")])
def test_parse_bytes_refuses_a_size_no_integer_holds_with_a_value_error(text):
    with pytest.raises(ValueError, match="is too large: not a finite number of bytes"):
        parse_bytes(text)


def test_the_iterative_estimate_warns_when_its_trials_run_out(caplog):
    policy = EstimatePolicy(EstimateMode.ITERATIVE, increment_bytes=10, target_utilization=0.5, max_trials=3)
    loop = IterativeEstimate(policy, actual_bytes=100)
    limits = []
    with caplog.at_level(logging.WARNING, logger="pstrain.planner.memory_estimate"):
        limit: int | None = loop.limit
        while limit is not None:  # every trial uses the whole limit: over the target each time
            limits.append(limit)
            limit = loop.next_limit(Probe(64, limit, 0, limit_bytes=limit))
    assert limits == [110, 120, 130] and loop.limit == 130
    assert [r.getMessage() for r in caplog.records] == [
        "iterative memory estimate: 3 trials ran out at utilisation 100% of 130 B, over the target 50%; "
        "accepting 130 B (raise memory.increment or lower memory.target_utilization)"
    ]


# ------------------------------------------------------------------ job planning and LR


RAW = {
    "model": {"factory": "tests.helpers:odd_mlp"},
    "data": {"factory": "tests.helpers:classification_set", "kwargs": {"n": 64}},
    "cluster": {"workers": 2, "devices_per_worker": ["cpu", "cpu"]},  # stand-ins on any host, a GPU host too
}


def job_plan(**sections):
    cfg = parse_config({**RAW, **sections})
    from pstrain.coordinator.model_state import ModelState

    model = ModelState(cfg)
    return plan_job(cfg, model.model, classification_set(4096), model.layout.total)  # data set over the largest batch


def test_auto_batch_takes_the_largest_that_fits_capped_by_the_user():
    plan = job_plan(batch={"per_device": "auto"}, memory={"device_memory": "64KiB", "bandwidth": "10GB/s"})
    assert plan.plan.per_device_batch == plan.max_batch_with_plan > 0
    assert plan.memory is not None and plan.memory.fits
    capped = job_plan(batch={"per_device": "auto", "max_per_device": 3}, memory={"device_memory": "64KiB"})
    assert capped.plan.per_device_batch == 3 and capped.plan.global_batch == 12
    text = describe(plan)
    assert "max per-device batch: without swap" in text and "S1.5 formula" in text and "estimated PS memory" in text


def test_auto_batch_without_a_gpu_needs_the_device_memory():
    with pytest.raises(ConfigError, match="memory.device_memory"):
        job_plan(batch={"per_device": "auto"})


@pytest.mark.parametrize(
    "optimizer, scaling, factor",
    [
        ("sgd", "auto", 4.0),
        ("adam", "auto", 2.0),
        ("adamw", "auto", 2.0),
        ("adam", "linear", 4.0),
        ("sgd", "none", 1.0),
    ],
)
def test_lr_rules(optimizer, scaling, factor):
    plan = make_plan(
        parse_config(
            {**RAW, "optimizer": {"name": optimizer, "lr": 0.1}, "batch": {"per_device": 8, "lr_scaling": scaling}}
        )
    )
    assert plan.scaled_lr == pytest.approx(0.1 * factor) and math.isclose(plan.lr_factor, factor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_planned_batch_stays_under_budget_where_keeping_everything_runs_out():
    device = torch.device("cuda", 0)
    model = mlp(d_in=32, hidden=4096, depth=24).to(device)
    profile = profile_model(model, mlp_batch, CE, batches=(8, 16), device=device)
    # The plan counts parameters and gradients (2P) on the device; 1 GiB more is left for activations.
    budget = MemoryBudget(device_bytes=2 * profile.param_bytes + (1 << 30), bandwidth_bytes_per_s=20e9)
    batch = max_batch(profile, budget, allow_swap=True)
    plan = plan_for_batch(profile, batch, budget)
    assert batch > max_batch(profile, budget, allow_swap=False) > 0
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(budget.device_bytes / torch.cuda.get_device_properties(0).total_memory)
    try:
        offload = SwapToHost().ignore_parameters(model)
        apply_layer_policies(model, plan.policies(), offload)
        offload.reset()
        torch.cuda.reset_peak_memory_stats(device)
        x, y = mlp_batch(batch)
        CE(model(x.to(device)), y.to(device)).backward()
        assert torch.cuda.max_memory_allocated(device) <= budget.device_bytes
        del model, offload  # the same model again, without the plan, in the same budget
        torch.cuda.empty_cache()
        plain = mlp(d_in=32, hidden=4096, depth=24).to(device)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            CE(plain(x.to(device)), y.to(device)).backward()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_pstrain_plan_prints_the_plan(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT, child_env, write_job

    job = write_job(tmp_path / "job.yaml", batch={"per_device": "auto", "max_per_device": 64})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pstrain.launcher.cli",
            "plan",
            "--config",
            str(job),
            "--device-memory",
            "256KiB",
            "--bandwidth",
            "10GB/s",
        ],
        cwd=REPO_ROOT,
        env=child_env("plan"),  # the job's CPU stand-ins, planned the same on a GPU host
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "layer" in out and "policy" in out and "device memory 256.0 KiB" in out
    assert "max per-device batch: without swap" in out and "chosen batch" in out and "estimated PS memory" in out
    bad = subprocess.run(
        [sys.executable, "-m", "pstrain.launcher.cli", "plan", "--config", str(job)],
        cwd=REPO_ROOT,
        env=child_env("plan"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "memory.device_memory" in bad.stderr
