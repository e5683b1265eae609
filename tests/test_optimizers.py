"""The optimizer registry: each entry builds what torch.optim builds, and says what the plan needs.

The entries build torch's fused kernels, which round a few elements differently from the default
(for-loop) kernels (by an ulp or a few), so the exact comparisons are against ``fused=True``
references and a separate test bounds the distance to the for-loop ones.
"""

import typing

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.ps_server.optimizer import UPDATE_THREADS_MAX, build_optimizer, spec_options, step_on_mean, update_threads
from pstrain.runtime.optimizers import (
    ELEMENTWISE,
    LAYERWISE,
    OPTIMIZERS,
    REGISTRY,
    BadOption,
    OptimizerError,
    OptimizerName,
    UnknownOptimizer,
    optimizer_entry,
)

OPTIONS = {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01, "betas": [0.8, 0.99], "eps": 1e-6}

# What ps_server/optimizer.py built before the registry, by hand, per name (the default for-loop kernels).
FOR_LOOP = {
    "sgd": lambda p, lr, **k: torch.optim.SGD(
        [p], lr=lr, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01, **k
    ),
    "adam": lambda p, lr, **k: torch.optim.Adam([p], lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, **k),
    "adamw": lambda p, lr, **k: torch.optim.AdamW([p], lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, **k),
}
# What the registry builds now: the same optimizers with torch's fused kernel.
TORCH = {name: (lambda p, lr, make=make: make(p, lr, fused=True)) for name, make in FOR_LOOP.items()}


def three_steps(make, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(257, generator=gen))
    opt = make(param, 0.05)
    for _ in range(3):
        param.grad = torch.randn(257, generator=gen)
        opt.step()
    return param.detach(), opt


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_entry_steps_exactly_like_torch(name):
    entry = optimizer_entry(name)
    options = {k: OPTIONS[k] for k in entry.options}
    ours, opt = three_steps(lambda p, lr: entry.build(p, lr, options))
    theirs, ref = three_steps(TORCH[name])
    assert type(opt) is type(ref)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, three_steps(lambda p, lr: torch.optim.SGD([p], lr=lr))[0])


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_shard_builder_reads_the_wire_spec_into_the_registry(name):
    spec = pb.OptimizerSpec(
        name=name.upper(), momentum=0.9, nesterov=True, weight_decay=0.01, beta1=0.8, beta2=0.99, eps=1e-6
    )
    ours, _ = three_steps(lambda p, lr: build_optimizer(p, spec, lr))
    theirs, _ = three_steps(TORCH[name])
    assert torch.equal(ours, theirs)
    assert spec_options(spec)["betas"] == pytest.approx((0.8, 0.99))


def test_unknown_name():
    with pytest.raises(UnknownOptimizer, match=r"unknown optimizer 'lbfgs'; use one of sgd, adam, adamw"):
        optimizer_entry("lbfgs")
    assert issubclass(UnknownOptimizer, ValueError)
    with pytest.raises(InvalidArgument, match=r"unsupported optimizer 'lbfgs'; use one of sgd, adam, adamw"):
        build_optimizer(torch.nn.Parameter(torch.zeros(3)), pb.OptimizerSpec(name="lbfgs"), 0.1)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_state_tensor_count_matches_what_torch_keeps(name):
    entry = optimizer_entry(name)
    _, opt = three_steps(lambda p, lr: entry.build(p, lr, {k: OPTIONS[k] for k in entry.options}))
    (state,) = opt.state.values()
    full = [t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() == 257]
    assert len(full) == entry.state_tensors
    assert (entry.state_tensors, entry.adaptive) == {"sgd": (1, False), "adam": (2, True), "adamw": (2, True)}[name]


def test_names_agree_with_the_literal_the_schema_uses():
    assert OPTIMIZERS == typing.get_args(OptimizerName) == tuple(REGISTRY)
    assert all(name == entry.name for name, entry in REGISTRY.items())


@pytest.mark.parametrize(
    "name, change, option, message",
    [
        ("sgd", {"momentum": -1}, "momentum", "must be non-negative, got -1"),
        ("sgd", {"weight_decay": -0.1}, "weight_decay", "must be non-negative"),
        ("sgd", {"momentum": 0.0, "nesterov": True}, "nesterov", "needs momentum > 0 and dampening 0"),
        ("sgd", {"dampening": 0.1, "nesterov": True}, "nesterov", "needs momentum > 0 and dampening 0"),
        ("adam", {"betas": [0.9]}, "betas", "must be two numbers in [0, 1), got [0.9]"),
        ("adamw", {"betas": [0.9, 1.0]}, "betas", "must be two numbers in [0, 1)"),
        ("adam", {"eps": 0.0}, "eps", "must be positive, got 0.0"),
    ],
)
def test_validation_names_the_option(name, change, option, message):
    entry = optimizer_entry(name)
    good = {k: OPTIONS[k] for k in entry.options}
    entry.validate(good)
    with pytest.raises(BadOption) as caught:
        entry.validate({**good, **change})
    assert caught.value.option == option and caught.value.message.startswith(message)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_fused_entries_stay_within_rounding_of_the_for_loop_kernels(name):
    entry = optimizer_entry(name)
    ours, opt = three_steps(lambda p, lr: entry.build(p, lr, {k: OPTIONS[k] for k in entry.options}))
    theirs, ref = three_steps(FOR_LOOP[name])
    assert all(group["fused"] for group in opt.param_groups) and not ref.param_groups[0]["fused"]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)  # test_shard's tolerance
    assert (ours != theirs).sum() <= 257 // 4  # rounding of the odd element, not a different rule


def sum_and_mean(devices, seed=1):
    """Gradients a shard would see: the sum over ``devices`` and the mean a plain optimizer steps on."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(257, generator=gen) for _ in range(devices)]
    total = torch.stack(parts).sum(0)
    return total, total / devices


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("devices", [1, 3, 8])
def test_step_on_mean_divides_inside_the_fused_kernel(name, devices):
    entry = optimizer_entry(name)
    options = {k: OPTIONS[k] for k in entry.options}
    ours = torch.nn.Parameter(torch.linspace(-1, 1, 257))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt, ref = entry.build(ours, 0.05, options), entry.build(theirs, 0.05, options)
    for step in range(3):
        total, mean = sum_and_mean(devices, seed=step)
        ours.grad, theirs.grad = total.clone(), mean
        step_on_mean(opt, devices)
        ref.step()
        assert not hasattr(opt, "grad_scale")  # the scale never outlives the step
        assert torch.equal(ours.grad, mean)  # the kernel stores the mean back
    assert torch.equal(ours.detach(), theirs.detach())  # exactly: dividing in the kernel is the same division
    state, expected = opt.state[ours], ref.state[theirs]
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_step_on_mean_of_an_unfused_optimizer_divides_first(name):
    """State loaded from a checkpoint written before the fused kernels keeps ``fused`` off."""
    ours = torch.nn.Parameter(torch.linspace(-1, 1, 257))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt, ref = FOR_LOOP[name](ours, 0.05), FOR_LOOP[name](theirs, 0.05)
    total, mean = sum_and_mean(4)
    ours.grad, theirs.grad = total, mean.clone()
    step_on_mean(opt, 4)
    ref.step()
    assert torch.equal(ours.detach(), theirs.detach()) and torch.equal(ours.grad, mean)


def test_step_on_mean_refuses_no_devices():
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match="at least one device"):
        step_on_mean(torch.optim.SGD([param], lr=0.1, fused=True), 0)
    assert torch.equal(param.detach(), torch.zeros(3))


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 1), (4, 2), (8, UPDATE_THREADS_MAX), (128, 4)])
def test_update_threads_leaves_cores_to_the_worker_and_grpc(cpus, threads):
    assert update_threads(cpus) == threads
    assert 1 <= update_threads() <= UPDATE_THREADS_MAX


def test_layerwise_entries_refuse_to_build_without_segments():
    """LARS and LAMB need the slice's parameter boundaries: ``pstrain.ps_server.layerwise`` builds them."""
    assert LAYERWISE == ("lars", "lamb") and set(ELEMENTWISE) | set(LAYERWISE) == set(OPTIMIZERS)
    assert [(optimizer_entry(n).state_tensors, optimizer_entry(n).adaptive) for n in LAYERWISE] == [
        (1, False),
        (2, True),
    ]
    for name in LAYERWISE:
        entry = optimizer_entry(name)
        entry.validate({k: {**OPTIONS, "trust_coefficient": 0.001, "exclude_1d": True}[k] for k in entry.options})
        with pytest.raises(OptimizerError, match="parameter segments"):
            entry.build(torch.nn.Parameter(torch.zeros(3)), 0.1, {})
    with pytest.raises(BadOption, match="must be positive"):
        optimizer_entry("lars").validate({"momentum": 0.9, "weight_decay": 0.0, "trust_coefficient": 0.0})
