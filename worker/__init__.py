"""pstrain worker: one process per host driving all of that host's devices (S1.2, S1.3).

Each device holds a full replica; gradients are summed on the host into one flat buffer and
each shard's slice of that sum is pushed once per step, never once per device.
"""
