"""The shard's torch.optim optimizer, from the job's wire spec and the optimizer registry.

The registry (``pstrain.runtime.optimizers``) owns the optimizers; this module only reads the
options off ``pb.OptimizerSpec`` and turns an unknown name into the shard's ``InvalidArgument``.
The coordinator has validated the options against the registry before the spec was sent.
"""

from __future__ import annotations

from typing import Any

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.runtime.optimizers import OPTIMIZERS, UnknownOptimizer, optimizer_entry


def spec_options(spec: pb.OptimizerSpec) -> dict[str, Any]:
    """Every option the wire carries, under its job-file key; an entry reads the ones it takes."""
    return {
        "momentum": spec.momentum,
        "dampening": spec.dampening,
        "nesterov": spec.nesterov,
        "weight_decay": spec.weight_decay,
        "betas": (spec.beta1, spec.beta2),
        "eps": spec.eps,
    }


def build_optimizer(param: torch.nn.Parameter, spec: pb.OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    try:
        entry = optimizer_entry(spec.name.lower())
    except UnknownOptimizer:
        raise InvalidArgument(f"unsupported optimizer {spec.name!r}; use one of {', '.join(OPTIMIZERS)}") from None
    return entry.build(param, lr, spec_options(spec))
