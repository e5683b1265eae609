"""A ``ModelProfile`` on the wire: the master worker measures it on its device, the coordinator plans from it.

Issue 10 ("plans measured where they run"): swap/recompute decisions rest on the ratio of layer
compute time to copy bandwidth, so a plan for a GPU made from CPU-measured times is only a guess
until the master's own profile arrives with its first probe report.

A profile from the wire is checked (``check_profile``) before anything plans from it: a batch of 0
divides by zero in the planner, an empty layer list plans no memory at all (the batch jumps to the
search's cap), and a layer name the model does not have would be sent to every worker as a policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pstrain.planner.profiler import LayerInput, LayerProfile, ModelProfile
from pstrain.protos import pstrain_pb2 as pb


def profile_to_pb(profile: ModelProfile) -> pb.DeviceProfile:
    return pb.DeviceProfile(
        layers=[
            pb.LayerProfileEntry(
                name=layer.name,
                param_bytes=layer.param_bytes,
                saved_bytes_per_sample=layer.saved_bytes_per_sample,
                saved_bytes_fixed=layer.saved_bytes_fixed,
                output_bytes_per_sample=layer.output_bytes_per_sample,
                forward_s=layer.forward_s,
                backward_s=layer.backward_s,
                inputs=[
                    pb.LayerInput(
                        bytes_per_sample=each.bytes_per_sample,
                        bytes_fixed=each.bytes_fixed,
                        saved_by=each.saved_by,
                        saved_here=each.saved_here,
                        storage=each.storage,
                    )
                    for each in layer.inputs
                ],
            )
            for layer in profile.layers
        ],
        batch=profile.batch,
        device=profile.device,
        device_total_bytes=profile.device_total_bytes,
        unprofiled_param_bytes=profile.unprofiled_param_bytes,
        unprofiled_saved_per_sample=profile.unprofiled_saved_per_sample,
        unprofiled_saved_fixed=profile.unprofiled_saved_fixed,
        host_total_bytes=profile.host_total_bytes,
    )


def profile_from_pb(message: pb.DeviceProfile) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            e.name,
            e.param_bytes,
            e.saved_bytes_per_sample,
            e.saved_bytes_fixed,
            e.output_bytes_per_sample,
            e.forward_s,
            e.backward_s,
            tuple(LayerInput(i.bytes_per_sample, i.bytes_fixed, i.saved_by, i.saved_here, i.storage) for i in e.inputs),
        )
        for e in message.layers
    )
    return ModelProfile(
        layers,
        message.batch,
        message.device,
        message.device_total_bytes,
        message.host_total_bytes,
        message.unprofiled_param_bytes,
        message.unprofiled_saved_per_sample,
        message.unprofiled_saved_fixed,
    )


def check_profile(profile: ModelProfile, layer_names: Sequence[str] | None = None) -> None:
    """Raise ``ValueError`` naming what is wrong unless the planner can plan from ``profile``.

    ``layer_names``: the layers the model has, in order (the coordinator's own profile's), which the
    profile must name exactly: the plan's policies go to the workers by these names.
    """
    if profile.batch < 1:
        raise ValueError(f"batch must be at least 1, got {profile.batch}")
    for key in ("device_total_bytes", "host_total_bytes"):
        if getattr(profile, key) < 0:
            raise ValueError(f"{key} must be non-negative, got {getattr(profile, key)}")
    if not profile.layers:
        raise ValueError("it has no layers")
    for key in ("unprofiled_param_bytes", "unprofiled_saved_per_sample", "unprofiled_saved_fixed"):
        _non_negative("", key, getattr(profile, key))
    for layer in profile.layers:
        for key in LAYER_FIGURES:
            _non_negative(layer.name, key, getattr(layer, key))
    names = [layer.name for layer in profile.layers]
    if len(set(names)) != len(names):
        raise ValueError(f"layer names repeat: {_few(sorted({n for n in names if names.count(n) > 1}))}")
    if layer_names is not None and names != list(layer_names):
        unknown = [n for n in names if n not in layer_names]
        missing = [n for n in layer_names if n not in names]
        raise ValueError(
            f"its layers {_few(names)} are not the model's {_few(list(layer_names))}"
            f" (unknown: {_few(unknown)}; missing: {_few(missing)})"
        )
    for layer in profile.layers:
        for each in layer.inputs:
            _non_negative(layer.name, "an input's bytes_per_sample", each.bytes_per_sample)
            _non_negative(layer.name, "an input's bytes_fixed", each.bytes_fixed)
            if each.saved_by and (each.saved_by == layer.name or each.saved_by not in names):
                raise ValueError(
                    f"layer {layer.name!r}: an input's saved_by must name another of its layers or be empty, "
                    f"got {each.saved_by!r}"
                )


LAYER_FIGURES = (
    "param_bytes",
    "saved_bytes_per_sample",
    "saved_bytes_fixed",
    "output_bytes_per_sample",
    "forward_s",
    "backward_s",
)


def _non_negative(layer: str, key: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        where = f"layer {layer!r}: " if layer else ""
        raise ValueError(f"{where}{key} must be a finite non-negative number, got {value}")


def _few(names: list[str], shown: int = 6) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return "[" + ", ".join(map(repr, names[:shown])) + more + "]"
