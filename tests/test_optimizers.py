"""The optimizer registry: each entry builds what torch.optim builds, and says what the plan needs."""

import typing

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.ps_server.optimizer import build_optimizer, spec_options
from pstrain.runtime.optimizers import (
    OPTIMIZERS,
    REGISTRY,
    BadOption,
    OptimizerName,
    UnknownOptimizer,
    optimizer_entry,
)

OPTIONS = {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01, "betas": [0.8, 0.99], "eps": 1e-6}

# What ps_server/optimizer.py built before the registry, by hand, per name.
TORCH = {
    "sgd": lambda p, lr: torch.optim.SGD([p], lr=lr, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01),
    "adam": lambda p, lr: torch.optim.Adam([p], lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
    "adamw": lambda p, lr: torch.optim.AdamW([p], lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
}


def three_steps(make, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(257, generator=gen))
    opt = make(param, 0.05)
    for _ in range(3):
        param.grad = torch.randn(257, generator=gen)
        opt.step()
    return param.detach(), opt


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_entry_steps_exactly_like_torch(name):
    entry = optimizer_entry(name)
    options = {k: OPTIONS[k] for k in entry.options}
    ours, opt = three_steps(lambda p, lr: entry.build(p, lr, options))
    theirs, ref = three_steps(TORCH[name])
    assert type(opt) is type(ref)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, three_steps(lambda p, lr: torch.optim.SGD([p], lr=lr))[0])


@pytest.mark.parametrize("name", OPTIMIZERS)
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


@pytest.mark.parametrize("name", OPTIMIZERS)
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
