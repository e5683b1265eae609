"""The pstrain wire contract and what all three services share.

``pstrain.proto`` and the code generated from it, the tensor codec, the shard map, the
learning-rate schedule, job-spec factories and gRPC transport settings. The services depend
on this package and never on each other.
"""
