"""A ``ModelProfile`` on the wire: the master worker measures it on its device, the coordinator plans from it.

Issue 10 ("plans measured where they run"): swap/recompute decisions rest on the ratio of layer
compute time to copy bandwidth, so a plan for a GPU made from CPU-measured times is only a guess
until the master's own profile arrives with its first probe report.
"""

from __future__ import annotations

from pstrain.planner.profiler import LayerProfile, ModelProfile
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
            )
            for layer in profile.layers
        ],
        batch=profile.batch,
        device=profile.device,
        device_total_bytes=profile.device_total_bytes,
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
        )
        for e in message.layers
    )
    return ModelProfile(layers, message.batch, message.device, message.device_total_bytes)
