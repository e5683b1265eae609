"""The optimizers a job may name: one registry entry each, read by the schema, the plan and the PS shard.

An entry says everything the rest of pstrain needs to know about an optimizer, so adding one is
adding an entry (and its name to ``OptimizerName``):

* the job-file options it takes (beyond ``lr``) and the rules they obey: the schema rejects a
  bad value, or an option the optimizer would silently ignore, before any process starts;
* how many fp32 state tensors it keeps per parameter element: the planner sizes PS memory with it;
* whether it is Adam-type (its step is normalised per element): ``lr_scaling: auto`` picks sqrt;
* the torch builder a PS shard calls for its one flat Parameter.

Every builder asks torch for its fused kernel (``fused=True``; torch has CPU ones for SGD, Adam
and AdamW): one pass over parameter, gradient and state, where the default for-loop kernel
makes three to six (``bench/update.py``). The fused kernels vectorise the same arithmetic but
round a few elements differently from the for-loop ones (SGD: the odd element in the unvectorised
tail, by one ulp; Adam/AdamW: more elements, a few ulps), inside the 1e-6 relative the shard
tests hold the update to (``tests/test_optimizers.py``). The fused kernels also take a
``grad_scale`` to divide the gradient by as they read it, which is how a shard turns its device
sum into the mean without a separate pass (``pstrain.ps_server.optimizer.step_on_mean``).

The entries here are elementwise: applied to a slice of the flat parameter vector they give
what they give applied to the whole model, which is what makes sharding exact (to the rounding
above: an element that falls in a slice's unvectorised tail may differ by an ulp).

The layer-wise entries (LARS, LAMB: ``layerwise=True``) are not elementwise: their step scales
each parameter tensor by a trust ratio of norms over the whole tensor, so a shard needs the
parameter boundaries inside its slice and, for a parameter split across shards, the other
shards' partial norms. Their builder lives with the shard (``pstrain.ps_server.layerwise``);
``build`` here refuses, so nothing builds one without its parameter segments by mistake.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

OptimizerName = Literal["sgd", "adam", "adamw", "lars", "lamb"]
"""The names a job file may give ``optimizer.name``; one registry entry each."""

Options = Mapping[str, Any]
Builder = Callable[[torch.nn.Parameter, float, Options], torch.optim.Optimizer]


class OptimizerError(ValueError):
    """Base of the registry's errors; the schema and the PS shard map them to their own."""


class UnknownOptimizer(OptimizerError):
    """A name with no registry entry."""


class BadOption(OptimizerError):
    """An option value the optimizer cannot use; ``option`` is the job-file key under ``optimizer``."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


def _non_negative(value: Any) -> str | None:
    return None if value >= 0 else f"must be non-negative, got {value}"


def _positive(value: Any) -> str | None:
    return None if value > 0 else f"must be positive, got {value}"


def _betas(value: Any) -> str | None:
    ok = len(value) == 2 and all(0 <= b < 1 for b in value)
    return None if ok else f"must be two numbers in [0, 1), got {value}"


OPTION_RULES: dict[str, Callable[[Any], str | None]] = {
    "momentum": _non_negative,
    "weight_decay": _non_negative,
    "betas": _betas,
    "eps": _positive,
    "trust_coefficient": _positive,
}
"""Per-option rules shared by every entry that takes the option; ``None`` means the value is fine."""


def _nesterov_needs_momentum(options: Options) -> None:
    if options["nesterov"] and not (options["momentum"] > 0 and options["dampening"] == 0):
        raise BadOption("nesterov", "needs momentum > 0 and dampening 0")


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    build: Builder
    """``build(param, lr, options)``: the torch optimizer (fused kernel) over one flat Parameter."""
    options: tuple[str, ...]
    """Job-file keys under ``optimizer`` this optimizer reads, besides ``lr``."""
    state_tensors: int
    """fp32 tensors of the parameter's size it keeps (SGD's momentum buffer counts even at momentum 0)."""
    adaptive: bool
    """Adam-type: the step is normalised per element, so ``lr_scaling: auto`` scales the LR by sqrt."""
    checks: tuple[Callable[[Options], None], ...] = ()
    """Rules across options, run after the per-option ``OPTION_RULES``; they raise ``BadOption``."""
    layerwise: bool = False
    """The step uses norms per parameter tensor (a trust ratio): built by ``pstrain.ps_server.layerwise``."""

    def validate(self, options: Options) -> None:
        """Raise ``BadOption`` for the first option that breaks a rule; ``options`` maps each of ``self.options``."""
        for option in self.options:
            rule = OPTION_RULES.get(option)
            problem = rule(options[option]) if rule is not None else None
            if problem is not None:
                raise BadOption(option, problem)
        for check in self.checks:
            check(options)


def _sgd(param: torch.nn.Parameter, lr: float, o: Options) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [param],
        lr=lr,
        momentum=o["momentum"],
        dampening=o["dampening"],
        nesterov=o["nesterov"],
        weight_decay=o["weight_decay"],
        fused=True,
    )


def _adam(param: torch.nn.Parameter, lr: float, o: Options) -> torch.optim.Optimizer:
    betas = tuple(o["betas"])
    return torch.optim.Adam([param], lr=lr, betas=betas, eps=o["eps"], weight_decay=o["weight_decay"], fused=True)


def _adamw(param: torch.nn.Parameter, lr: float, o: Options) -> torch.optim.Optimizer:
    betas = tuple(o["betas"])
    return torch.optim.AdamW([param], lr=lr, betas=betas, eps=o["eps"], weight_decay=o["weight_decay"], fused=True)


def _needs_segments(param: torch.nn.Parameter, lr: float, o: Options) -> torch.optim.Optimizer:
    raise OptimizerError(
        "a layer-wise optimizer needs the parameter segments of its slice: build it with "
        "pstrain.ps_server.layerwise.build_layerwise"
    )


_ADAM_OPTIONS = ("betas", "eps", "weight_decay")

REGISTRY: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            "sgd",
            _sgd,
            ("momentum", "dampening", "nesterov", "weight_decay"),
            state_tensors=1,
            adaptive=False,
            checks=(_nesterov_needs_momentum,),
        ),
        OptimizerEntry("adam", _adam, _ADAM_OPTIONS, state_tensors=2, adaptive=True),
        OptimizerEntry("adamw", _adamw, _ADAM_OPTIONS, state_tensors=2, adaptive=True),
        # You et al. 2017: SGD with momentum, each tensor's step scaled by eta ||w|| / (||g|| + wd ||w||).
        OptimizerEntry(
            "lars",
            _needs_segments,
            ("momentum", "weight_decay", "trust_coefficient", "exclude_1d"),
            state_tensors=1,
            adaptive=False,
            layerwise=True,
        ),
        # You et al. 2019: Adam's direction plus weight decay, each tensor's step scaled by ||w|| / ||update||.
        OptimizerEntry(
            "lamb", _needs_segments, (*_ADAM_OPTIONS, "exclude_1d"), state_tensors=2, adaptive=True, layerwise=True
        ),
    )
}

OPTIMIZERS: tuple[str, ...] = tuple(REGISTRY)
"""Registered names, in the order error messages list them."""

ELEMENTWISE: tuple[str, ...] = tuple(name for name, entry in REGISTRY.items() if not entry.layerwise)
LAYERWISE: tuple[str, ...] = tuple(name for name, entry in REGISTRY.items() if entry.layerwise)
LARGE_BATCH: tuple[str, ...] = LAYERWISE
"""What the plan proposes past ``batch.linear_lr_max_global``: the optimizers made for large batches."""

if typing.get_args(OptimizerName) != OPTIMIZERS:
    raise RuntimeError(f"OptimizerName {typing.get_args(OptimizerName)} and the registry {OPTIMIZERS} disagree")


def optimizer_entry(name: str) -> OptimizerEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownOptimizer(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}") from None
