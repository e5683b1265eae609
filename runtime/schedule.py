"""The learning rate of a step, from the plan's schedule.

Shared because the PS applies it and the coordinator reports it: both must agree exactly.
"""

from __future__ import annotations

from pstrain.protos import pstrain_pb2 as pb


def learning_rate(schedule: pb.LrSchedule, step: int) -> float:
    """Linear warmup from ``scaled_lr / warmup_steps`` to ``scaled_lr`` over ``warmup_steps``."""
    if schedule.warmup_steps > 0 and step < schedule.warmup_steps:
        return schedule.scaled_lr * (step + 1) / schedule.warmup_steps
    return schedule.scaled_lr
