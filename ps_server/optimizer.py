"""Build the shard's torch.optim optimizer from the job spec.

Only elementwise optimizers are offered: applied to a slice of the flat vector they give
bit-for-bit what they give applied to the whole model, which is what makes sharding exact.
"""

from __future__ import annotations

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument

SUPPORTED = ("sgd", "adam", "adamw")


def build_optimizer(param: torch.nn.Parameter, spec: pb.OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    name = spec.name.lower()
    if name == "sgd":
        return torch.optim.SGD(
            [param],
            lr=lr,
            momentum=spec.momentum,
            dampening=spec.dampening,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
        )
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls([param], lr=lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, weight_decay=spec.weight_decay)
    raise InvalidArgument(f"unsupported optimizer {spec.name!r}; use one of {', '.join(SUPPORTED)}")
