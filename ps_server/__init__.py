"""pstrain parameter-server shard: owns one contiguous range of the flat parameters (S1.1).

``shard.ParameterShard`` holds the synchronous push/pull protocol and the optimizer step and
is tested without a network; ``service`` adapts it to gRPC; ``main`` runs the process.
"""
